"""The target model: one readable decoder-only transformer for Llama (and Mistral, Qwen2, Qwen3)
and Gemma 3.

A forward pass takes token ids, their positions and (optionally) a mask over the new tokens,
so a whole draft tree is scored in one pass against the cached context. It returns the last
layer's hidden states before the final norm (the drafter's input feature) and logits for the
requested rows only, because the LM head is the expensive part with large vocabularies.

Gemma 3 differs from Llama in: scaled embeddings, RMSNorm around both sub-blocks, QK norm,
GELU-tanh MLP, a query scale of query_pre_attn_scalar**-0.5, and sliding-window layers with
their own RoPE base (every `sliding_window_pattern`-th layer is global).

The modules below are the reference, run by torch on any device (torch_backend.TorchBackend
runs them; kernel_backend.KernelBackend runs their weights on the row-invariant Triton kernels).
On a CPU the native engine (native_backend.NativeBackend) runs the same architecture from the
model file's own weights, with no module of this file built.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kv_cache import DeviceKVCache, KVCache
from .linear import Linear, linear


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
    def matrix_parameters(self) -> int:
        """The weights of its matrices: every layer's projections, the embedding, an untied head."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.n_layers * (q * self.dim * 2 + kv * self.dim * 2 + 3 * self.dim * self.intermediate_size) + \
            self.vocab_size * self.dim * (1 if self.tied_embeddings else 2)

    @property
    def attn_scale(self) -> float:
        """Queries' scale: query_pre_attn_scalar ** -0.5 where the family says so, else head_dim's."""
        scalar = self.query_pre_attn_scalar if self.features.query_scalar else None
        return (scalar or self.head_dim) ** -0.5

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

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        if args.features.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = args.attn_scale

    def rotate(self, qkv: torch.Tensor, cos, sin, norm=None):
        """Queries, keys and values (1, heads, n, head_dim) from the projection `qkv` (n, q + 2 kv
        widths), queries and keys normed (where the family norms them, by `norm(module, x)`,
        the module's own forward by default) and rotated."""
        n, args = qkv.shape[0], self.args
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            norm = norm or (lambda module, x: module(x))
            q = norm(self.q_norm, q.reshape(n, args.n_heads, args.head_dim))
            k = norm(self.k_norm, k.reshape(n, args.n_kv_heads, args.head_dim))
            q = apply_rope(q.transpose(0, 1).unsqueeze(0), cos, sin)
            k = apply_rope(k.transpose(0, 1).unsqueeze(0), cos, sin)
        else:
            # Queries and keys sit side by side: one rotation over both, the same arithmetic
            # per element in half the kernels.
            qk = qkv[:, :self.q_size + self.kv_size].view(n, args.n_heads + args.n_kv_heads, args.head_dim)
            qk = apply_rope(qk.transpose(0, 1).unsqueeze(0), cos, sin)
            q, k = qk[:, :args.n_heads], qk[:, args.n_heads:]
        return q, k, v.view(n, args.n_kv_heads, args.head_dim).transpose(0, 1).unsqueeze(0)

    def forward(self, x, cos, sin, cache: KVCache, mask, key_start: int):
        """Attention over `x` (n, dim): its keys and values written to `cache`; `mask` what
        each row sees (a boolean mask, None for all, or a CustomAttention)."""
        n = x.shape[0]
        q, k, v = self.rotate(self.wqkv(x), cos, sin)
        keys, values = cache.write(self.layer, k, v)
        if isinstance(mask, CustomAttention):
            out = mask.attend(q, keys, values, self.scale)
        else:
            if key_start:
                keys, values = keys[:, :, key_start:], values[:, :, key_start:]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=self.args.n_kv_heads != self.args.n_heads)
        return self.wo(out.squeeze(0).transpose(0, 1).reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden = args.intermediate_size
        self.w_gate_up = Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w_down = Linear(args.intermediate_size, args.dim, bias=False)
        self.gelu = args.features.gelu

    def forward(self, x):
        gate, up = self.w_gate_up(x).split(self.hidden, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w_down(gate * up)


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

    def forward(self, x, cos, sin, cache, mask, key_start):
        return self.after_attention(x, self.attn(self.attn_norm(x), cos, sin, cache, mask, key_start))

    def after_attention(self, x, h):
        """The rest of the layer once attention's output `h` is known: its residual and the
        MLP's (slots.forward_rows computes attention its own way and shares this)."""
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
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


class AttentionPlan(LayerPlan):
    """Masks and RoPE rows for one forward, shared by all layers of the same kind.

    Over a DeviceKVCache every layer reads the whole cache under a mask built on the device
    (committed slots, then the tree's), sliding layers also by distance (a committed slot's
    index is its position; a fresh slot's index is at least its position, so a tree shorter
    than the window is never cut; causal rows sit at their positions)."""

    def __init__(self, args: ModelArgs, cache: KVCache | DeviceKVCache, positions: torch.Tensor,
                 tree_mask: torch.Tensor | None, rope: dict):
        n, pending, device = positions.shape[0], cache.pending, positions.device
        sliding = any(args.is_sliding(i) for i in range(args.n_layers))
        self.rows = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in rope.items()}
        if isinstance(cache, DeviceKVCache):
            mask = cache.begin(n, tree_mask)
            self.masks = {"global": (mask, 0)}
            if sliding:
                if tree_mask is not None and pending + n > args.sliding_window:
                    raise ValueError(f"a tree of {pending + n} fresh slots does "
                                     f"not fit the sliding window of {args.sliding_window}")
                near = (positions[:, None] - cache.slot_ids[None, :]) < args.sliding_window
                self.masks["local"] = (mask & near, 0)
            return
        past = cache.length
        if tree_mask is None and (n > 1 or pending):
            tree_mask = torch.cat([torch.ones(n, pending, dtype=torch.bool, device=device),
                                   torch.ones(n, n, dtype=torch.bool, device=device).tril()], dim=1)
        global_mask = None if tree_mask is None else \
            torch.cat([torch.ones(n, past, dtype=torch.bool, device=device), tree_mask], dim=1)
        self.masks = {"global": (global_mask, 0)}
        if sliding:
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


def check_sequence(args: ModelArgs, n: int, cache, taps: tuple[int, ...] = ()) -> None:
    """ValueError unless `n` rows fit after `cache`'s slots, within the model's positions, and
    `taps` are among its layers."""
    if n < 1:
        raise ValueError("forward needs at least one token")
    # New tokens sit at positions past the cached ones, a tree's deepest at most n - 1
    # further: checked on the host (reading positions back would wait for the device).
    if cache.used + n > args.max_seq_len:
        raise ValueError(f"positions up to {cache.used + n - 1} are beyond max_seq_len {args.max_seq_len}")
    if any(not 0 <= t < args.n_layers for t in taps):
        raise ValueError(f"taps {list(taps)}: the model has layers 0 to {args.n_layers - 1}")
    cache.check_room(n)


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


def reference_rope(args: ModelArgs, device: torch.device | str = "cpu") -> dict:
    """The RoPE tables of a model of `args`: "global", and "local" where sliding layers rotate
    their own way (a base, and no scaling, of their own: Gemma 3)."""
    rope = {"global": tuple(t.to(device) for t in rope_tables(
        args.head_dim, args.rope_base, args.max_seq_len, args.rope_scaling))}
    if any(args.is_sliding(i) for i in range(args.n_layers)):
        local = (args.rope_local_base, None) if args.features.local_rope else (args.rope_base, args.rope_scaling)
        rope["local"] = tuple(t.to(device) for t in rope_tables(args.head_dim, local[0], args.max_seq_len, local[1]))
    return rope


class Transformer(nn.Module):
    """The reference model: embedding, decoder blocks, final norm, LM head (tied: the
    embedding), run by torch on any device. It holds no engine state: a backend runs it."""

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

    def init_rope(self, device: torch.device) -> None:
        """The RoPE tables on `device` (a model built on the meta device gets real ones here)."""
        self.rope = reference_rope(self.args, device)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def to(self, *a, **kw):
        out = super().to(*a, **kw)
        self.init_rope(self.device)
        return out

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from pre-norm hidden states (rows, dim) -> (rows, vocab), in float32."""
        return linear(self.norm(hidden), self.head_weight).float()

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight: the embedding's, or an untied head's."""
        return self.embed.weight if self.output is None else self.output.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                tree_mask: torch.Tensor | None = None, taps: tuple[int, ...] = ()):
        """Run `tokens` (n,) at `positions` (n,) after the cache's committed and pending slots.

        tree_mask (n, pending + n): which pending and new tokens each new token sees (default:
        all pending ones and the new ones causally). The cache holds the new tokens as pending
        until `cache.commit`. Returns (hidden (n, dim) before the final norm, the `taps` layers'
        outputs side by side (n, len(taps) * dim) or None): the inputs of drafters; `lm_head`
        scores the rows a caller wants.
        """
        check_sequence(self.args, tokens.shape[0], cache, taps)
        plan = AttentionPlan(self.args, cache, positions, tree_mask, self.rope)
        x, tapped = self.run_layers(self.embed_tokens(tokens), plan, cache, taps)
        cache.advance(tokens.shape[0])
        return x, tapped

    def run_layers(self, x: torch.Tensor, plan: LayerPlan, cache, taps: tuple[int, ...], block=None):
        """Rows `x` through every layer as `plan` shows them, each by its own forward or by
        `block(layer, x, cos, sin, cache, mask)`; (the last layer's output, the taps' outputs
        side by side or None)."""
        tapped = []
        for i, layer in enumerate(self.layers):
            cos, sin, mask, key_start = plan.for_layer(self.args, i)
            x = layer(x, cos, sin, cache, mask, key_start) if block is None else block(layer, x, cos, sin, cache, mask)
            if i in taps:
                tapped.append(x)
        return x, torch.cat(tapped, dim=-1) if taps else None
