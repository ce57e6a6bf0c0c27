"""A GGUF file's matrices packed for the native engine, kept as one file in the cache directory
and memory-mapped.

The first load packs each matrix straight from the GGUF's blocks (read through a memory map)
in C, one tensor at a time, writes it out and lets the source pages go, so building the pack
never holds more than one tensor beside the map. Later loads, in this process or any other,
map the file: its pages are shared between processes and come from the page cache, so a warm
start takes what reading the header takes. Nothing is ever widened to float32.

Layout: `MAGIC`, the JSON index's length (8 bytes, little-endian), the index (each tensor's
type, shape, offset and size), then the tensors' bytes, each at a page boundary.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .files import cache_dir, file_key
from .formats import GGUF_BLOCKS, PackedWeight, UnsupportedType, gguf_row_bytes, pack_blocks, packed_bytes

PACK_VERSION = 3          # bump when the packed layout changes: older packs are rebuilt
MAGIC = b"VSPACK\x00\x03"
PAGE = 4096


class Matrix:
    """What goes into the pack for one matrix: a GGUF tensor's rows, in `order` (None: as
    stored)."""

    def __init__(self, tensor, order: np.ndarray | None = None):
        self.tensor = tensor
        self.type = tensor.tensor_type.name
        self.cols = int(tensor.shape[0])
        self.rows = int(np.prod([int(d) for d in tensor.shape[1:]]))
        self.order = order

    def packed_bytes(self) -> int:
        return packed_bytes(self.type, self.rows, self.cols)


def pack_path(gguf_path: Path) -> Path:
    return cache_dir() / f"{gguf_path.stem}-{file_key(gguf_path)}-pack{PACK_VERSION}.bin"


def check_types(path: Path, matrices: dict[str, Matrix]) -> None:
    """ModelLoadError-ready ValueError naming the first matrix of a type the engine lacks."""
    for name, m in matrices.items():
        if m.type not in GGUF_BLOCKS:
            raise UnsupportedType(f"{path}: tensor {m.tensor.name} is {m.type}, a GGUF type the native engine does "
                                  f"not compute with (it runs {', '.join(GGUF_BLOCKS)}); nothing is widened to "
                                  "float32 behind your back: requantize the file, or load it with --backend torch")
        m.packed_bytes()


def _release(source: mmap.mmap | None, tensor) -> None:
    """Drop a packed tensor's source pages from this process (they stay in the page cache): the
    pack then never holds the file's pages and its own at once."""
    if not isinstance(source, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(tensor.data_offset) // PAGE * PAGE
    end = -(-(int(tensor.data_offset) + int(tensor.n_bytes)) // PAGE) * PAGE
    try:
        source.madvise(mmap.MADV_DONTNEED, start, min(end, len(source)) - start)
    except (OSError, ValueError):
        pass


def build(path: Path, target: Path, matrices: dict[str, Matrix], source: mmap.mmap | None = None,
          progress=None) -> None:
    """Pack every matrix into `target`, written atomically (a concurrent reader sees the old
    file or the whole new one); `source`: the GGUF's map, whose pages each packed tensor lets go."""
    index, offset = {}, 0
    for name, m in matrices.items():
        size = m.packed_bytes()
        index[name] = {"type": m.type, "rows": m.rows, "cols": m.cols, "offset": offset, "nbytes": size}
        offset += -(-size // PAGE) * PAGE
    header = json.dumps({"version": PACK_VERSION, "source": path.name, "tensors": index}).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // PAGE) * PAGE
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    total, done = sum(entry["nbytes"] for entry in index.values()), 0
    # One buffer for every tensor, in huge pages where the kernel gives them: a fresh page's
    # first touch costs tens of microseconds on a VM, a second of a large tensor's packing.
    largest = max(entry["nbytes"] for entry in index.values())
    buffer = mmap.mmap(-1, largest)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    space = torch.frombuffer(buffer, dtype=torch.uint8)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            for name, m in matrices.items():
                entry = index[name]
                raw = np.asarray(m.tensor.data).view(np.uint8).reshape(-1, gguf_row_bytes(m.type, m.cols))
                out = space[:entry["nbytes"]]
                pack_blocks(m.type, raw, m.rows, m.cols, order=m.order, out=out)
                f.seek(start + entry["offset"])
                f.write(memoryview(out.numpy()))
                del raw, out
                _release(source, m.tensor)
                done += entry["nbytes"]
                if progress is not None:
                    progress(done, total)
            f.truncate(start + offset)
        os.replace(tmp, target)
    finally:
        del space
        buffer.close()
        tmp.unlink(missing_ok=True)


class PackFile:
    """A pack's matrices as PackedWeights over one read-only mapping of the file."""

    def __init__(self, target: Path):
        with open(target, "rb") as f:
            head = f.read(len(MAGIC) + 8)
            if head[:len(MAGIC)] != MAGIC:
                raise ValueError(f"{target}: not a vocabspec pack of version {PACK_VERSION}")
            length = int.from_bytes(head[len(MAGIC):], "little")
            meta = json.loads(f.read(length))
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)   # private: never written back
        self.start = -(-(len(MAGIC) + 8 + length) // PAGE) * PAGE
        self.index = meta["tensors"]
        self.path = target
        # Huge pages where the kernel maps file pages so (large page-cache folios): a forward
        # streams every weight, and with 4 KB pages it spends a fifth of its time on TLB misses
        # (Llama 3.1 8B's decode: 5.4 tok/s with them, 4.5 without, on the 2-core EPYC).
        for advice in ("MADV_HUGEPAGE", "MADV_WILLNEED"):     # then read ahead: a forward reads it all
            if hasattr(mmap, advice):
                try:
                    self.map.madvise(getattr(mmap, advice))
                except OSError:
                    pass

    def weight(self, name: str, int8_acts: bool, bias: torch.Tensor | None = None) -> PackedWeight:
        entry = self.index[name]
        data = torch.frombuffer(self.map, dtype=torch.uint8, count=entry["nbytes"], offset=self.start + entry["offset"])
        return PackedWeight(entry["type"], entry["rows"], entry["cols"], data,
                            None if bias is None else bias.float().contiguous(),
                            int8_acts and entry["type"] not in ("F32", "F16", "BF16"), entry["type"])

    @property
    def nbytes(self) -> int:
        return len(self.map)


def open_pack(path: Path, matrices: dict[str, Matrix], source: mmap.mmap | None = None, log=None) -> PackFile:
    """The pack of `path` (a GGUF file) holding `matrices`, built first where it is missing or
    stale (a broken or older one is rebuilt)."""
    target = pack_path(path)
    if target.exists():
        try:
            pack = PackFile(target)
            if set(pack.index) == set(matrices) and all(
                    pack.index[n]["type"] == m.type and pack.index[n]["rows"] == m.rows for n, m in matrices.items()):
                return pack
        except (OSError, ValueError, KeyError):
            pass
    started = time.perf_counter()
    total = sum(m.packed_bytes() for m in matrices.values())
    say = log or (lambda message: print(message, file=sys.stderr))
    say(f"[{path.name}: packing {len(matrices)} matrices ({total / 2**30:.2f} GiB) for the native engine, once]")
    last = [0.0]

    def progress(done, whole):
        now = time.perf_counter()
        if now - last[0] > 5 or done == whole:
            last[0] = now
            say(f"[packed {done / 2**30:.2f} of {whole / 2**30:.2f} GiB, {now - started:.0f} s]")

    build(path, target, matrices, source, progress if total > 2**28 else None)
    return PackFile(target)
