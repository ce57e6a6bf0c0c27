"""The target model: one readable decoder-only transformer for Llama (and Mistral, Qwen2, Qwen3)
and Gemma 3.

A forward pass takes token ids, their positions and (optionally) a mask over the new tokens,
so a whole draft tree is scored in one pass against the cached context. It returns the last
layer's hidden states before the final norm (the drafter's input feature) and logits for the
requested rows only, because the LM head is the expensive part with large vocabularies.

Gemma 3 differs from Llama in: scaled embeddings, RMSNorm around both sub-blocks, QK norm,
GELU-tanh MLP, a query scale of query_pre_attn_scalar**-0.5, and sliding-window layers with
their own RoPE base (every `sliding_window_pattern`-th layer is global).

The modules below are the reference, run by torch on any device. On a CPU the same model runs
on the native engine (`use_native`, native.c), which gives every row the same bits whatever the
number of rows in the forward, over weights in any of the formats of formats.py.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kv_cache import DeviceKVCache, KVCache, ancestor_mask
from .linear import Linear, linear


HEAD_ROWS = 4   # rows torch's kernels send through the LM head at a time (verify.TreeLogits)


@dataclass(frozen=True)
class ArchFeatures:
    """What a family computes differently from Llama's decoder, as data: the model reads these,
    never the family's name. A family that differs only in them is one row of ARCH_FEATURES."""
    qk_norm: bool = False           # an RMSNorm over each query and key head
    sandwich_norms: bool = False    # norms after attention and after the MLP too
    gelu: bool = False              # a GELU (tanh) gate in the MLP instead of SiLU
    scale_embeddings: bool = False  # embeddings times sqrt(dim)
    query_scalar: bool = False      # queries scaled by query_pre_attn_scalar ** -0.5, not head_dim's
    local_rope: bool = False        # sliding layers rotate with rope_local_base, unscaled
    window_pattern: bool = False    # every sliding_window_pattern-th layer global, the rest sliding
                                    # (without it a sliding window covers every layer: Mistral)
    norm_offset: bool = False       # Hugging Face checkpoints store w for a (1 + w) norm scale
    qkv_bias: bool = False          # biases on q, k and v


ARCH_FEATURES = {
    "llama": ArchFeatures(),
    "mistral": ArchFeatures(),
    "qwen2": ArchFeatures(qkv_bias=True),
    "qwen3": ArchFeatures(qk_norm=True),
    "gemma3": ArchFeatures(qk_norm=True, sandwich_norms=True, gelu=True, scale_embeddings=True,
                           query_scalar=True, local_rope=True, window_pattern=True, norm_offset=True),
}
ROPE_SCALINGS = ("llama3", "linear", "freqs")


