"""Weight formats at run time: how a linear layer's weight is stored for the native engine.

Four formats, chosen per model with `--weights`:
- `gguf`: the file's own quantized groups, re-encoded losslessly (each weight dequantizes to the
  very float32 value gguf-py's `dequantize` gives) into three kinds of groups of 32 inputs:
  q4 (4-bit codes, w = code * scale + min: Q4_0, Q4_1, Q4_K), q5 (5-bit codes: Q5_0, Q5_1) and
  q8 (signed 8-bit codes, w = code * scale: Q8_0, and Q6_K with a scale per 16 inputs). Scales
  stay float16 where the file's are (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, so those cost no extra byte);
  K-quants' scales are products of two numbers and are kept as exact float32 values.
  Other types (Q2_K, Q3_K, Q5_K, IQ*) are stored as float32 rows, which is lossless too.
- `gguf-a8`: the same weights; each product quantizes its input rows to 8 bits per 32 inputs
  (as llama.cpp does) and sums 8-bit products exactly in integers (AVX-512 VNNI or AVX2): about half
  the work of `gguf` for one row and a third of it for a tree's rows, at llama.cpp's precision.
- `bf16`: every weight rounded to bfloat16.
- `f32`: float32.

Activations are otherwise float32 in every format (norms, attention, the residual stream). Rows
are stored in blocks of 16, one per vector lane (see native.c; the last block padded with zero
rows), so a matrix needs a multiple of 32 columns.
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


@dataclass
class PackedWeight:
    kind: str                      # f32, bf16, q4, q5, q8; q4i, q5i, q8i (8-bit activations)
    rows: int
    cols: int
    data: torch.Tensor             # row-blocked payloads (native.c)
    scale: torch.Tensor | None = None
    min: torch.Tensor | None = None
    high: torch.Tensor | None = None
    group: int = UNIT
    bias: torch.Tensor | None = None
    source: str = ""               # the GGUF type it came from, for reports

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def struct(self) -> native.Weight:
        f16 = self.scale is not None and self.scale.dtype == torch.float16
        return native.Weight(kind=native.KINDS[self.kind], rows=self.rows, cols=self.cols,
                             group=self.group, scale_f16=int(f16), pad=0,
                             data=self.data.data_ptr(), high=native.ptr(self.high),
                             scale=native.ptr(self.scale), min=native.ptr(self.min),
                             bias=native.ptr(self.bias))

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
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.rows):
            raise ValueError(f"row ids outside [0, {self.rows})")

        # The 8-bit-activation layouts keep a row's four codes after its row index.
        fields = {"data": _take_rows(self.data, ids, -2 if self.kind.endswith("i") else -1)}
        fields.update({f: _take_rows(getattr(self, f), ids) for f in ("scale", "min")
                       if getattr(self, f) is not None})
        if self.kind == "q5":      # a 16-bit word per block and input: a bit per row
            bits = (self.high.to(torch.int32)[..., None] >> torch.arange(ROW_BLOCK, dtype=torch.int32)) & 1
            bits = _take_rows(bits, ids)
            fields["high"] = (bits << torch.arange(ROW_BLOCK, dtype=torch.int32)).sum(-1) \
                .to(torch.int32).to(torch.uint16).contiguous()
        elif self.kind == "q5i":   # a 64-bit word per block and four inputs: bit 4 * row + input
            bits = ((self.high[..., None] >> torch.arange(64)) & 1).reshape(*self.high.shape, ROW_BLOCK, 4)
            bits = _take_rows(bits, ids, -2).reshape(*bits.shape[:-3], -1, 64)
            fields["high"] = (bits << torch.arange(64)).sum(-1).contiguous()
        bias = None if self.bias is None else self.bias[ids].contiguous()
        return PackedWeight(self.kind, ids.numel(), self.cols, group=self.group, bias=bias,
                            source=self.source, **fields)

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """The float32 weight (or a slice of its rows) exactly as the kernels compute with it."""
        start, stop, _ = (rows or slice(None)).indices(self.rows)
        out = torch.empty(max(stop - start, 0), self.cols, dtype=torch.float32)
        struct = self.struct()
        native.library().vs_dequant_rows(ctypes.byref(struct), start, stop, out.data_ptr())
        return out


def check_shape(rows: int, cols: int, what: str = "weight") -> None:
    if cols % UNIT:
        raise ValueError(f"{what} of {rows} x {cols}: the native engine needs a multiple of "
                         f"{UNIT} columns")


def _take_rows(t: torch.Tensor, ids: torch.Tensor, row_dim: int = -1) -> torch.Tensor:
    """Rows `ids` of a blocked tensor (blocks, units, ..., 16 at row_dim, ...), blocked again."""
    t = t.movedim(row_dim, -1)
    flat = t.movedim(-1, 1).reshape(-1, *t.shape[1:-1])          # (rows, units, ...)
    return _blocked(flat[ids]).movedim(-1, row_dim).contiguous()


def _blocked(t: torch.Tensor) -> torch.Tensor:
    """(rows, units, ...) -> (blocks, units, ..., 16): the native engine's blocks of 16 rows,
    one per vector lane (the last padded with zero rows), for every 32-input unit."""
    rows, units = t.shape[:2]
    pad = -rows % ROW_BLOCK
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    t = t.reshape(-1, ROW_BLOCK, units, *t.shape[2:])          # (blocks, 16, units, ...)
    return t.movedim(1, -1).contiguous()                        # (blocks, units, ..., 16)


def pack_float(weight: torch.Tensor, kind: str, bias: torch.Tensor | None = None) -> PackedWeight:
    rows, cols = weight.shape
    check_shape(rows, cols)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[kind]
    data = _blocked(weight.detach().to(dtype).reshape(rows, cols // UNIT, UNIT))
    return PackedWeight(kind, rows, cols, data, bias=_bias(bias), source=kind)


def pack_codes(kind: str, codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None = None,
               group: int = UNIT, bias: torch.Tensor | None = None, source: str = "") -> PackedWeight:
    """Quantized groups from row-major codes (rows, cols) and per-group scale/min (rows, cols /
    group): q4 codes 0..15, q5 codes 0..31 (w = code * scale + min), q8 codes -128..127
    (w = code * scale, group 32 or 16)."""
    rows, cols = codes.shape
    check_shape(rows, cols)
    units = cols // UNIT
    grouped = _blocked(codes.reshape(rows, units, UNIT))      # (blocks, units, 32 inputs, 16 rows)
    high = None
    if kind in ("q4i", "q5i", "q8i"):
        # Four consecutive inputs' codes per row side by side (blocks, units, 8, 16, 4): the
        # layout the 4-way byte products (VNNI, AVX2's multiply-add pairs) read.
        quads = grouped.reshape(*grouped.shape[:2], 8, 4, ROW_BLOCK).movedim(3, 4)
        if kind == "q8i":
            if group not in (16, 32) or min is not None:
                raise ValueError("q8 groups are 16 or 32 wide, without mins")
            data = quads.to(torch.int8).contiguous()
        else:
            if group != UNIT or min is None:
                raise ValueError(f"{kind} groups are {UNIT} wide and have mins")
            low = (quads & 15).to(torch.uint8)
            data = torch.stack([low[..., 0] | (low[..., 2] << 4), low[..., 1] | (low[..., 3] << 4)], -1)
            data = data.contiguous()
            if kind == "q5i":
                bits = ((quads >> 4) & 1).to(torch.int64).reshape(*quads.shape[:3], 64)
                high = (bits << torch.arange(64, dtype=torch.int64)).sum(-1).contiguous()
    elif kind in ("q4", "q5"):
        if group != UNIT or min is None:
            raise ValueError(f"{kind} groups are {UNIT} wide and have mins")
        low = (grouped & 15).to(torch.uint8)
        data = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).contiguous()   # inputs 2t, 2t+1 in one byte
        if kind == "q5":
            bits = ((grouped >> 4) & 1).to(torch.int32) << torch.arange(ROW_BLOCK, dtype=torch.int32)
            high = bits.sum(-1).to(torch.int32).to(torch.uint16).contiguous()
    elif kind == "q8":
        if group not in (16, 32) or min is not None:
            raise ValueError("q8 groups are 16 or 32 wide, without mins")
        data = grouped.to(torch.int8).contiguous()
    else:
        raise ValueError(f"unknown quantized kind {kind!r}")
    scale = _blocked(scale.reshape(rows, units, UNIT // group))   # (blocks, units, groups, 16)
    if min is not None:
        min = _blocked(min.reshape(rows, units))
    return PackedWeight(kind, rows, cols, data, scale, min, high, group, _bias(bias), source)


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


def quantize_q8(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """A float weight quantized as GGUF's Q8_0 does (`q8_0_groups`), for products with 8-bit
    activations (q8i). Lossy: for drafters, whose rounding changes what is drafted, never what
    is accepted."""
    codes, d = q8_0_groups(weight)
    return pack_codes("q8i", codes, d, bias=bias, source="q8_0")


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().contiguous()


# ---------------------------------------------------------------- GGUF blocks

def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16-byte nibble runs: low nibbles are inputs 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit (scale, min) pairs per 256 inputs, from their 12 packed bytes."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def from_gguf_blocks(type_name: str, raw: np.ndarray, rows: int, cols: int,
                     int8_activations: bool = False) -> PackedWeight | None:
    """A quantized GGUF tensor's blocks (rows, row bytes) re-encoded losslessly; None for a type
    that has no quantized kind here (the caller keeps its float32 dequantization). With
    int8_activations, in the layout of products with 8-bit activations (q4i, q5i, q8i)."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    suffix = "i" if int8_activations else ""
    units = cols // UNIT
    if type_name == "Q8_0":
        b = raw.reshape(rows, units, 34)
        return pack_codes("q8" + suffix, t(b[..., 2:].view(np.int8).reshape(rows, cols)), t(_f16(b, 0)),
                          source=type_name)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}[type_name]
        b = raw.reshape(rows, units, size)
        d = _f16(b, 0)
        has_min = type_name.endswith("_1")
        offset = 4 if has_min else 2
        five = type_name.startswith("Q5")
        codes = _nibbles(b[..., offset + 4 * five:]).astype(np.int32)
        if five:
            qh = np.ascontiguousarray(b[..., offset:offset + 4]).view(np.uint32)
            codes |= ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32) << 4
        if has_min:
            mn = _f16(b, 2)
        else:   # w = (code - 8 or 16) * d = code * d + min, min = -8d or -16d (exact in float16)
            mn = (-(16 if five else 8) * d.astype(np.float32)).astype(np.float16)
            if not np.array_equal(mn.astype(np.float32), -(16 if five else 8) * d.astype(np.float32)):
                return None
        return pack_codes(("q5" if five else "q4") + suffix, t(codes.reshape(rows, cols)), t(d), t(mn),
                          source=type_name)
    if type_name == "Q4_K":
        b = raw.reshape(rows, cols // 256, 144)
        d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
        sc, mn = _k_scale_min(b[..., 4:16])
        scale = d[..., None] * sc.astype(np.float32)          # exact: 11 x 6 bits
        minimum = -(dmin[..., None] * mn.astype(np.float32))
        qs = b[..., 16:].reshape(rows, cols // 256, 4, 32)   # 64 inputs per 32 bytes
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)   # (.., 4, 64): low 32 then high 32
        return pack_codes("q4" + suffix, t(codes.reshape(rows, cols)), t(scale.reshape(rows, units)),
                          t(minimum.reshape(rows, units)), source=type_name)
    if type_name == "Q6_K":
        b = raw.reshape(rows, cols // 256, 210)
        ql, qh = b[..., :128], b[..., 128:192]
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(b, 208).astype(np.float32)
        scale = d[..., None] * sc                              # exact: 11 x 8 bits
        ql = ql.reshape(rows, -1, 2, 64)
        low = np.concatenate([ql & 15, ql >> 4], axis=-1).reshape(rows, -1, 2, 4, 32)
        qh = qh.reshape(rows, -1, 2, 1, 32) >> (np.arange(4, dtype=np.uint8) * 2).reshape(1, 1, 1, 4, 1)
        codes = (low | ((qh & 3) << 4)).astype(np.int16) - 32
        return pack_codes("q8" + suffix, t(codes.reshape(rows, cols).astype(np.int8)),
                          t(scale.reshape(rows, cols // 16)), group=16, source=type_name)
    return None


# ---------------------------------------------------------------- whole models

LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_GGUF_NAMES = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
               "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


def llama_rope_rows(rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's interleaving of Llama's q/k rotary halves."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def float_linears(model) -> dict[str, torch.Tensor]:
    """Each layer's projections as (rows, cols) float tensors, split out of the fused modules,
    and the embedding."""
    out = block_linears(model.args, model.layers)
    out["embed"] = model.embed.weight
    if model.output is not None:
        out["head"] = model.output.weight
    return out


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


def pack_model(model, weights: str, gguf_path=None) -> dict[str, PackedWeight]:
    """Every projection, the embedding and the LM head (tied: the same object) of `model` in the
    format `weights`; for gguf, re-encoded from the file's own blocks."""
    if weights not in FORMATS:
        raise ValueError(f"unknown weight format {weights!r} (choose from {', '.join(FORMATS)})")
    floats = float_linears(model)
    biases = block_biases(model.args, model.layers)
    if not weights.startswith("gguf"):
        packed = {name: pack_float(w, weights, bias=biases.get(name)) for name, w in floats.items()}
        packed.setdefault("head", packed["embed"])
        return packed
    if gguf_path is None:
        raise ValueError(f"--weights {weights} needs a GGUF model file")
    int8_activations = weights == "gguf-a8"
    if int8_activations and not native.has_int8():
        raise ValueError("--weights gguf-a8 needs 8-bit dot products (AVX-512 VNNI, or AVX2), which "
                         "this build lacks; use gguf")
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    args = model.args
    packed = {}
    for name, w in floats.items():
        if name in ("embed", "head"):
            gguf_name = "token_embd.weight" if name == "embed" else "output.weight"
        else:
            _, index, short = name.split(".")
            gguf_name = f"blk.{index}.{_GGUF_NAMES[short]}.weight"
        tensor = tensors.get(gguf_name)
        rows, cols = w.shape
        result = None
        if tensor is not None and tensor.tensor_type.name not in ("F32", "F16", "BF16"):
            raw = np.asarray(tensor.data)
            if raw.shape[0] != rows:
                raise ValueError(f"{gguf_path}: {gguf_name} has {raw.shape[0]} rows, the model {rows}")
            if args.arch == "llama" and name.split(".")[-1] in ("wq", "wk"):
                heads = args.n_heads if name.endswith("wq") else args.n_kv_heads
                raw = raw[llama_rope_rows(rows, heads)]
            result = from_gguf_blocks(tensor.tensor_type.name, raw, rows, cols, int8_activations)
        if result is not None and biases.get(name) is not None:
            result.bias = biases[name].detach().float().contiguous()
        packed[name] = result if result is not None else pack_float(w, "f32", bias=biases.get(name))
    packed.setdefault("head", packed["embed"])
    return packed


PACK_VERSION = 2   # bump when the packed layout changes: cached re-encodings are rebuilt
_FIELDS = ("data", "scale", "min", "high", "bias")


def flatten_packed(packed: dict[str, PackedWeight]) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and metadata of pack_model's result (tied weights stored once), for caching."""
    tensors, meta, seen = {}, {}, {}
    for name, w in packed.items():
        if id(w) in seen:
            meta[name] = {"same_as": seen[id(w)]}
            continue
        seen[id(w)] = name
        meta[name] = {"kind": w.kind, "rows": w.rows, "cols": w.cols, "group": w.group,
                      "source": w.source, "fields": [f for f in _FIELDS if getattr(w, f) is not None]}
        for field in meta[name]["fields"]:
            tensors[f"{name}.{field}"] = getattr(w, field)
    return tensors, meta


def unflatten_packed(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, PackedWeight]:
    packed = {}
    for name, info in meta.items():
        if "same_as" in info:
            continue
        fields = {f: tensors[f"{name}.{f}"] for f in info["fields"]}
        packed[name] = PackedWeight(info["kind"], info["rows"], info["cols"], group=info["group"],
                                    source=info["source"], **fields)
    for name, info in meta.items():
        if "same_as" in info:
            packed[name] = packed[info["same_as"]]
    return packed
