"""The native CPU engine: build, load and call the kernels of native.c.

Why it exists: exactness in every precision and the speed of the file's own low-bit weights.
A tree verification must give every row the bits one-token decoding gives it. None of torch's
CPU attention kernels does (their reduction order depends on the number of query rows and on
masked columns), and its low-bit matmuls cover neither GGUF's 8-bit groups nor K-quants
losslessly. native.c computes a whole stack of decoder layers with one fixed reduction order
per row, over weights kept in their GGUF groups, in one call per forward.

The library is compiled on first use with the machine's C compiler into the cache directory
(keyed by the source, the compiler and the CPU), and shares torch's OpenMP threads: torch is
imported first, so the dynamic loader hands the library torch's libgomp. It needs AVX-512 (F,
BW) or AVX2 with FMA and F16C; the same per-lane arithmetic runs on both. A fresh build must
pass a self-test (every row of a matmul alone has the bits it has among others) before it is
kept. Where it cannot be built or fails the test, `available()` says why.

VOCABSPEC_SANITIZE=1 builds it instead with AddressSanitizer and UndefinedBehaviorSanitizer
(a library of its own, never the default one): a memory error or undefined behaviour aborts
the process with a report. Python is not built with ASan, so the ASan runtime must come first:
LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 (tests/sanitize.py
runs tests so).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .files import cache_dir

SOURCE = Path(__file__).with_name("native.c")
KERNELS = SOURCE.with_name("native_kernels.c")
# What the library is built from: native.c and what it includes (native.h: the ABI;
# native_vec.h: the vectors; native_layout.h: the weight layout's numbers; native_weights.c:
# packing, gathers and dequantization; native_threads.c: the governor), and the matmul kernels,
# a unit of their own compiled in two halves beside it (one process a core).
SOURCES = [SOURCE, KERNELS] + [SOURCE.with_name(name) for name in (
    "native.h", "native_vec.h", "native_layout.h", "native_weights.c", "native_threads.c")]

_lib = None
_error: str | None = None
P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float   # the structs' fields


class Weight(ctypes.Structure):
    _fields_ = [("type", I32), ("rows", I32), ("cols", I32), ("int8_acts", I32), ("data", P), ("bias", P)]


class Layer(ctypes.Structure):
    _fields_ = [*((name, Weight) for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")),
                *((name, P) for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm",
                                         "k_norm", "hidden_norm", "cos", "sin")),
                ("window", I32), ("norm_residual", I32)]


class Stack(ctypes.Structure):
    _fields_ = [*((name, I32) for name in ("dim", "n_heads", "n_kv", "head_dim", "hidden", "max_len", "n_layers",
                                           "act")),
                ("eps", F32), ("attn_scale", F32), ("kv_half", I32), ("pad", I32), ("layers", ctypes.POINTER(Layer))]


class TreeStop(ctypes.Structure):
    _fields_ = [("chance", P), ("depths", I64), ("bins", I64), ("min_gain", ctypes.c_double),
                ("node_cost", ctypes.c_double), ("levels", I64), ("rows", I64)]


class TreeRequest(ctypes.Structure):
    _fields_ = [("drafter", P), ("stack", P), ("keys", P), ("values", P), ("length", I64), ("state", P),
                ("root", I64), ("top_k", I64), ("depth", I64), ("total_tokens", I64), ("stop", P),
                ("tokens", P), ("parents", P), ("ranks", P), ("node_values", P), ("head_logits", P), ("work", P),
                ("att", P)]


class Rows(ctypes.Structure):
    _fields_ = [("n", I64), ("ntaps", I64), ("pos", P), ("prefix", P), ("xoff", P), ("extra", P), ("slot", P),
                ("taps", P), ("keys", P), ("values", P), ("embeds", P), ("tapped", P)]


class VerifyRequest(ctypes.Structure):
    _fields_ = [("norm", P), ("head", P), ("hidden", P), ("offsets", P), ("tokens", P), ("parents", P),
                ("paths", P), ("counts", P), ("next", P), ("work", P), ("ntrees", I64), ("head_rows", I64),
                ("eps", F32), ("pad", I32)]


class ReadRequest(ctypes.Structure):
    _fields_ = [("drafter", P), ("stack", P), ("keys", P), ("values", P), ("length", I64), ("n", I64),
                ("tokens", P), ("hidden", P), ("state", P), ("scratch", P), ("work", P), ("att", P)]


class Cache(ctypes.Structure):
    _fields_ = [("keys", P), ("values", P), *((name, I64) for name in ("layers", "n_kv", "head_dim", "slots", "half"))]


class Drafter(ctypes.Structure):
    _fields_ = [("fc", Weight), ("head", Weight), ("embed", Weight), ("head_ids", P), ("norm", P), ("head_norm", P),
                ("out_norm", P), ("eps", F32), ("embed_scale", F32), ("fused", I32), ("pad", I32)]


def _cpuinfo(prefix: str) -> str:
    """/proc/cpuinfo's first line starting with `prefix` ("" if none; platform.processor()
    where the file cannot be read). Its "flags" line keys the build."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(prefix)), "")
    except OSError:
        return platform.processor()