@dataclass
class ModelArgs:
    arch: str                      # a key of ARCH_FEATURES
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_base: float
    max_seq_len: int = 4096
    rope_local_base: float = 10000.0
    sliding_window: int | None = None
    sliding_window_pattern: int = 6
    query_pre_attn_scalar: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # RoPE scaling of the global layers: {"type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}, {"type": "linear", "factor"},
    # or {"type": "freqs", "factors": [...]} (a GGUF's rope_freqs: each frequency divided).
    rope_scaling: dict | None = None
    layer_types: list[str] | None = None   # "sliding" / "full" per layer (None: the arch's rule)
    tied_embeddings: bool = True           # the LM head is the embedding
    qkv_bias: bool = False                 # Qwen2's q/k/v biases
    # The context the model was trained for (its config's max_position_embeddings, a GGUF's
    # context_length); max_seq_len is the window this process allocates, often less.
    context_length: int | None = None
    features: ArchFeatures | None = None   # None: the architecture's row of ARCH_FEATURES

    def __post_init__(self):
        if self.arch not in ARCH_FEATURES:
            raise ValueError(f"unsupported architecture {self.arch!r} (supported: {', '.join(ARCH_FEATURES)})")
        if self.features is None:
            self.features = ARCH_FEATURES[self.arch]
        elif isinstance(self.features, dict):        # read back from JSON (the GGUF cache's meta)
            self.features = ArchFeatures(**self.features)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.rope_scaling is not None and self.rope_scaling.get("type") not in ROPE_SCALINGS:
            raise ValueError(f"unsupported RoPE scaling {self.rope_scaling.get('type')!r} "
                             f"(supported: {', '.join(ROPE_SCALINGS)})")
        if self.layer_types is not None and (len(self.layer_types) != self.n_layers
                                             or set(self.layer_types) - {"sliding", "full"}):
            raise ValueError(f"layer_types must give 'sliding' or 'full' for each of {self.n_layers} layers")

    @property
    def qk_norm(self) -> bool:
        return self.features.qk_norm

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends to the last `sliding_window` positions only: per layer_types
        where given; else Gemma 3's pattern (every sliding_window_pattern-th layer global), or
        every layer (Mistral)."""
        if self.sliding_window is None:
            return False
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding"
        if self.features.window_pattern:
            return (layer + 1) % self.sliding_window_pattern != 0
        return True


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma's (1 + w) is already folded into the weight."""

    row_invariant = False      # kernels.rms_norm instead (Transformer.use_kernels)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:
            from .kernels import rms_norm

            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        x32 = x.float()
        if x.is_cuda:      # one kernel instead of six: CUDA steps are bound by kernel count
            return F.rms_norm(x32, (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope_tables(head_dim: int, base: float, max_len: int,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv_freq = scaled_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def scaled_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """RoPE frequencies under a context-extending scaling (Llama 3.x's, linear, or a GGUF's
    per-frequency factors)."""
    kind = scaling["type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freqs":
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"{factors.numel()} RoPE frequency factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (1, heads, n, head_dim); cos/sin: (n, head_dim). Rotate-half (NeoX/HF) convention.
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args = args
        self.layer = layer
        self.q_size = args.n_heads * args.head_dim
        self.kv_size = args.n_kv_heads * args.head_dim
        self.wqkv = Linear(args.dim, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.wo = Linear(self.q_size, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        scalar = args.query_pre_attn_scalar if args.features.query_scalar else None
        self.scale = (scalar or args.head_dim) ** -0.5
        # On the row-invariant kernels (Transformer.use_kernels): rotary and the cache write in
        # the QKV projection's kernel, or with query/key norms in one kernel after it.
        self.fused = False

    def forward(self, x, cos, sin, cache: KVCache, mask, key_start: int, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None):
        """Attention over `x` (n, dim), normed first by `norm` where given, its output projection
        added to `residual` where given (Linear.forward: on the kernels, inside the projections)."""
        n = x.shape[0]
        args = self.args
        if self.fused and isinstance(mask, Visibility):
            from .kernels import attention, head_norm_rope_cache, qkv_rope_cache

            keys, values = cache.storage(self.layer)
            if self.q_norm is None:
                q = qkv_rope_cache(x.reshape(n, -1), self.wqkv.weight, self.wqkv.bias, cos, sin, mask.slots, keys,
                                   values, args.n_heads, norm=norm.weight if norm is not None else None,
                                   eps=norm.eps if norm is not None else 0.0)
            else:       # the query/key norms need whole heads: a second kernel after the projection
                q = head_norm_rope_cache(self.wqkv(x, norm=norm).reshape(n, -1), self.q_norm.weight,
                                         self.k_norm.weight, self.q_norm.eps, cos, sin, mask.slots, keys, values,
                                         args.n_heads)
            out = attention(q, keys, values, mask.prefix, mask.xoff, mask.extra, self.scale, mask.positions,
                            mask.window, mask.xend, base=mask.base)
            return self.wo(out.reshape(n, self.q_size), residual=residual)
        qkv = self.wqkv(x, norm=norm)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.view(n, args.n_heads, args.head_dim))
            k = self.k_norm(k.view(n, args.n_kv_heads, args.head_dim))
            q = apply_rope(q.transpose(0, 1).unsqueeze(0), cos, sin)
            k = apply_rope(k.transpose(0, 1).unsqueeze(0), cos, sin)
        else:
            # Queries and keys sit side by side: one rotation over both, the same arithmetic
            # per element in half the kernels.
            qk = qkv[:, :self.q_size + self.kv_size].view(n, args.n_heads + args.n_kv_heads, args.head_dim)
            qk = apply_rope(qk.transpose(0, 1).unsqueeze(0), cos, sin)
            q, k = qk[:, :args.n_heads], qk[:, args.n_heads:]
        v = v.view(n, args.n_kv_heads, args.head_dim).transpose(0, 1).unsqueeze(0)
        keys, values = cache.write(self.layer, k, v)
        if isinstance(mask, Visibility):     # row-invariant kernels (Transformer.use_kernels)
            from .kernels import attention

            out = attention(q[0].transpose(0, 1), keys[0], values[0], mask.prefix, mask.xoff, mask.extra,
                            self.scale, mask.positions, mask.window, mask.xend, base=mask.base)
            return self.wo(out.reshape(n, self.q_size), residual=residual)
        if isinstance(mask, CustomAttention):
            out = mask.attend(q, keys, values, self.scale)
            return self.wo(out.squeeze(0).transpose(0, 1).reshape(n, self.q_size), residual=residual)
        if key_start:
            keys, values = keys[:, :, key_start:], values[:, :, key_start:]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                             enable_gqa=args.n_kv_heads != args.n_heads)
        return self.wo(out.squeeze(0).transpose(0, 1).reshape(n, self.q_size), residual=residual)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden = args.intermediate_size
        self.w_gate_up = Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w_down = Linear(args.intermediate_size, args.dim, bias=False)
        self.gelu = args.features.gelu
        self.fused = False     # the gated up projection as one kernel (Transformer.use_kernels)

    def forward(self, x, norm: RMSNorm | None = None, residual: torch.Tensor | None = None):
        """The MLP of `x`, normed first by `norm` where given, added to `residual` where given."""
        if self.fused:
            from .kernels import GELU, SILU, gated_linear

            h = gated_linear(x.reshape(-1, x.shape[-1]), self.w_gate_up.weight, GELU if self.gelu else SILU,
                             norm=norm.weight if norm is not None else None,
                             eps=norm.eps if norm is not None else 0.0)
            return self.w_down(h.view(*x.shape[:-1], -1), residual=residual)
        if norm is not None:
            x = norm(x)
        gate, up = self.w_gate_up(x).split(self.hidden, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w_down(gate * up, residual=residual)


class Block(nn.Module):
    """One decoder layer; the EAGLE drafter reuses it with its own cache."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, layer)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)
        if args.features.sandwich_norms:
            self.post_attn_norm = RMSNorm(args.dim, args.norm_eps)
            self.post_mlp_norm = RMSNorm(args.dim, args.norm_eps)
        else:
            self.post_attn_norm = self.post_mlp_norm = None
        # On the row-invariant kernels (Transformer.use_kernels): each norm computed inside the
        # projection that reads it, and each residual added in the epilogue of the projection
        # before it where no norm comes between: fewer kernels a layer.
        self.fused = False

    def forward(self, x, cos, sin, cache, mask, key_start):
        if self.fused:
            summed = self.post_attn_norm is None
            h = self.attn(x, cos, sin, cache, mask, key_start, norm=self.attn_norm, residual=x if summed else None)
            return self.after_attention(x, h, summed)
        return self.after_attention(x, self.attn(self.attn_norm(x), cos, sin, cache, mask, key_start))

    def after_attention(self, x, h, summed: bool = False):
        """The rest of the layer once attention's output `h` is known (with `summed`, h is x plus
        it already): its residual and the MLP's (batched.forward_rows computes attention its own
        way and shares this)."""
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = h if summed else x + h
        if self.fused and self.post_mlp_norm is None:
            return self.mlp(x, norm=self.mlp_norm, residual=x)
        h = self.mlp(x, norm=self.mlp_norm) if self.fused else self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h


class CustomAttention:
    """Attention a caller computes its own way, given where a mask would go: from a layer's
    queries (1, heads, n, dim) and its cache's keys and values (1, kv heads, slots, dim), the
    output (1, heads, n, dim). (EAGLE-3's training-time test, whose rows see a causal prefix
    and a few keys of their own, which no dense mask computes cheaply.)"""

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class Visibility:
    """What each new row attends to, as the row-invariant kernels read it (native.visibility's
    prefix, xoff, extra, on the device), and the sliding window where a layer has one. The
    slots are a cache's `storage` (a KVCache's layer; batched.SlotRows' table of many)."""
    prefix: torch.Tensor
    xoff: torch.Tensor
    extra: torch.Tensor
    positions: torch.Tensor
    window: int = 0
    xend: torch.Tensor | None = None     # where each row's extra slots end (None: xoff[1:])
    slots: torch.Tensor | None = None    # where each row's key and value are written
    base: torch.Tensor | None = None     # where each row's slots begin (None: at 0)


class LayerPlan:
    """What a forward's layers read, per kind of layer (global or sliding): RoPE rows in `rows`,
    (mask, first key) in `masks`; a subclass builds them for its attention."""

    rows: dict
    masks: dict

    def for_layer(self, args: ModelArgs, layer: int):
        kind = "local" if args.is_sliding(layer) else "global"
        cos, sin = self.rows[kind if kind in self.rows else "global"]
        mask, key_start = self.masks[kind]
        return cos, sin, mask, key_start


class KernelPlan(LayerPlan):
    """RoPE rows and visibility for one forward on the row-invariant kernels: the keys each row
    sees as slot lists in position order, so that a tree's row and its path's one-token row
    reduce over the same keys in the same order, and the slot each row's key is written to."""

    def __init__(self, args: ModelArgs, cache: KVCache, positions: torch.Tensor,
                 tree_mask: torch.Tensor | None, rope: dict):
        from .native import visibility

        self.rows = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in rope.items()}
        prefix, xoff, extra = (t.to(positions.device) for t in
                               visibility(cache.length, cache.pending, positions.cpu(),
                                          tree_mask.cpu() if tree_mask is not None else None))
        slots = torch.arange(cache.used, cache.used + positions.shape[0], device=positions.device)
        seen = Visibility(prefix, xoff, extra, positions, slots=slots)
        self.masks = {"global": (seen, 0)}
        if args.sliding_window is not None:
            self.masks["local"] = (dataclasses.replace(seen, window=args.sliding_window), 0)


class DeviceKernelPlan(LayerPlan):
    """KernelPlan over a DeviceKVCache, built on the device with fixed shapes (a static step's):
    row r sees the committed slots [0, length), then the pending and new slots it sees, listed
    in slot order (position order: a tree's ancestors precede it) in its row of a (n, pending +
    n) table. A tree's row and its path's one-token row see the same keys in the same order, as
    in KernelPlan."""

    def __init__(self, args: ModelArgs, cache: DeviceKVCache, positions: torch.Tensor,
                 tree_mask: torch.Tensor | None, rope: dict):
        n = positions.shape[0]
        self.rows = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in rope.items()}
        fresh, count = cache.fresh_visibility(n, tree_mask)
        xoff = torch.arange(n, device=positions.device) * fresh.shape[1]
        prefix = cache.length.expand(n)
        seen = Visibility(prefix, xoff, fresh.reshape(-1), positions, xend=xoff + count, slots=cache.slots)
        self.masks = {"global": (seen, 0)}
        if args.sliding_window is not None:
            self.masks["local"] = (dataclasses.replace(seen, window=args.sliding_window), 0)


class AttentionPlan(LayerPlan):
    """Masks and RoPE rows for one forward, shared by all layers of the same kind."""

    def __init__(self, args: ModelArgs, cache: KVCache, positions: torch.Tensor,
                 tree_mask: torch.Tensor | None, rope: dict):
        n = positions.shape[0]
        past = cache.length
        pending = cache.pending
        device = positions.device
        self.rows = {}
        for kind, (cos, sin) in rope.items():
            self.rows[kind] = (cos[positions], sin[positions])
        if tree_mask is None and (n > 1 or pending):
            tree_mask = torch.cat([torch.ones(n, pending, dtype=torch.bool, device=device),
                                   torch.ones(n, n, dtype=torch.bool, device=device).tril()], dim=1)
        if tree_mask is None:
            global_mask = None
        else:
            global_mask = torch.cat([torch.ones(n, past, dtype=torch.bool, device=device),
                                     tree_mask], dim=1)
        self.masks = {"global": (global_mask, 0)}
        if any(args.is_sliding(i) for i in range(args.n_layers)):
            if pending:
                raise NotImplementedError("sliding-window layers need an empty pending block")
            window = args.sliding_window
            # Committed slot i holds position i, so keys older than the window are sliced off.
            # New tokens sit at positions from `past` on (a tree's root, a chunk's first), and
            # none beyond past + n - 1: host bounds, so the device is never asked.
            key_start = max(0, min(past - window + 1, past))
            key_positions = torch.cat([torch.arange(key_start, past, device=device), positions])
            in_window = (positions[:, None] - key_positions[None, :]) < window
            if global_mask is None and past + n - 1 - key_start < window:
                local_mask = None
            else:
                base = global_mask[:, key_start:] if global_mask is not None else True
                local_mask = in_window & base
            self.masks["local"] = (local_mask, key_start)


class DevicePlan(LayerPlan):
    """AttentionPlan over a DeviceKVCache: every layer reads the whole cache under a mask built
    on the device (committed slots, then the tree's), sliding layers also by distance (a
    committed slot's index is its position; a fresh slot's index is at least its position, so a
    tree shorter than the window is never cut; causal rows sit at their positions)."""

    def __init__(self, args: ModelArgs, cache: DeviceKVCache, positions: torch.Tensor,
                 tree_mask: torch.Tensor | None, rope: dict):
        self.rows = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in rope.items()}
        mask = cache.begin(positions.shape[0], tree_mask)
        self.masks = {"global": (mask, 0)}
        if any(args.is_sliding(i) for i in range(args.n_layers)):
            if tree_mask is not None and cache.pending + positions.shape[0] > args.sliding_window:
                raise ValueError(f"a tree of {cache.pending + positions.shape[0]} fresh slots does "
                                 f"not fit the sliding window of {args.sliding_window}")
            near = (positions[:, None] - cache.slot_ids[None, :]) < args.sliding_window
            self.masks["local"] = (mask & near, 0)


