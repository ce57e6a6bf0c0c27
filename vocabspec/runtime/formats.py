"""Weight formats at run time: how a linear layer's weight is stored for the native engine.

Four formats, chosen per model with `--weights`:
- `gguf`: the file's own quantized blocks, re-laid in blocks of 16 rows (native_weights.c draws
  the layout) with their codes and scales as the file keeps them, so a packed weight is the
  file's size within 4%, and each weight dequantizes to the very float32 value gguf-py's
  `dequantize` gives. Every common GGUF type runs natively: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
  Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS; F32, F16 and BF16 tensors stay as they are.
  Any other type is refused by name.
- `gguf-a8`: the same weights; each product quantizes its input rows to 8 bits per 32 inputs
  (as llama.cpp does) and sums 8-bit products exactly in integers (AVX-512 VNNI or AVX2): the
  default where the CPU has them, about half the work of `gguf` for one row and a third of it
  for a tree's rows, at llama.cpp's precision. It reads the same packed bytes as `gguf`.
- `bf16`: every weight rounded to bfloat16.
- `f32`: float32.

Activations are otherwise float32 in every format (norms, attention, the residual stream). Rows
are stored in blocks of 16, one per vector lane (the last block padded with zero rows), so a
matrix needs a multiple of 32 columns (256 for the superblock types).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from . import native

FORMATS = ("gguf", "gguf-a8", "bf16", "f32")
ROW_BLOCK = 16
UNIT = 32
# The engine's types (native_weights.c's enum) and GGUF's block shapes: (inputs, bytes) a block.
TYPES = {"F32": 0, "BF16": 1, "F16": 2, "Q4_0": 3, "Q4_1": 4, "Q5_0": 5, "Q5_1": 6, "Q8_0": 7, "Q2_K": 8,
         "Q3_K": 9, "Q4_K": 10, "Q5_K": 11, "Q6_K": 12, "IQ4_NL": 13, "IQ4_XS": 14}
GGUF_BLOCKS = {"F32": (1, 4), "BF16": (1, 2), "F16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
               "Q5_1": (32, 24), "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
               "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136)}
FLOAT_TYPES = ("F32", "BF16", "F16")
_KINDS = {"f32": "F32", "bf16": "BF16", "f16": "F16"}


class UnsupportedType(ValueError):
    """A GGUF tensor type the native engine does not compute with."""


@dataclass
class PackedWeight:
    type: str                      # a key of TYPES
    rows: int
    cols: int
    data: torch.Tensor             # the blocks' streams (uint8), vs_packed_bytes of them
    bias: torch.Tensor | None = None
    int8_acts: bool = False        # products quantize their input rows to 8 bits (gguf-a8)
    source: str = ""               # where it came from, for reports

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return self.data.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def struct(self) -> native.Weight:
        return native.Weight(type=TYPES[self.type], rows=self.rows, cols=self.cols, int8_acts=int(self.int8_acts),
                             data=self.data.data_ptr(), bias=native.ptr(self.bias))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, cols) times the weight's transpose (+ bias): (rows, self.rows), float32."""
        x = x.to(torch.float32).contiguous()
        if x.dim() != 2 or x.shape[1] != self.cols:
            raise ValueError(f"matmul of {tuple(x.shape)} with a {self.rows} x {self.cols} weight")
        out = torch.empty(x.shape[0], self.rows, dtype=torch.float32)
        if x.shape[0]:
            struct = self.struct()
            native.library().vs_linear(ctypes.byref(struct), x.data_ptr(), x.shape[0], out.data_ptr())
        return out

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest entries of each row of `matmul(x)` (ids, long) and their
        log-probabilities under that row's softmax, in one native call (a draft head's step)."""
        x = x.to(torch.float32).contiguous()
        rows, k = x.shape[0], min(k, self.rows, 64)
        logits = torch.empty(rows, self.rows, dtype=torch.float32)
        ids = torch.empty(rows, k, dtype=torch.int64)
        logprobs = torch.empty(rows, k, dtype=torch.float32)
        struct = self.struct()
        native.library().vs_linear_topk(ctypes.byref(struct), x.data_ptr(), rows, k, logits.data_ptr(),
                                        ids.data_ptr(), logprobs.data_ptr())
        return ids, logprobs

    def take_rows(self, ids: torch.Tensor) -> "PackedWeight":
        """A weight of the rows `ids` (a draft vocabulary's share of the head), same format."""
        ids = torch.as_tensor(ids, dtype=torch.long).contiguous()
        if ids.numel() == 0:
            raise ValueError("a weight needs at least one row")
        if int(ids.min()) < 0 or int(ids.max()) >= self.rows:
            raise ValueError(f"row ids outside [0, {self.rows})")
        data = torch.empty(packed_bytes(self.type, ids.numel(), self.cols), dtype=torch.uint8)
        struct = self.struct()
        native.library().vs_take_rows(ctypes.byref(struct), ids.data_ptr(), ids.numel(), data.data_ptr())
        bias = None if self.bias is None else self.bias[ids].contiguous()
        return PackedWeight(self.type, ids.numel(), self.cols, data, bias, self.int8_acts, self.source)

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """The float32 weight (or a slice of its rows) exactly as the kernels compute with it."""
        start, stop, _ = (rows or slice(None)).indices(self.rows)
        out = torch.empty(max(stop - start, 0), self.cols, dtype=torch.float32)
        struct = self.struct()
        native.library().vs_dequant_rows(ctypes.byref(struct), start, stop, out.data_ptr())
        return out


def packed_bytes(type_name: str, rows: int, cols: int) -> int:
    """Bytes of a packed weight (ValueError for a shape its type cannot take)."""
    if type_name not in TYPES:
        raise UnsupportedType(f"GGUF type {type_name} is not one the native engine computes with "
                              f"({', '.join(TYPES)})")
    n = native.library().vs_packed_bytes(TYPES[type_name], rows, cols)
    if n < 0:
        inputs = 256 if GGUF_BLOCKS[type_name][0] == 256 else UNIT
        raise ValueError(f"a {type_name} weight of {rows} x {cols}: the native engine needs a multiple of "
                         f"{inputs} columns")
    return n


def check_shape(rows: int, cols: int, what: str = "weight") -> None:
    if cols % UNIT:
        raise ValueError(f"{what} of {rows} x {cols}: the native engine needs a multiple of "
                         f"{UNIT} columns")


def gguf_row_bytes(type_name: str, cols: int) -> int:
    inputs, size = GGUF_BLOCKS[type_name]
    return cols // inputs * size


def pack_blocks(type_name: str, raw, rows: int, cols: int, order: np.ndarray | None = None,
                out: torch.Tensor | None = None, bias: torch.Tensor | None = None, int8_acts: bool = False,
                source: str = "") -> PackedWeight:
    """A GGUF tensor's rows (raw: a (rows, row bytes) uint8 array, a memory map's view read in
    place) packed in C, straight from its blocks; `order`: the file rows to take, in order
    (Llama's q and k rows un-interleaved); `out`: where to write (a view of a cache file)."""
    size = packed_bytes(type_name, rows, cols)       # UnsupportedType for a type it cannot pack
    row_bytes = gguf_row_bytes(type_name, cols)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != row_bytes or not raw.flags.c_contiguous:
        raise ValueError(f"{type_name} rows of {cols} inputs are {row_bytes} bytes each, not {raw.shape}")
    src_rows = raw.shape[0]
    if order is not None:
        order = np.ascontiguousarray(order, dtype=np.int64)
        if order.shape != (rows,) or (rows and (order.min() < 0 or order.max() >= src_rows)):
            raise ValueError(f"row order of {order.shape} for {src_rows} rows")
    elif src_rows != rows:
        raise ValueError(f"{src_rows} rows of blocks for a weight of {rows}")
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    elif out.numel() != size or out.dtype != torch.uint8:
        raise ValueError(f"{size} bytes to write, a buffer of {out.numel()}")
    native.library().vs_pack(TYPES[type_name], raw.ctypes.data, row_bytes, rows, cols,
                             None if order is None else order.ctypes.data, out.data_ptr())
    return PackedWeight(type_name, rows, cols, out, _bias(bias), int8_acts and type_name not in FLOAT_TYPES,
                        source or type_name)


def pack_float(weight: torch.Tensor, kind: str, bias: torch.Tensor | None = None) -> PackedWeight:
    """A float weight as f32, bf16 or f16 rows (bf16 and f16 rounded once)."""
    rows, cols = weight.shape
    check_shape(rows, cols)
    type_name = _KINDS[kind]
    dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[type_name]
    values = weight.detach().to(dtype).contiguous()
    raw = values.view(torch.uint8).reshape(rows, -1).numpy()
    return pack_blocks(type_name, raw, rows, cols, bias=bias, source=kind)


def q8_0_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight as GGUF's Q8_0 groups: per 32 inputs d = max|w| / 127 in float16 and
    codes round(w / d); (codes (rows, cols) int8, d (rows, cols / 32) float16). Quantizing
    `q8_0_float`'s result again gives the same groups."""
    rows, cols = weight.shape
    check_shape(rows, cols)
    w = weight.detach().float().reshape(rows, cols // UNIT, UNIT)
    d = (w.abs().amax(-1) / 127).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d.float()))
    return torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8).reshape(rows, cols), d


