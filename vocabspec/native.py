"""The native CPU engine: build, load and call the kernels of native.c.

Why it exists: exactness in every precision and the speed of the file's own low-bit weights.
A tree verification must give every row the bits one-token decoding gives it. None of torch's
CPU attention kernels does (their reduction order depends on the number of query rows and on
masked columns), and its low-bit matmuls cover neither GGUF's 8-bit groups nor K-quants
losslessly. native.c computes a whole stack of decoder layers with one fixed reduction order
per row, over weights kept in their GGUF groups, in one call per forward.

The library is compiled on first use with the machine's C compiler into the cache directory
(keyed by the source, the compiler and the CPU), and shares torch's OpenMP threads: torch is
imported first, so the dynamic loader hands the library torch's libgomp. Where it cannot be
built (no compiler, no AVX-512), `available()` says why and the engine runs torch's kernels.
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
KINDS = {"f32": 0, "bf16": 1, "q4": 2, "q5": 3, "q8": 4, "q4i": 5, "q5i": 6, "q8i": 7}

_lib = None
_error: str | None = None


class Weight(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("rows", ctypes.c_int32), ("cols", ctypes.c_int32),
                ("group", ctypes.c_int32), ("scale_f16", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("data", ctypes.c_void_p), ("high", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("min", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("wq", Weight), ("wk", Weight), ("wv", Weight), ("wo", Weight),
                ("w_gate", Weight), ("w_up", Weight), ("w_down", Weight),
                ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                ("post_attn_norm", ctypes.c_void_p), ("post_mlp_norm", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("window", ctypes.c_int32), ("pad", ctypes.c_int32)]


class Stack(ctypes.Structure):
    _fields_ = [("dim", ctypes.c_int32), ("n_heads", ctypes.c_int32), ("n_kv", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("hidden", ctypes.c_int32), ("max_len", ctypes.c_int32),
                ("n_layers", ctypes.c_int32), ("act", ctypes.c_int32), ("eps", ctypes.c_float),
                ("attn_scale", ctypes.c_float), ("layers", ctypes.POINTER(Layer))]


def _cpu_key() -> str:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return flags


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + _cpu_key().encode()).hexdigest()[:16]
    target = cache_dir() / f"native-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared",
               "-o", str(out), str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(out, target)   # atomic: a concurrent build of the same key is harmless
    return target


def library():
    """The loaded kernels (ctypes.CDLL), built on first use; RuntimeError if unavailable."""
    global _lib, _error
    if _lib is not None:
        return _lib
    if _error is not None:
        raise RuntimeError(_error)
    try:
        if platform.machine() not in ("x86_64", "AMD64"):
            raise RuntimeError(f"the native engine needs an x86-64 CPU with AVX-512 ({platform.machine()})")
        if "avx512f" not in _cpu_key().split():
            raise RuntimeError("the native engine needs AVX-512F, which this CPU lacks")
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("the native engine is compiled on first use and needs a C compiler (cc)")
        lib = ctypes.CDLL(str(_build(compiler)))
    except (RuntimeError, OSError) as exc:
        _error = f"native CPU engine unavailable: {exc}"
        raise RuntimeError(_error) from exc
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.vs_linear.argtypes = [ctypes.POINTER(Weight), p, i64, p]
    lib.vs_has_vnni.restype = ctypes.c_int
    lib.vs_linear_topk.argtypes = [ctypes.POINTER(Weight), p, i64, i64, p, p, p]
    lib.vs_dequant_rows.argtypes = [ctypes.POINTER(Weight), i64, i64, p]
    lib.vs_embed.argtypes = [ctypes.POINTER(Weight), p, i64, f32, p]
    lib.vs_head.argtypes = [p, f32, ctypes.POINTER(Weight), p, i64, p, p]
    lib.vs_stack_work.argtypes = [ctypes.POINTER(Stack), i64]
    lib.vs_stack_work.restype = i64
    lib.vs_attention_scratch.argtypes = [ctypes.POINTER(Stack)]
    lib.vs_attention_scratch.restype = i64
    lib.vs_stack_forward.argtypes = [ctypes.POINTER(Stack), p, i64, p, p, p, p, p, p, i64, p, p, p, i64, p]
    _lib = lib
    return lib


def available() -> tuple[bool, str]:
    """(True, "") where the native engine runs here, else (False, why)."""
    try:
        library()
        return True, ""
    except RuntimeError as exc:
        return False, str(exc)


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def visibility(length: int, pending: int, positions: torch.Tensor, tree_mask: torch.Tensor | None):
    """What each new row attends to, as native.c reads it: (prefix, xoff, extra), int32.

    Row r sees cache slots [0, prefix[r]) and then the slots extra[xoff[r]:xoff[r + 1]], in
    position order, its own slot last. Without a tree mask the rows are causal after every
    pending slot; with one (n, pending + n), row r sees the slots the mask marks.
    """
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


class NativeStack:
    """Decoder layers on the native engine: their description is built once; a forward is one
    call. `layers`: one dict per layer with PackedWeights wq, wk, wv, wo, w_gate, w_up, w_down
    and float32 tensors (or None) attn_norm, mlp_norm, post_attn_norm, post_mlp_norm, q_norm,
    k_norm, plus its RoPE tables cos, sin and its sliding window (0: none)."""

    def __init__(self, dim: int, n_heads: int, n_kv: int, head_dim: int, hidden: int,
                 eps: float, attn_scale: float, gelu: bool, layers: list[dict]):
        library()
        self.keep = layers            # the tensors the structs point into
        self.layers = (Layer * len(layers))()
        for i, spec in enumerate(layers):
            entry = self.layers[i]
            for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
                setattr(entry, name, spec[name].struct())
            for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm",
                         "k_norm", "cos", "sin"):
                tensor = spec.get(name)
                if tensor is not None and (tensor.dtype != torch.float32 or not tensor.is_contiguous()):
                    raise ValueError(f"layer {i}: {name} must be a contiguous float32 tensor")
                setattr(entry, name, ptr(tensor))
            entry.window = spec.get("window", 0)
        self.stack = Stack(dim=dim, n_heads=n_heads, n_kv=n_kv, head_dim=head_dim, hidden=hidden,
                           max_len=0, n_layers=len(layers), act=int(gelu), eps=eps,
                           attn_scale=attn_scale, layers=self.layers)
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.work = torch.empty(0, dtype=torch.float32)
        self.dim, self.n_layers, self.n_kv, self.head_dim = dim, len(layers), n_kv, head_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                length: int, pending: int, tree_mask: torch.Tensor | None = None,
                taps: tuple[int, ...] = ()) -> torch.Tensor | None:
        """Run x (n, dim), float32, in place through the layers; the new keys and values go to
        the slots after the `length` committed and `pending` uncommitted ones. Returns the
        `taps` layers' outputs side by side (n, len(taps) * dim), or None."""
        lib = library()
        n = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self.dim:
            raise ValueError("native forward needs contiguous float32 rows of the model width")
        slots = keys.shape[-1]
        if keys.shape != (self.n_layers, self.n_kv, self.head_dim, slots) or \
                values.shape != (self.n_layers, self.n_kv, slots, self.head_dim):
            raise ValueError("the cache does not have the native layout of this stack")
        if length + pending + n > slots:
            raise ValueError(f"sequence would reach {length + pending + n} tokens, beyond the cache's {slots}")
        prefix, xoff, extra = visibility(length, pending, positions, tree_mask)
        self.stack.max_len = slots
        need = lib.vs_stack_work(ctypes.byref(self.stack), n)
        if self.work.numel() < need:
            self.work = torch.empty(need, dtype=torch.float32)
        need = lib.vs_attention_scratch(ctypes.byref(self.stack))
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.float32)
        pos32 = positions.to(torch.int32).contiguous()
        tapped = torch.empty(n, len(taps) * self.dim) if taps else None
        tap_ids = torch.tensor(taps, dtype=torch.int32) if taps else None
        lib.vs_stack_forward(ctypes.byref(self.stack), x.data_ptr(), n, pos32.data_ptr(),
                             prefix.data_ptr(), xoff.data_ptr(), extra.data_ptr(), keys.data_ptr(),
                             values.data_ptr(), length + pending, self.work.data_ptr(),
                             self.scratch.data_ptr(), ptr(tap_ids), len(taps), ptr(tapped))
        return tapped