def norm_weight(module) -> torch.Tensor | None:
    """A norm's weight as the native engine reads it (None where the module is no norm)."""
    return module.weight.detach().float().contiguous() if isinstance(module, RMSNorm) else None


def norm_tensors(block: Block) -> dict:
    """A block's norm weights as the native engine reads them (None where the block has none)."""
    return {"attn_norm": norm_weight(block.attn_norm), "mlp_norm": norm_weight(block.mlp_norm),
            "post_attn_norm": norm_weight(block.post_attn_norm), "post_mlp_norm": norm_weight(block.post_mlp_norm),
            "q_norm": norm_weight(block.attn.q_norm), "k_norm": norm_weight(block.attn.k_norm)}


def native_stack(args: ModelArgs, blocks, packed: dict, rope: dict, first: dict | None = None,
                 kv_half: bool = False):
    """Decoder blocks as a native.NativeStack over `packed` projections (`layers.{i}.{name}`);
    `first`: what the first layer's description takes instead (EAGLE-3's norms); kv_half: its
    caches hold halves."""
    from .native import NativeStack

    layers = []
    for i, block in enumerate(blocks):
        kind = "local" if args.is_sliding(i) and "local" in rope else "global"
        cos, sin = rope[kind]
        spec = {name: packed[f"layers.{i}.{name}"]
                for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
        spec.update(norm_tensors(block), cos=cos, sin=sin,
                    window=args.sliding_window if args.is_sliding(i) else 0)
        layers.append(spec | (first or {}) if i == 0 else spec)
    return NativeStack(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.intermediate_size,
                       args.norm_eps, blocks[0].attn.scale, args.features.gelu, layers, kv_half)


@contextmanager
def uninitialized():
    """Linear layers and embeddings built inside get no random initialization: for a model built
    on the meta device whose weights the loader supplies (torch's initializers on meta tensors
    import its compiler: two seconds of a load)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # An untied LM head (Llama 3 8B, Qwen2.5 1.5B and larger); tied ones read the embedding.
        self.output = None if args.tied_embeddings else Linear(args.dim, args.vocab_size, bias=False)
        self.embed_scale = math.sqrt(args.dim) if args.features.scale_embeddings else None
        self.rope = {}
        if not self.norm.weight.is_meta:    # built on meta, the loader makes them (init_rope)
            self.init_rope(self.norm.weight.device)
        self.native = None       # native.NativeModel once `use_native` has run
        self.memory = None       # loading.MemoryNeed: what its weights and a context's cache take
        self.kernels = False     # the row-invariant kernels (kernels.py) once `use_kernels` has run
        self.fused_head = False  # the final norm inside the LM head's kernel (use_kernels)
        # Held by whoever runs a step (a generation, a batch's thread): a model's scratch
        # buffers and native state serve one caller at a time.
        self.lock = threading.RLock()
        self._float_head = None
        self.engine = "torch's kernels"   # what runs it, and why (loading.load_model says)

    def init_rope(self, device: torch.device) -> None:
        """The RoPE tables on `device` (a model built on the meta device gets real ones here)."""
        args = self.args
        self.rope = {"global": tuple(t.to(device) for t in rope_tables(
            args.head_dim, args.rope_base, args.max_seq_len, args.rope_scaling))}
        if any(args.is_sliding(i) for i in range(args.n_layers)):
            # Sliding layers may have a base (and no scaling) of their own (Gemma 3).
            local = (args.rope_local_base, None) if args.features.local_rope else (args.rope_base, args.rope_scaling)
            self.rope["local"] = tuple(t.to(device) for t in rope_tables(
                args.head_dim, local[0], args.max_seq_len, local[1]))

    @property
    def device(self) -> torch.device:
        # The final norm: always materialized (on the native engine the matrices never are).
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def to(self, *a, **kw):
        out = super().to(*a, **kw)
        self.init_rope(self.device)
        return out

    @property
    def weights(self) -> str:
        """The run-time weight format: gguf, bf16 or f32 on the native engine; torch-float32 or
        torch-bfloat16 on torch's kernels."""
        if self.native is not None:
            return self.native.weights
        return "torch-" + str(self.dtype).removeprefix("torch.")

    @property
    def exact(self) -> bool:
        """Whether a forward gives every row the bits a one-token forward gives it (the native
        engine, by construction). torch's kernels do not promise it; in float32 their tree and
        one-token results differ in the last bits only."""
        return self.native is not None or self.kernels

    def use_kernels(self, fused: bool = True) -> None:
        """Compute every matmul, norm and attention with the row-invariant kernels (kernels.py):
        a tree's rows then get the bits of one-token decoding on a GPU, in any dtype. fused:
        norms inside the projections after them, the MLP's activation inside its up
        projection, residuals inside the projections before them (Block.fused), rotary and the
        cache write inside the QKV projection, or with query/key norms in one kernel after it
        (Attention.fused)."""
        from .kernels import available, dot_is_row_invariant

        ok, why = available()
        if not ok:
            raise ValueError(f"the row-invariant kernels cannot run here: {why}")
        if self.native is not None:
            raise ValueError("the native engine is row-invariant already; the kernels are for torch's path")
        for module in self.modules():
            if isinstance(module, (Linear, RMSNorm)):
                module.row_invariant = True
            if isinstance(module, (Block, MLP, Attention)):
                module.fused = fused
        self.kernels = True
        self.fused_head = fused
        # Which linear kernel runs here is decided now, once, not inside a captured step.
        dot_is_row_invariant(self.device, self.dtype)

    def use_native(self, packed: dict, weights: str) -> None:
        """Run on the native CPU engine with `packed` weights (a GGUF pack (packed_file.py) or formats.pack_module_weights)."""
        from .native import NativeModel

        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ValueError("the native engine runs float32 activations on the CPU")
        # A GGUF's formats keep keys and values as halves, as llama.cpp does by default: a
        # batched or long-context step reads its caches more than its weights. f32 and bf16
        # keep floats.
        stack = native_stack(self.args, self.layers, packed, self.rope, kv_half=weights.startswith("gguf"))
        self.native = NativeModel(stack, packed["embed"], packed["head"], self.norm.weight,
                                  self.args.norm_eps, self.embed_scale, weights)
        # The packed copies are what runs: the float projections would only hold memory.
        for block in self.layers:
            for linear_ in (block.attn.wqkv, block.attn.wo, block.mlp.w_gate_up, block.mlp.w_down):
                linear_.weight = nn.Parameter(torch.empty(0, device=self.device), requires_grad=False)

    @property
    def verify_head_rows(self) -> int:
        """Rows sampling verification sends through the LM head at a time (verify.TreeLogits): the
        native engine's row tile, where they cost about one row's pass over the head's weights."""
        return self.native.head_rows if self.native is not None else HEAD_ROWS

    def new_cache(self, max_len: int | None = None) -> KVCache:
        args = self.args
        if self.native is not None:
            return KVCache(args.n_layers, args.n_kv_heads, args.head_dim, max_len or args.max_seq_len,
                           self.native.stack.kv_dtype, self.device, layout="native")
        return KVCache(args.n_layers, args.n_kv_heads, args.head_dim, max_len or args.max_seq_len,
                       self.dtype, self.device)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.embed(tokens)
        x = self.embed(tokens)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from pre-norm hidden states (rows, dim) -> (rows, vocab), in float32."""
        if self.native is not None:
            return self.native.head(hidden)
        if self.kernels:
            from .kernels import linear as fixed_order

            if self.fused_head:         # the final norm inside the head's kernel
                return fixed_order(hidden, self.head_weight, norm=self.norm.weight, eps=self.norm.eps).float()
            return fixed_order(self.norm(hidden), self.head_weight).float()
        return linear(self.norm(hidden), self.head_weight).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of its logits (int64, the first index on ties) from pre-norm hidden
        states (rows, dim): on the fused kernels taken inside the LM head's kernel, the logits
        never stored (kernels.linear_argmax: the same index as lm_head's argmax, the same bits
        being compared); elsewhere lm_head's argmax."""
        if self.native is None and self.kernels and self.fused_head:
            from .kernels import linear_argmax

            return linear_argmax(hidden, self.head_weight, norm=self.norm.weight, eps=self.norm.eps)
        return self.lm_head(hidden).argmax(-1)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight: the embedding's, or an untied head's. On the native engine the
        head lives packed; this is its float32 copy, made when first asked for (training and
        SpecVocab's exact head read it: vocabulary x width floats, 2 GB for Llama 3 8B)."""
        if self.native is not None:
            if self._float_head is None:
                self._float_head = self.native.head_weight.dequantize()
            return self._float_head
        return self.embed.weight if self.output is None else self.output.weight

    def _check_taps(self, taps: tuple[int, ...]) -> None:
        if any(not 0 <= t < self.args.n_layers for t in taps):
            raise ValueError(f"taps {list(taps)}: the model has layers 0 to {self.args.n_layers - 1}")

    def forward_batch(self, items: list[tuple[torch.Tensor, torch.Tensor, KVCache, torch.Tensor | None]],
                      taps: tuple[int, ...] = ()):
        """Rows of several sequences, each item (tokens (n,), positions (n,), its cache, parents
        or None) going after its cache's committed tokens as a tree (see `forward`) or causally,
        and left pending there. Returns each item's hidden states (n, dim) before the final norm,
        and with `taps` also each item's tapped layer outputs (n, len(taps) * dim), as `forward`
        gives them: (hidden states, tapped). On the native engine the items share one call and
        every row gets the bits it gets in a forward of its own item; on torch's kernels they
        run in turn."""
        for tokens, _, cache, _ in items:
            if cache.pending:
                raise ValueError("a batched forward goes after committed tokens: commit first")
            if cache.length + tokens.numel() > self.args.max_seq_len:
                raise ValueError(f"positions up to {cache.length + tokens.numel() - 1} are beyond "
                                 f"max_seq_len {self.args.max_seq_len}")
        self._check_taps(taps)
        if self.native is None or len(items) == 1:    # one item: `forward` itself, a little leaner
            outs = [self(tokens, positions, cache, parents=parents, logits_rows=[], taps=taps)
                    for tokens, positions, cache, parents in items]
            hidden = [out[0] for out in outs]
            return (hidden, [out[2] for out in outs]) if taps else hidden
        sizes = [tokens.numel() for tokens, *_ in items]
        x = self.embed_tokens(torch.cat([tokens for tokens, *_ in items]))
        tapped = self.native.stack.forward_rows(x, [(cache.keys, cache.values, cache.length, parents, n)
                                                    for (_, _, cache, parents), n in zip(items, sizes)], taps)
        for (_, _, cache, _), n in zip(items, sizes):
            cache.advance(n)
        return (list(x.split(sizes)), list(tapped.split(sizes))) if taps else list(x.split(sizes))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                tree_mask: torch.Tensor | None = None, logits_rows: torch.Tensor | None = None,
                all_logits: bool = False, taps: tuple[int, ...] = (), parents: torch.Tensor | None = None):
        """Run `tokens` (n,) at `positions` (n,) after the committed cache.

        tree_mask (n, pending + n): which pending and new tokens each new token sees
        (default: all pending ones and the new ones causally). parents (n,): the new tokens as a
        flattened tree after every cached token (-1 for its root), each seeing its ancestors,
        instead of a mask (`positions` then being the root's plus each node's depth).
        Logits are computed for `logits_rows` (indices; empty: none, and logits is None),
        for every row if `all_logits`, else for the last row only. The cache holds the new
        tokens as pending until `cache.commit`. Returns (hidden (n, dim) before the final
        norm, logits (m, vocab)), and with `taps` (layer indices) a third item: those layers'
        outputs side by side (n, len(taps) * dim), the inputs of fused-feature drafters.
        """
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("forward needs at least one token")
        # New tokens sit at positions past the cached ones, a tree's deepest at most n - 1
        # further: checked on the host (reading positions back would wait for the device).
        if cache.used + n > self.args.max_seq_len:
            raise ValueError(f"positions up to {cache.used + n - 1} are beyond "
                             f"max_seq_len {self.args.max_seq_len}")
        self._check_taps(taps)
        cache.check_room(n)
        x = self.embed_tokens(tokens)
        device_cache = isinstance(cache, DeviceKVCache)
        if device_cache and self.native is not None:
            raise ValueError("the native engine keeps its own cache: a device cache is for torch's kernels")
        if self.native is not None:
            tapped = self.native.stack.forward(x, positions, cache.keys, cache.values, cache.length,
                                               cache.pending, tree_mask, taps, parents=parents)
            tapped = list(tapped.split(self.args.dim, dim=-1)) if taps else []
        else:
            if parents is not None:
                if cache.pending:
                    raise ValueError("a tree given by its parents sees every cached token: commit first")
                tree_mask = ancestor_mask(parents)
            if self.kernels:
                plan_type = DeviceKernelPlan if device_cache else KernelPlan
            else:
                plan_type = DevicePlan if device_cache else AttentionPlan
            plan = plan_type(self.args, cache, positions, tree_mask, self.rope)
            tapped = []
            for i, layer in enumerate(self.layers):
                cos, sin, mask, key_start = plan.for_layer(self.args, i)
                x = layer(x, cos, sin, cache, mask, key_start)
                if i in taps:
                    tapped.append(x)
        cache.advance(n)
        if all_logits:
            logits = self.lm_head(x)
        elif logits_rows is not None:
            logits = self.lm_head(x[logits_rows]) if len(logits_rows) else None
        else:
            logits = self.lm_head(x[-1:])
        if taps:
            return x, logits, torch.cat(tapped, dim=-1)
        return x, logits