def q8_0_float(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 weight of Q8_0 groups (exact: an 8-bit code times a float16 scale)."""
    rows, cols = codes.shape
    return (codes.float().reshape(rows, cols // UNIT, UNIT) * d.float()[..., None]).reshape(rows, cols)


def q8_0_blocks(codes: torch.Tensor, d: torch.Tensor) -> np.ndarray:
    """Q8_0 groups as GGUF's blocks: (rows, row bytes) uint8, each block d then 32 codes."""
    rows, cols = codes.shape
    blocks = np.empty((rows, cols // UNIT, 34), dtype=np.uint8)
    blocks[..., :2] = d.contiguous().numpy().view(np.uint8).reshape(rows, cols // UNIT, 2)
    blocks[..., 2:] = codes.contiguous().numpy().view(np.uint8).reshape(rows, cols // UNIT, UNIT)
    return blocks.reshape(rows, -1)


def quantize_q8(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """A float weight quantized as GGUF's Q8_0 does (`q8_0_groups`), for products with 8-bit
    activations. Lossy: for drafters, whose rounding changes what is drafted, never what is
    accepted."""
    codes, d = q8_0_groups(weight)
    rows, cols = codes.shape
    return pack_blocks("Q8_0", q8_0_blocks(codes, d), rows, cols, bias=bias, int8_acts=native.has_int8(),
                       source="q8_0")


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().contiguous()


# ---------------------------------------------------------------- float modules' weights

LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
GGUF_NAMES = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
              "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


def llama_rope_rows(rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's interleaving of Llama's q/k rotary halves."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def block_biases(args, blocks) -> dict[str, torch.Tensor]:
    """Each layer's q, k and v biases (Qwen2), split out of the fused projection."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    out = {}
    for i, block in enumerate(blocks):
        if block.attn.wqkv.bias is not None:
            for name, b in zip(("wq", "wk", "wv"), block.attn.wqkv.bias.split([q, kv, kv])):
                out[f"layers.{i}.{name}"] = b
    return out


def block_linears(args, blocks) -> dict[str, torch.Tensor]:
    """`layers.{i}.{wq, wk, wv, wo, w_gate, w_up, w_down}` of decoder blocks, as float tensors."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    out = {}
    for i, block in enumerate(blocks):
        wq, wk, wv = block.attn.wqkv.weight.split([q, kv, kv])
        gate, up = block.mlp.w_gate_up.weight.split(args.intermediate_size)
        for name, w in zip(LINEARS, (wq, wk, wv, block.attn.wo.weight, gate, up, block.mlp.w_down.weight)):
            out[f"layers.{i}.{name}"] = w
    return out


def pack_module_weights(model, kind: str) -> dict[str, PackedWeight]:
    """Every projection, the embedding and the LM head (tied: the same object) of a float
    `model` (a Hugging Face directory's) as `kind` (f32 or bf16) weights."""
    floats = block_linears(model.args, model.layers)
    floats["embed"] = model.embed.weight
    if model.output is not None:
        floats["head"] = model.output.weight
    biases = block_biases(model.args, model.layers)
    packed = {name: pack_float(w, kind, bias=biases.get(name)) for name, w in floats.items()}
    packed.setdefault("head", packed["embed"])
    return packed