class NativeModel:
    """A target model's layers, LM head and embedding on the native engine (see model.py)."""

    def __init__(self, stack: NativeStack, embed, head, norm: torch.Tensor, eps: float,
                 embed_scale: float | None, weights: str):
        self.stack, self.embed_weight, self.head_weight = stack, embed, head
        self.norm = norm.detach().float().contiguous()
        self.eps = eps
        self.embed_scale = embed_scale or 0.0
        self.weights = weights
        self._embed_struct, self._head_struct = embed.struct(), head.struct()
        self._work = torch.empty(0, dtype=torch.float32)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.to(torch.int32).contiguous()
        out = torch.empty(ids.numel(), self.embed_weight.cols, dtype=torch.float32)
        library().vs_embed(ctypes.byref(self._embed_struct), ids.data_ptr(), ids.numel(),
                           self.embed_scale, out.data_ptr())
        return out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (rows, vocab), float32, of final-norm(hidden)."""
        hidden = hidden.to(torch.float32).contiguous()
        rows = hidden.shape[0]
        if self._work.numel() < hidden.numel():
            self._work = torch.empty(hidden.numel(), dtype=torch.float32)
        logits = torch.empty(rows, self.head_weight.rows, dtype=torch.float32)
        if rows:
            library().vs_head(self.norm.data_ptr(), self.eps, ctypes.byref(self._head_struct),
                              hidden.data_ptr(), rows, self._work.data_ptr(), logits.data_ptr())
        return logits