# Every row's bits must not depend on the call: no contraction the source does not write, no
# reassociation, whatever defaults a compiler wrapper in $CC adds before these.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-fast-math",
         "-fno-unsafe-math-optimizations", "-fno-associative-math", "-fno-reciprocal-math",
         "-fno-finite-math-only", "-fsigned-zeros", "-ftrapping-math", "-fPIC", "-shared"]
# VOCABSPEC_SANITIZE=1: every report ends the process (no recovery), so that a test under it
# fails rather than logging and going on; frame pointers and line tables give readable stacks.
# -O1, not -O3: instrumented, -O3 takes gcc minutes on a small machine, -O1 under one.
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]


def sanitized() -> bool:
    """Whether this process builds and loads the sanitizer build (VOCABSPEC_SANITIZE=1)."""
    return os.environ.get("VOCABSPEC_SANITIZE", "") not in ("", "0")


def _flags() -> list[str]:
    # VOCABSPEC_NATIVE_DEFINES: -D options for trying a kernel's constants (a library of its
    # own, keyed by them), e.g. "-DPREFETCH=1024".
    defines = os.environ.get("VOCABSPEC_NATIVE_DEFINES", "").split()
    if any(not d.startswith("-D") for d in defines):
        raise RuntimeError(f"VOCABSPEC_NATIVE_DEFINES takes -D options only, not {defines}")
    # The tiles' weight blocks for one row and for four (native_kernels.c): four each on an
    # Intel Xeon (AVX-512: Gemma's token 16% faster, an 8B's 4-row forward 1.22x one row
    # against 1.59x); one and two measured faster on AMD's Zen 4. No bit depends on them.
    amd = _cpuinfo("vendor_id").partition(":")[2].strip() == "AuthenticAMD"
    for name, value in (("VS_NR_ONE", 1 if amd else 4), ("VS_NR_FOUR", 2 if amd else 4)):
        if not any(d.startswith(f"-D{name}") for d in defines):
            defines = [f"-D{name}={value}"] + defines
    if not sanitized():
        return FLAGS + defines
    return ["-O1" if flag == "-O3" else flag for flag in FLAGS] + SANITIZE_FLAGS + defines


