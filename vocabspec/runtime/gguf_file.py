"""A GGUF file's header, read fast, and its tensors' bytes through one memory map.

gguf-py's GGUFReader builds a numpy object for every string of every array as it opens a file:
for Llama 3's 128k tokens and 280k merges that is 15 s and 600 MB before a byte of weights is
read. A load needs the model's numbers and where each tensor lies; so this reads scalars and
short arrays, steps over long arrays (a tokenizer's) recording only where they lie, and maps
the data. The format is GGUF v2/v3: magic, version, counts, key-value pairs, tensor infos, then
the tensors' data at `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
# Value types: struct code and size.
SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
           7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
STRING, ARRAY = 8, 9
LONG_ARRAY = 4096          # arrays longer than this are stepped over, not read


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands, or is cut short."""


class LongArray:
    """An array stepped over: its item type, length and where it starts in the file."""

    def __init__(self, kind: int, count: int, offset: int):
        self.kind, self.count, self.offset = kind, count, offset

    def __len__(self) -> int:
        return self.count


class Tensor:
    """One tensor's info: name, shape (GGUF's order: ne[0], the row's width, first), type, and
    its bytes as a numpy view of the map (`data`: (rows, row bytes) uint8 for block types,
    float arrays for F32/F16)."""

    def __init__(self, name: str, shape: list[int], type_id: int, offset: int, reader: "GGUFFile"):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.name, self.shape, self.offset = name, shape, offset
        try:
            self.tensor_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"tensor {name} has type id {type_id}, which no GGUF type has") from None
        block, size = GGML_QUANT_SIZES[self.tensor_type]
        count = int(np.prod(shape)) if shape else 1
        if shape and shape[0] % block:
            raise GGUFError(f"tensor {name}: rows of {shape[0]} are not whole {self.tensor_type.name} blocks")
        self.n_elements = count
        self.n_bytes = count // block * size
        self.data_offset = reader.data_start + offset
        if self.data_offset + self.n_bytes > reader.size:
            raise GGUFError(f"tensor {name} runs past the end of the file (truncated?)")
        self._reader = reader

    @property
    def data(self) -> np.ndarray:
        name = self.tensor_type.name
        rows = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        raw = self._reader.array[self.data_offset:self.data_offset + self.n_bytes]
        if name == "F32":
            return raw.view(np.float32).reshape(rows, -1)
        if name == "F16":
            return raw.view(np.float16).reshape(rows, -1)
        return raw.reshape(rows, -1)


class GGUFFile:
    """A GGUF file opened for reading: `fields` (key: value; long arrays as LongArray),
    `tensors` (in file order), and `map` (the read-only map every tensor's data views)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:          # an empty file
                raise GGUFError(f"cannot map the file ({exc})") from exc
        self.size = len(self.map)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.pos = 0
        if self._take(4) != MAGIC:
            raise GGUFError("no GGUF magic at its start")
        version = self._scalar(4)
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} (this reader reads 2 and 3)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        if n_tensors > 1 << 24 or n_kv > 1 << 24:
            raise GGUFError(f"implausible counts ({n_tensors} tensors, {n_kv} keys)")
        self.fields = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = self._scalar(4)
            if dims > 8:
                raise GGUFError(f"tensor {name} has {dims} dimensions")
            shape = [self._scalar(10) for _ in range(dims)]
            infos.append((name, shape, self._scalar(4), self._scalar(10)))
        align = int(self.fields.get("general.alignment", 32))
        if align < 1 or align & (align - 1):
            raise GGUFError(f"general.alignment {align} is not a power of two")
        self.data_start = -(-self.pos // align) * align
        self.tensors = [Tensor(name, shape, kind, offset, self) for name, shape, kind, offset in infos]

    def field(self, key: str, default=None):
        return self.fields.get(key, default)

    def strings(self, key: str) -> list[str]:
        """A string array's items (read in full, long or not)."""
        value = self.fields.get(key)
        if isinstance(value, list):
            return value
        if not isinstance(value, LongArray) or value.kind != STRING:
            raise GGUFError(f"{key} is not an array of strings")
        saved, self.pos = self.pos, value.offset
        try:
            return [self._string() for _ in range(value.count)]
        finally:
            self.pos = saved

    # ---- the header's encoding

    def _take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError("the header runs past the end of the file (truncated?)")
        out = self.map[self.pos:self.pos + n]
        self.pos += n
        return out

    def _scalar(self, kind: int):
        if kind not in SCALARS:
            raise GGUFError(f"value type {kind} is not a scalar")
        code, size = SCALARS[kind]
        return struct.unpack(code, self._take(size))[0]

    def _string(self) -> str:
        length = self._scalar(10)
        if length > self.size:
            raise GGUFError(f"a string of {length} bytes in a file of {self.size}")
        return self._take(length).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            return self._scalar(kind)
        item, count = self._scalar(4), self._scalar(10)
        if count > self.size:
            raise GGUFError(f"an array of {count} items in a file of {self.size} bytes")
        if count <= LONG_ARRAY:
            return [self._value(item) for _ in range(count)]
        start = self.pos
        if item in SCALARS:
            self._take(count * SCALARS[item][1])
        elif item == STRING:     # each a length and its bytes: stepped over in a tight loop
            data, pos, size = self.map, self.pos, self.size
            for _ in range(count):
                if pos + 8 > size:
                    raise GGUFError("a string array runs past the end of the file")
                pos += 8 + int.from_bytes(data[pos:pos + 8], "little")
            if pos > size:
                raise GGUFError("a string array runs past the end of the file")
            self.pos = pos
        else:
            raise GGUFError(f"arrays of type {item} are not read")
        return LongArray(item, count, start)