def isa() -> str:
    """The instruction set the engine compiles for here: avx512 or avx2 (RuntimeError if neither)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the native engine needs an x86-64 CPU ({platform.machine()})")
    flags = set(_cpuinfo("flags").split())
    if {"avx512f", "avx512bw"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    raise RuntimeError("the native engine needs AVX-512 (F, BW) or AVX2 with FMA and F16C, which this CPU lacks")


def _check_sanitizer_runtime() -> None:
    """The sanitizer build loads only after the ASan runtime (RuntimeError saying how, else)."""
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):
        raise RuntimeError("VOCABSPEC_SANITIZE=1 needs the AddressSanitizer runtime loaded first: run with "
                           "LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0")


def _build(compiler: str) -> Path:
    flags = _flags()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES) + version.encode() + _cpuinfo("flags").encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"native-{'sanitized-' if sanitized() else ''}{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        out = Path(tmp) / target.name
        compile_flags = [flag for flag in flags if flag != "-shared"]
        units = [(SOURCE, []), (KERNELS, ["-DVS_PART=0"]), (KERNELS, ["-DVS_PART=1"])]
        commands = [[compiler, *compile_flags, *extra, "-I", str(SOURCE.parent), "-c", "-o", str(Path(tmp) / f"{i}.o"),
                     str(path)] for i, (path, extra) in enumerate(units)]
        running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in commands]
        for cmd, process in zip(commands, running):
            _, err = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.strip()[-2000:]}")
        link = [compiler, *flags, "-o", str(out), *(cmd[-2] for cmd in commands), "-lm"]
        done = subprocess.run(link, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(link)} failed:\n{done.stderr.strip()[-2000:]}")
        lib = _declare(ctypes.CDLL(str(out)))
        check_abi(lib)
        _self_test(lib)
        os.replace(out, target)   # atomic: a concurrent build of the same key is harmless
    return target


def _self_test(lib) -> None:
    """Row invariance, checked once per build: each of 7 rows through a matmul of every kind
    family (float, quantized, 8-bit activations where built) and the fused top-k must get the
    bits it gets alone. RuntimeError names the first that does not."""
    generator = torch.Generator().manual_seed(0)
    rows, cols, n = 40, 96, 7          # 40: a block of 16 rows with a tail
    weight = torch.randn(rows, cols, generator=generator)
    x = torch.randn(n, cols, generator=generator)
    f32 = _test_weight(lib, 0, weight.view(torch.uint8).reshape(rows, -1), rows, cols)
    # Q8_0: a float16 scale and 32 signed codes a block, here random codes and scales
    codes = torch.randint(-128, 128, (rows, cols), generator=generator, dtype=torch.int8)
    scales = (torch.rand(rows, cols // 32, generator=generator) + 0.5).half()
    blocks = torch.cat([scales.view(torch.uint8).reshape(rows, -1, 2), codes.view(torch.uint8).reshape(rows, -1, 32)],
                       -1).reshape(rows, -1)
    q8i = _test_weight(lib, 7, blocks, rows, cols, int8=True)
    checks = [("f32 matmul", f32)] + ([("8-bit-activation matmul", q8i)] if lib.vs_has_int8() else [])
    for name, (w, _) in checks:
        together = torch.empty(n, rows)
        lib.vs_linear(ctypes.byref(w), x.data_ptr(), n, together.data_ptr())
        for i in range(n):
            alone = torch.empty(1, rows)
            lib.vs_linear(ctypes.byref(w), x[i:i + 1].contiguous().data_ptr(), 1, alone.data_ptr())
            if not torch.equal(alone[0], together[i]):
                raise RuntimeError(f"self-test failed: a row of a {name} changes with the rows beside it "
                                   "(the compiler reordered the arithmetic?)")
    ids, logprobs, logits = torch.empty(n, 4, dtype=torch.int64), torch.empty(n, 4), torch.empty(n, rows)
    lib.vs_linear_topk(ctypes.byref(f32[0]), x.data_ptr(), n, 4, logits.data_ptr(), ids.data_ptr(), logprobs.data_ptr())
    if not torch.equal(ids, torch.topk(logits, 4).indices):
        raise RuntimeError("self-test failed: the fused top-k disagrees with the products it ranks")


def _test_weight(lib, type_id: int, raw: torch.Tensor, rows: int, cols: int, int8: bool = False):
    """(Weight, its bytes) packed from row-major GGUF rows `raw` (uint8, rows x row bytes)."""
    raw = raw.contiguous()
    data = torch.empty(lib.vs_packed_bytes(type_id, rows, cols), dtype=torch.uint8)
    lib.vs_pack(type_id, raw.data_ptr(), raw.shape[1], rows, cols, None, data.data_ptr())
    return Weight(type=type_id, rows=rows, cols=cols, int8_acts=int(int8), data=data.data_ptr()), data


def check_abi(lib) -> None:
    """native.h's structs against the ctypes mirrors here: every size and offset the library
    reports (vs_abi) must match, else RuntimeError naming the first that does not."""
    want = [n for struct, names in (
        (Weight, ("type", "rows", "cols", "int8_acts", "data", "bias")),
        (Layer, ("wq", "w_down", "attn_norm", "hidden_norm", "cos", "sin", "window", "norm_residual")),
        (Stack, ("eps", "kv_half", "layers")),
        (Drafter, ("head", "embed", "head_ids", "out_norm", "eps", "fused")),
        (TreeStop, ("depths", "bins", "min_gain", "node_cost", "levels", "rows")),
        (TreeRequest, ("length", "root", "stop", "node_values", "att")),
        (Rows, ("ntaps", "pos", "taps", "keys", "values", "embeds", "tapped")),
        (VerifyRequest, ("head", "offsets", "paths", "work", "ntrees", "head_rows", "eps")),
        (ReadRequest, ("stack", "keys", "length", "n", "tokens", "state", "att")),
        (Cache, ("values", "layers", "slots", "half")))
        for n in (ctypes.sizeof(struct), *(getattr(struct, name).offset for name in names))]
    got = (ctypes.c_int64 * 128)()
    n = lib.vs_abi(got, 128)
    if n != len(want) or list(got[:n]) != want:
        first = next((i for i in range(min(n, len(want))) if got[i] != want[i]), min(n, len(want)))
        raise RuntimeError(f"native.h and native.py disagree on the ABI's structs (entry {first} of vs_abi: "
                           f"{list(got[:n])} against {want})")


def _declare(lib):
    lib.vs_linear.argtypes = [ctypes.POINTER(Weight), P, I64, P]
    lib.vs_has_int8.restype = ctypes.c_int
    lib.vs_tile_rows.restype = ctypes.c_int
    lib.vs_linear_topk.argtypes = [ctypes.POINTER(Weight), P, I64, I64, P, P, P]
    lib.vs_dequant_rows.argtypes = [ctypes.POINTER(Weight), I64, I64, P]
    lib.vs_take_rows.argtypes = [ctypes.POINTER(Weight), P, I64, P]
    lib.vs_packed_bytes.argtypes = [ctypes.c_int32, I64, I64]
    lib.vs_packed_bytes.restype = I64
    lib.vs_pack.argtypes = [ctypes.c_int32, P, I64, I64, I64, P, P]
    lib.vs_abi.argtypes = [P, I64]
    lib.vs_abi.restype = I64
    lib.vs_embed.argtypes = [ctypes.POINTER(Weight), P, I64, F32, P]
    lib.vs_head.argtypes = [P, F32, ctypes.POINTER(Weight), P, I64, P, P]
    lib.vs_stack_work.argtypes = [ctypes.POINTER(Stack), I64]
    lib.vs_stack_work.restype = I64
    lib.vs_attention_scratch.argtypes = [ctypes.POINTER(Stack)]
    lib.vs_attention_scratch.restype = I64
    lib.vs_cache_keep.argtypes = [ctypes.POINTER(Cache), I64, P, I64]
    lib.vs_stack_forward_rows.argtypes = [ctypes.POINTER(Stack), P, ctypes.POINTER(Rows), P, P]
    lib.vs_verify_greedy.argtypes = [ctypes.POINTER(VerifyRequest)]
    lib.vs_drafter_read.argtypes = [ctypes.POINTER(ReadRequest)]
    lib.vs_drafter_read_scratch.argtypes = [ctypes.POINTER(Drafter), I64]
    lib.vs_drafter_read_scratch.restype = I64
    lib.vs_tree_capacity.argtypes = [I64, I64]
    lib.vs_tree_capacity.restype = I64
    lib.vs_eagle_tree.argtypes = [ctypes.POINTER(TreeRequest)]
    lib.vs_eagle_tree.restype = I64
    lib.vs_set_threads.argtypes = [ctypes.c_int]
    lib.vs_threads.restype = ctypes.c_int
    lib.vs_threads_observe.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.c_double]
    return lib


def library():
    """The loaded kernels (ctypes.CDLL), built on first use; RuntimeError if unavailable."""
    global _lib, _error
    if _lib is not None:
        return _lib
    if _error is not None:
        raise RuntimeError(_error)
    try:
        lib = load_build()
    except (RuntimeError, OSError) as exc:
        _error = f"native CPU engine unavailable: {exc}"
        raise RuntimeError(_error) from exc
    _lib = lib
    return lib


def load_build():
    """A fresh load of the library this process's flags build (VOCABSPEC_NATIVE_DEFINES
    included), compiled where not yet cached, declared and checked against native.h: what
    `library()` loads once, and what scripts/native_variants.py loads once per variant."""
    isa()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the native engine is compiled on first use and needs a C compiler (cc)")
    if sanitized():
        _check_sanitizer_runtime()
    lib = _declare(ctypes.CDLL(str(_build(compiler))))
    check_abi(lib)
    return lib


def has_int8() -> bool:
    """Whether products with 8-bit activations (`gguf-a8`) run here: AVX-512 VNNI, or AVX2."""
    return bool(library().vs_has_int8())


def set_threads(n: int = 0) -> None:
    """n > 0: every native call runs n threads (at most OpenMP's maximum, OMP_NUM_THREADS);
    0 (the default): each forward measures the CPU share its threads get and the team shrinks
    while other processes hold cores (see native.c, "threads"). Bits never depend on it."""
    if n < 0:
        raise ValueError(f"threads must be 0 (adaptive) or positive, not {n}")
    library().vs_set_threads(n)


def threads() -> int:
    """The threads the next native call runs."""
    return library().vs_threads()


def available() -> tuple[bool, str]:
    """(True, "") where the native engine runs here, else (False, why)."""
    try:
        library()
        return True, ""
    except RuntimeError as exc:
        return False, str(exc)


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for native.c; only host memory has one (a meta tensor's is 0)."""
    if t is None:
        return None
    if t.device.type != "cpu":
        raise ValueError(f"the native engine reads host memory, not a tensor on {t.device}")
    return t.data_ptr()


# ---- the boundary: every index and size a call hands to native.c is checked here, once per
# call, so that a wrong one raises ValueError naming it instead of reading or writing outside
# a buffer in C.

def check_range(what: str, values: torch.Tensor, low: int, high: int) -> None:
    """ValueError naming the first of `values` outside [low, high)."""
    flat = values.reshape(-1)
    if flat.numel() == 0:
        return
    # A step's few indices are checked as a list: torch's comparisons cost microseconds a call,
    # and a step makes several.
    least, most = (min(items := flat.tolist()), max(items)) if flat.numel() <= 256 else map(int, torch.aminmax(flat))
    if least < low or most >= high:
        value = next(v for v in flat.tolist() if not low <= v < high)
        raise ValueError(f"{what} {value} is outside [{low}, {high})")


def check_index(what: str, value: int, low: int, high: int) -> None:
    """ValueError where the index `value` is outside [low, high)."""
    if not low <= value < high:
        raise ValueError(f"{what} {value} is outside [{low}, {high})")


def check_parents(what: str, parents: torch.Tensor | list[int]) -> None:
    """A tree's parents (-1 for the root at row 0, every other row's parent an earlier row):
    ValueError naming the first row that breaks it."""
    rows = parents.tolist() if isinstance(parents, torch.Tensor) else parents
    if not rows:
        raise ValueError(f"{what}: a tree has at least its root")
    if rows[0] != -1:
        raise ValueError(f"{what}: row 0 is the root (parent -1), not a child of {rows[0]}")
    for row, parent in enumerate(rows):
        if row and not 0 <= parent < row:
            raise ValueError(f"{what}: row {row}'s parent {parent} is not an earlier row")


def check_count(what: str, value: int, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"{what} must be an integer {bound}, not {value!r}")


def visibility(length: int, pending: int, positions: torch.Tensor, tree_mask: torch.Tensor | None):
    """What each new row attends to, as native.c reads it (native.h's drawing): (prefix, xoff,
    extra), int32. Without a tree mask the rows are causal after every pending slot; with one
    (n, pending + n), row r sees the slots the mask marks."""
    n = positions.shape[0]
    pos = positions.to(torch.int64)
    if tree_mask is None:
        prefix = torch.arange(length + pending + 1, length + pending + n + 1, dtype=torch.int64)
        if not torch.equal(pos, prefix - 1):
            raise ValueError("without a tree mask the new tokens must take the positions right "
                             "after the cached ones")
        return prefix.to(torch.int32), torch.zeros(n + 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    mask = tree_mask.to(torch.bool)
    if mask.shape != (n, pending + n):
        raise ValueError(f"tree mask of shape {tuple(mask.shape)}; expected ({n}, {pending + n})")
    new = mask[:, pending:]
    if not bool(new.diagonal().all()):
        raise ValueError("every tree row must see itself")
    counts = mask.sum(1)
    if not torch.equal(counts + length, pos + 1):
        raise ValueError("each tree row must see exactly one token per position before its own "
                         "(its ancestors)")
    # The new tokens a row sees must hold consecutive positions ending at its own.
    seen = torch.where(new, pos[None, :], -1)
    firsts = (pos - new.sum(1) + 1)[:, None]
    expect = torch.where(new, firsts + new.cumsum(1) - 1, -1)
    if not torch.equal(seen, expect):
        raise ValueError("a tree row must see its ancestors in position order")
    cols = mask.nonzero()[:, 1]
    xoff = torch.zeros(n + 1, dtype=torch.int32)
    xoff[1:] = counts.cumsum(0)
    return (torch.full((n,), length, dtype=torch.int32), xoff,
            (cols + length).to(torch.int32) if cols.numel() else torch.zeros(1, dtype=torch.int32))


def _tree_stop(stop) -> TreeStop | None:
    """vs_tree_stop for a live_tree.TreeStop (None for None); it points into the TreeStop's
    own float64 table, which outlives the call."""
    if stop is None:
        return None
    table = stop.table
    if table.dtype != torch.float64 or not table.is_contiguous() or table.dim() != 2:
        raise ValueError("a tree stop's chances are a contiguous float64 (depths, bins) table")
    return TreeStop(chance=table.data_ptr(), depths=table.shape[0], bins=table.shape[1],
                    min_gain=float(stop.min_gain), node_cost=float(stop.node_cost))


def tree_visibility(parents: list[int], start: int, base: int) -> tuple[list[int], list[int], list[int]]:
    """A tree's rows (parents: -1 for the root, each other row's an earlier row) written after
    `start` cache slots with the root at position `base`, as native.h draws visibility with
    every row's prefix `start`: (positions, where each row's slots end in extra, extra). Each
    row sees its ancestors' slots, then its own."""
    check_parents("tree", parents)
    paths, pos, ends, extra = [], [], [], []
    for row, parent in enumerate(parents):
        path = (paths[parent] if row else []) + [start + row]
        paths.append(path)
        pos.append(base + len(path) - 1)
        extra += path
        ends.append(len(extra))
    return pos, ends, extra


class NativeStack:
    """Decoder layers on the native engine: their description is built once; a forward is one
    call. `layers`: one dict per layer with PackedWeights wq, wk, wv, wo, w_gate, w_up, w_down
    and float32 tensors (or None) attn_norm, mlp_norm, post_attn_norm, post_mlp_norm, q_norm,
    k_norm, plus its RoPE tables cos, sin and its sliding window (0: none). EAGLE-3's first
    layer adds hidden_norm (its q, k and v then read the rows' embeddings through attn_norm
    beside the rows through hidden_norm) and norm_residual (the residual is the normed row)."""

    def __init__(self, dim: int, n_heads: int, n_kv: int, head_dim: int, hidden: int,
                 eps: float, attn_scale: float, gelu: bool, layers: list[dict], kv_half: bool = False):
        library()
        self.keep = layers            # the tensors the structs point into
        self.layers = (Layer * len(layers))()
        for i, spec in enumerate(layers):
            entry = self.layers[i]
            for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
                setattr(entry, name, spec[name].struct())
            for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm",
                         "k_norm", "hidden_norm", "cos", "sin"):
                tensor = spec.get(name)
                if tensor is not None and (tensor.dtype != torch.float32 or not tensor.is_contiguous()):
                    raise ValueError(f"layer {i}: {name} must be a contiguous float32 tensor")
                setattr(entry, name, ptr(tensor))
            entry.window = spec.get("window", 0)
            entry.norm_residual = int(spec.get("norm_residual", False))
            if spec.get("hidden_norm") is not None and spec.get("attn_norm") is None:
                raise ValueError(f"layer {i}: hidden_norm needs attn_norm (the embeddings' norm)")
        self.stack = Stack(dim=dim, n_heads=n_heads, n_kv=n_kv, head_dim=head_dim, hidden=hidden,
                           max_len=0, n_layers=len(layers), act=int(gelu), eps=eps,
                           attn_scale=attn_scale, kv_half=int(kv_half), layers=self.layers)
        # What its caches hold: keys and values rounded to halves once when stored (as
        # llama.cpp's default cache), which halves the memory a step reads; or floats.
        self.kv_dtype = torch.float16 if kv_half else torch.float32
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.work = torch.empty(0, dtype=torch.float32)
        self.dim, self.n_layers, self.n_kv, self.head_dim = dim, len(layers), n_kv, head_dim
        self.reads_embeds = any(spec.get("hidden_norm") is not None for spec in layers)
        # Positions the RoPE tables hold rows for (cos: positions x half the head).
        self.positions = min((spec["cos"].shape[0] for spec in layers if spec.get("cos") is not None),
                             default=2 ** 31 - 1)

    def check_cache(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """The slots of a cache in this stack's native layout (ValueError if it is not)."""
        slots = values.shape[-2]
        if slots % 16 or keys.shape != (self.n_layers, self.n_kv, slots // 16, self.head_dim, 16) or \
                values.shape != (self.n_layers, self.n_kv, slots, self.head_dim) or \
                keys.dtype != self.kv_dtype or values.dtype != self.kv_dtype:
            raise ValueError("the cache does not have the native layout of this stack")
        return slots

    def reserve(self, rows: int, slots: int) -> None:
        """Size the workspace for forwards of up to `rows` rows over a cache of `slots`."""
        lib = library()
        self.stack.max_len = slots
        need = lib.vs_stack_work(ctypes.byref(self.stack), rows)
        if self.work.numel() < need:
            self.work = torch.empty(need, dtype=torch.float32)
        need = lib.vs_attention_scratch(ctypes.byref(self.stack))
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.float32)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                length: int, pending: int, tree_mask: torch.Tensor | None = None,
                taps: tuple[int, ...] = (), embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run x (n, dim), float32, in place through the layers of one sequence (a drafter's
        tree growing level by level); the new keys and values go to the slots after the
        `length` committed and `pending` uncommitted ones. What each row sees: `tree_mask`
        (see `visibility`), or causally. `embeds` (n, dim): the rows' token embeddings, for a
        stack whose first layer reads them (EAGLE-3's). Returns the `taps` layers' outputs side
        by side (n, len(taps) * dim), or None."""
        n = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self.dim:
            raise ValueError("native forward needs contiguous float32 rows of the model width")
        if self.reads_embeds and (embeds is None or embeds.dtype != torch.float32 or not embeds.is_contiguous()
                                  or embeds.shape != x.shape):
            raise ValueError("this stack's first layer reads the rows' embeddings: contiguous float32, x's shape")
        slots = self.check_cache(keys, values)
        check_count("the cache's committed length", length, 0)
        check_count("the cache's pending slots", pending, 0)
        if length + pending + n > slots:
            raise ValueError(f"sequence would reach {length + pending + n} tokens, beyond the cache's {slots}")
        if positions is None or positions.numel() != n:
            raise ValueError(f"{n} rows need {n} positions")
        prefix, xoff, extra = visibility(length, pending, positions, tree_mask)
        pos32 = positions.to(torch.int32).contiguous()
        slot = torch.arange(length + pending, length + pending + n, dtype=torch.int32)
        return self._run(x, pos32, prefix, xoff, extra, torch.full((n,), keys.data_ptr(), dtype=torch.int64),
                         torch.full((n,), values.data_ptr(), dtype=torch.int64), slot, slots, taps,
                         embeds if self.reads_embeds else None)

    def forward_rows(self, x: torch.Tensor, parts: list[tuple], taps: tuple[int, ...] = ()) -> torch.Tensor | None:
        """A step's rows in one call, each part a sequence over a cache of its own: parts are
        (keys, values, length, parents or None, rows), their rows following one another in x;
        a part's rows go after its `length` committed slots, causally or as a tree (`parents`
        (rows,), -1 for its root at position `length`, each row at its depth after it). Every
        row gets the bits it gets in a call of its own part. Returns the taps' outputs as
        `forward` does."""
        n = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self.dim:
            raise ValueError("native forward needs contiguous float32 rows of the model width")
        if self.reads_embeds:
            raise ValueError("a stack that reads embeddings (EAGLE-3's) runs one sequence a call (forward)")
        if sum(part[4] for part in parts) != n:
            raise ValueError("the parts' rows do not add up to x's")
        slots = {self.check_cache(keys, values) for keys, values, *_ in parts}
        if len(slots) != 1:
            raise ValueError("the caches of one call must have the same size")
        slots = slots.pop()
        # Built as lists, two tensors at the end: a batch of plain steps is a part per row.
        pos, prefix, xoff, extra, keys_at, values_at, slot = [], [], [0], [], [], [], []
        for keys, values, length, parents, rows in parts:
            check_count("a part's committed length", length, 0)
            check_count("a part's rows", rows, 1)
            if parents is not None and parents.numel() != rows:
                raise ValueError(f"{parents.numel()} parents for a part of {rows} rows")
            if length + rows > slots:
                raise ValueError(f"sequence would reach {length + rows} tokens, beyond the cache's {slots}")
            if parents is not None:
                p, ends, seen = tree_visibility(parents.tolist(), length, length)
                pos += p
                prefix += [length] * rows
                xoff += [len(extra) + end for end in ends]
                extra += seen
            else:                     # causal: each row sees the slots up to its own
                pos += range(length, length + rows)
                prefix += range(length + 1, length + rows + 1)
                xoff += [len(extra)] * rows
            keys_at += [keys.data_ptr()] * rows
            values_at += [values.data_ptr()] * rows
            slot += range(length, length + rows)
        ints = torch.tensor(pos + prefix + xoff + slot + (extra or [0]), dtype=torch.int32)
        pos32, prefix, xoff, slot, extra = ints.split([n, n, n + 1, n, max(len(extra), 1)])
        keys_at, values_at = torch.tensor(keys_at + values_at, dtype=torch.int64).split(n)
        return self._run(x, pos32, prefix, xoff, extra, keys_at, values_at, slot, slots, taps, None)

    def _run(self, x, pos32, prefix, xoff, extra, keys_at, values_at, slot, slots: int, taps: tuple[int, ...],
             embeds) -> torch.Tensor | None:
        """The one native call (`vs_stack_forward_rows`) over rows whose visibility, caches
        (each row's keys and values addresses) and slots are built."""
        n = x.shape[0]
        check_range("position", pos32, 0, self.positions)
        self.reserve(n, slots)
        tapped = torch.empty(n, len(taps) * self.dim) if taps else None
        tap_ids = torch.tensor(taps, dtype=torch.int32) if taps else None
        rows = Rows(n=n, ntaps=len(taps), pos=pos32.data_ptr(), prefix=prefix.data_ptr(), xoff=xoff.data_ptr(),
                    extra=extra.data_ptr(), slot=slot.data_ptr(), taps=ptr(tap_ids), keys=keys_at.data_ptr(),
                    values=values_at.data_ptr(), embeds=ptr(embeds), tapped=ptr(tapped))
        library().vs_stack_forward_rows(ctypes.byref(self.stack), ptr(x), ctypes.byref(rows),
                                        self.work.data_ptr(), self.scratch.data_ptr())
        return tapped


def cache_keep(keys: torch.Tensor, values: torch.Tensor, length: int, keep: list[int]) -> None:
    """Keep pending slots `keep` (increasing, counted from `length`) of a native-layout cache,
    packed after the committed ones, in one call."""
    layers, n_kv, slots, head_dim = values.shape
    kept = torch.tensor(keep, dtype=torch.int64)
    if keys.dtype != values.dtype or keys.dtype not in (torch.float16, torch.float32):
        raise ValueError("a native cache holds float32 or float16 keys and values")
    if slots % 16 or keys.shape != (layers, n_kv, slots // 16, head_dim, 16):
        raise ValueError("the cache does not have the native layout")
    check_count("the cache's committed length", length, 0, slots)
    check_range("kept pending slot", kept, 0, slots - length)
    if kept.numel() > 1 and not bool((kept[1:] > kept[:-1]).all()):
        raise ValueError(f"kept pending slots must increase: {keep}")
    cache = Cache(keys=keys.data_ptr(), values=values.data_ptr(), layers=layers, n_kv=n_kv, head_dim=head_dim,
                  slots=slots, half=int(keys.dtype == torch.float16))
    library().vs_cache_keep(ctypes.byref(cache), length, kept.data_ptr(), len(keep))


class NativeDrafter:
    """An EAGLE drafter on the native engine, a read of committed tokens and a whole draft tree
    in one call each (`vs_drafter_read`, `vs_eagle_tree`; tree.TreeBuilder is the reference the
    tree follows). fc and the stack are the drafter's; head: its draft head over the target's
    rows `head_ids` (None: all); embed, embed_scale: the embedding it reads. EAGLE-2: norm, eps:
    the target's final norm its features go through; fc reads (embedding, feature). EAGLE-3
    (`fused`): fc fuses the target's tapped rows; the stack's first layer reads the embeddings;
    head_norm: the norm the head reads the states through, or out_norm: the one that makes the
    outputs states."""

    def __init__(self, fc, stack: NativeStack, head, head_ids: torch.Tensor | None, embed,
                 embed_scale: float | None, norm: torch.Tensor | None, eps: float, fused: bool = False,
                 head_norm: torch.Tensor | None = None, out_norm: torch.Tensor | None = None):
        if fused != stack.reads_embeds:
            raise ValueError("an EAGLE-3 drafter (fused) needs a stack whose first layer reads the embeddings, "
                             "and only it")
        if not fused and norm is None:
            raise ValueError("an EAGLE-2 drafter reads features through the target's final norm")
        self.head_ids = None if head_ids is None else head_ids.to(torch.int64).contiguous()
        if self.head_ids is not None and self.head_ids.numel() != head.rows:
            raise ValueError(f"the draft head has {head.rows} rows and {self.head_ids.numel()} target ids")
        if head.cols != fc.rows:
            raise ValueError(f"the draft head reads states of {head.cols} floats, the drafter's are {fc.rows}")
        if embed.cols != fc.rows:
            raise ValueError(f"the drafter's embedding has rows of {embed.cols} floats, its states {fc.rows}")
        # Every token a tree drafts is embedded for the next level: its ids index the embedding.
        check_range("draft head's target id", self.head_ids if self.head_ids is not None
                    else torch.tensor([head.rows - 1]), 0, embed.rows)
        floats = [None if t is None else t.detach().float().contiguous() for t in (norm, head_norm, out_norm)]
        self.stack, self.keep = stack, (fc, head, embed, floats)
        self.struct = Drafter(fc=fc.struct(), head=head.struct(), embed=embed.struct(),
                              head_ids=ptr(self.head_ids), norm=ptr(floats[0]), head_norm=ptr(floats[1]),
                              out_norm=ptr(floats[2]), eps=eps, embed_scale=embed_scale or 0.0, fused=int(fused))
        self.input_width = fc.cols if fused else fc.rows     # floats of the target's rows read
        self.vocab = embed.rows
        self.head_rows = head.rows
        self.state = torch.zeros(fc.rows)
        self._scratch = torch.empty(0)
        self._tree = None

    def read(self, keys: torch.Tensor, values: torch.Tensor, length: int, tokens: list[int],
             hidden: torch.Tensor) -> None:
        """Tokens and the target's hidden states at the tokens before each into the cache after
        `length` committed slots; `state` becomes the last row's output."""
        lib = library()
        n = len(tokens)
        if n < 1:
            raise ValueError("the drafter reads at least one token")
        slots = self.stack.check_cache(keys, values)
        check_count("the drafter's committed length", length, 0)
        if length + n > slots:
            raise ValueError(f"the drafter's cache holds {slots} slots, {length + n} needed")
        hidden = hidden.to(torch.float32).contiguous()
        if hidden.shape != (n, self.input_width):
            raise ValueError(f"the drafter reads {n} rows of {self.input_width} floats of the target's, "
                             f"not {tuple(hidden.shape)}")
        ids = torch.tensor(tokens, dtype=torch.int64)
        check_range("token id", ids, 0, self.vocab)
        check_index("position", length + n - 1, 0, self.stack.positions)
        need = lib.vs_drafter_read_scratch(ctypes.byref(self.struct), n)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        self.stack.reserve(n, slots)
        request = ReadRequest(drafter=ctypes.addressof(self.struct), stack=ctypes.addressof(self.stack.stack),
                              keys=keys.data_ptr(), values=values.data_ptr(), length=length, n=n, tokens=ids.data_ptr(),
                              hidden=hidden.data_ptr(), state=self.state.data_ptr(), scratch=self._scratch.data_ptr(),
                              work=self.stack.work.data_ptr(), att=self.stack.scratch.data_ptr())
        lib.vs_drafter_read(ctypes.byref(request))

    def tree(self, keys: torch.Tensor, values: torch.Tensor, length: int, root: int, top_k: int, depth: int,
             total_tokens: int, stop=None) -> tuple[list[int], list[int], list[int], list[float]]:
        """EAGLE-2's tree from `state` over a cache of `length` committed slots: (tokens,
        parents, value ranks, values) as lists (the step's host work reads them), flattened with
        the root first (values: each node's log path confidence, the root's 0). `stop`
        (live_tree.TreeStop, or None): where it stops growing before `depth`."""
        lib = library()
        if not 1 <= top_k <= 64:
            raise ValueError(f"the native drafter expands 1 to 64 children a node, not {top_k}")
        check_count("tree depth", depth, 0)
        check_count("total_tokens", total_tokens, 1)
        check_count("the drafter's committed length", length, 0)
        check_index("root token id", root, 0, self.vocab)
        check_index("position", length - 1 + depth, 0, self.stack.positions)
        slots = self.stack.check_cache(keys, values)
        if length + depth * top_k > slots:
            raise ValueError(f"the drafter's cache holds {slots} slots, {length + depth * top_k} needed")
        shape = (top_k, depth, total_tokens)
        if self._tree is None or self._tree[0] != shape:
            rows = min(lib.vs_tree_capacity(top_k, depth), total_tokens + 1)
            self._tree = (shape, torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int64),
                          torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.float64),
                          torch.empty(top_k * self.head_rows))
        _, tokens, parents, ranks, node_values, logits = self._tree
        self.stack.reserve(top_k, slots)
        c_stop = _tree_stop(stop)
        request = TreeRequest(
            drafter=ctypes.addressof(self.struct), stack=ctypes.addressof(self.stack.stack), keys=keys.data_ptr(),
            values=values.data_ptr(), length=length, state=self.state.data_ptr(), root=root, top_k=top_k,
            depth=depth, total_tokens=total_tokens, stop=None if c_stop is None else ctypes.addressof(c_stop),
            tokens=tokens.data_ptr(), parents=parents.data_ptr(), ranks=ranks.data_ptr(),
            node_values=node_values.data_ptr(), head_logits=logits.data_ptr(), work=self.stack.work.data_ptr(),
            att=self.stack.scratch.data_ptr())
        n = lib.vs_eagle_tree(ctypes.byref(request))
        if c_stop is not None:
            stop.levels, stop.rows = c_stop.levels, c_stop.rows
        if n < 1:
            raise RuntimeError(f"the native drafter built a tree with a node whose parent it did not keep "
                               f"(top_k {top_k}, depth {depth}, total_tokens {total_tokens})")
        return tokens[:n].tolist(), parents[:n].tolist(), ranks[1:n].tolist(), node_values[:n].tolist()
