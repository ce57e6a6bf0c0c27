"""The native CPU backend: a target model built from its file's weights on the native engine
(native.c through native.py), never through a float `Transformer`.

The loader hands it every matrix packed (a GGUF's own blocks, memory-mapped, or floats packed
as f32 or bf16) and the norms as float32 tensors named as the reference model names its
parameters. A step's spans run in one call (`vs_stack_forward_rows`, its rows one `vs_rows`
struct), each row in one fixed order, so a tree's rows and a batch's have the bits each gets in
a one-token forward of its own request; greedy verification of every greedy span is one call
too (`vs_verify_greedy`), scoring rows as its walk reaches them.
"""

from __future__ import annotations

import ctypes
import math

import torch

from .backend import Backend
from .kv_cache import KVCache
from .model import ModelArgs, RMSNorm, check_sequence, reference_rope
from .native import NativeStack, VerifyRequest, check_parents, check_range, isa, library
from .step_rows import StepRows

LAYER_NORMS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "attn.q_norm", "attn.k_norm")
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def block_norms(blocks) -> dict[str, torch.Tensor]:
    """The norm weights of decoder blocks (model.Block, a drafter's) named as `native_stack`
    reads them (`layers.{i}.{name}.weight`); a block without one has no entry."""
    norms = {}
    for i, block in enumerate(blocks):
        for name in LAYER_NORMS:
            module = block
            for part in name.split("."):
                module = getattr(module, part, None)
            if isinstance(module, RMSNorm):
                norms[f"layers.{i}.{name}.weight"] = module.weight
    return norms


def native_stack(args: ModelArgs, norms: dict[str, torch.Tensor], packed: dict, rope: dict,
                 first: dict | None = None, kv_half: bool = False) -> NativeStack:
    """Decoder layers as a native.NativeStack over `packed` projections (`layers.{i}.{name}`)
    and `norms` (`block_norms`' names); `first`: what the first layer's description takes
    instead (EAGLE-3's norms); kv_half: its caches hold halves."""
    layers = []
    for i in range(args.n_layers):
        kind = "local" if args.is_sliding(i) and "local" in rope else "global"
        cos, sin = rope[kind]
        spec = {name: packed[f"layers.{i}.{name}"] for name in PROJECTIONS}
        for name in LAYER_NORMS:
            weight = norms.get(f"layers.{i}.{name}.weight")
            spec[name.removeprefix("attn.")] = None if weight is None else weight.detach().float().contiguous()
        spec.update(cos=cos, sin=sin, window=args.sliding_window if args.is_sliding(i) else 0)
        layers.append(spec | (first or {}) if i == 0 else spec)
    return NativeStack(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.intermediate_size,
                       args.norm_eps, args.attn_scale, args.features.gelu, layers, kv_half)


class NativeBackend(Backend):
    """A target on the native CPU engine (see the module docstring). packed: its matrices
    (`layers.{i}.{wq..w_down}`, `embed`, `head`: the same object where tied) as PackedWeights;
    norms: float32 norm weights (`norm.weight` and `block_norms`' names)."""

    exact = True

    def __init__(self, args: ModelArgs, packed: dict, norms: dict[str, torch.Tensor], weights: str):
        super().__init__(args)
        self.weights = weights
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.rope = reference_rope(args)
        # A GGUF's formats keep keys and values as halves, as llama.cpp does by default: a
        # batched or long-context step reads its caches more than its weights. f32 and bf16
        # keep floats.
        self.stack = native_stack(args, norms, packed, self.rope, kv_half=weights.startswith("gguf"))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.norm.weight = torch.nn.Parameter(norms["norm.weight"].detach().float().contiguous(), requires_grad=False)
        self.embed_weight, self.packed_head = packed["embed"], packed["head"]
        self.embed_scale = math.sqrt(args.dim) if args.features.scale_embeddings else 0.0
        # With 8-bit activations a drafter's weights go to Q8_0 groups too (lossy, for the
        # drafter only: it changes what is drafted, never what is accepted).
        self.drafter_format = "q8i" if weights == "gguf-a8" else "bf16"
        self.runs_on = f"the native CPU engine ({isa()})"
        self._embed_struct, self._head_struct = self.embed_weight.struct(), self.packed_head.struct()
        self._work = torch.empty(0, dtype=torch.float32)
        self._float_head = None

    @property
    def head_rows(self) -> int:
        """Rows verification scores at a time: as many as one pass over the head's weights
        takes (the matmul's row tile)."""
        return library().vs_tile_rows()

    @property
    def head_weight(self) -> torch.Tensor:
        """The head's float32 copy, made when first asked for (training and SpecVocab's exact
        head read it: vocabulary x width floats, 2 GB for Llama 3 8B)."""
        if self._float_head is None:
            self._float_head = self.packed_head.dequantize()
        return self._float_head

    def new_cache(self, max_len: int | None = None) -> KVCache:
        a = self.args
        return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, max_len or a.max_seq_len, self.stack.kv_dtype,
                       self.device, layout="native")

    def embed_tokens(self, tokens: torch.Tensor, scaled: bool = True) -> torch.Tensor:
        """The tokens' rows of the embedding table, float32; times the model's embedding scale
        unless `scaled` is False (EAGLE-3 drafters read the table as it is)."""
        ids = tokens.to(torch.int32).contiguous()
        check_range("token id", tokens, 0, self.embed_weight.rows)
        out = torch.empty(ids.numel(), self.embed_weight.cols, dtype=torch.float32)
        library().vs_embed(ctypes.byref(self._embed_struct), ids.data_ptr(), ids.numel(),
                           self.embed_scale if scaled else 0.0, out.data_ptr())
        return out

    def embedding_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens, scaled=False)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(torch.float32).contiguous()
        rows = hidden.shape[0]
        if hidden.dim() != 2 or hidden.shape[1] != self.packed_head.cols:
            raise ValueError(f"the head reads rows of {self.packed_head.cols} floats, not {tuple(hidden.shape)}")
        self._reserve(hidden.numel())
        logits = torch.empty(rows, self.packed_head.rows, dtype=torch.float32)
        if rows:
            library().vs_head(self.norm.weight.data_ptr(), self.args.norm_eps, ctypes.byref(self._head_struct),
                              hidden.data_ptr(), rows, self._work.data_ptr(), logits.data_ptr())
        return logits

    def _reserve(self, floats: int) -> None:
        if self._work.numel() < floats:
            self._work = torch.empty(floats, dtype=torch.float32)

    def forward(self, rows: StepRows) -> StepRows:
        """One native call over every span (`NativeStack.forward_rows`: every row the bits of a
        call of its own span)."""
        spans = rows.spans
        x = self.embed_tokens(torch.cat([span.tokens for span in spans]) if len(spans) > 1 else spans[0].tokens)
        tapped = self.stack.forward_rows(x, [(span.cache.keys, span.cache.values, span.cache.length, span.parents,
                                              span.rows) for span in spans], rows.taps)
        for span in spans:
            span.cache.advance(span.rows)
        return rows.set_outputs(x, tapped)

    def tree_forward(self, tokens, positions, cache, tree_mask=None, taps: tuple[int, ...] = ()):
        check_sequence(self.args, tokens.numel(), cache, taps)
        x = self.embed_tokens(tokens)
        tapped = self.stack.forward(x, positions, cache.keys, cache.values, cache.length, cache.pending, tree_mask,
                                    taps)
        cache.advance(tokens.numel())
        return x, tapped

    def verify_greedy_trees(self, hidden: torch.Tensor, trees: list[tuple[torch.Tensor, torch.Tensor]],
                            head_rows: int | None = None) -> list[tuple[list[int], int]]:
        """Every tree's greedy verdict in one call (`vs_verify_greedy`): the LM head scores rows
        as verification reaches them, every tree's first `head_rows` in one pass over the head."""
        head_rows = min(max(self.head_rows if head_rows is None else head_rows, 1), 64)
        hidden = hidden.to(torch.float32).contiguous()
        sizes = [t.numel() for t, _ in trees]
        offsets = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0)
        for i, (t, p) in enumerate(trees):
            if p.numel() != t.numel():
                raise ValueError(f"tree {i}: {t.numel()} tokens, {p.numel()} parents")
            check_parents(f"tree {i}", p.to(torch.int64))
        if hidden.dim() != 2 or hidden.shape != (int(offsets[-1]), self.packed_head.cols):
            raise ValueError(f"verification reads {int(offsets[-1])} rows of {self.packed_head.cols} floats, "
                             f"not {tuple(hidden.shape)}")
        tokens = torch.cat([t for t, _ in trees]).to(torch.int64).contiguous()
        parents = torch.cat([p for _, p in trees]).to(torch.int64).contiguous()
        self._reserve(head_rows * len(trees) * hidden.shape[1])
        paths = torch.empty(int(offsets[-1]), dtype=torch.int64)
        counts, following = torch.empty(len(trees), dtype=torch.int64), torch.empty(len(trees), dtype=torch.int64)
        request = VerifyRequest(norm=self.norm.weight.data_ptr(), head=ctypes.addressof(self._head_struct),
                                hidden=hidden.data_ptr(), offsets=offsets.data_ptr(), tokens=tokens.data_ptr(),
                                parents=parents.data_ptr(), paths=paths.data_ptr(), counts=counts.data_ptr(),
                                next=following.data_ptr(), work=self._work.data_ptr(), ntrees=len(trees),
                                head_rows=head_rows, eps=self.args.norm_eps)
        library().vs_verify_greedy(ctypes.byref(request))
        paths, counts, following = paths.tolist(), counts.tolist(), following.tolist()
        return [(paths[start:start + count], nxt) for start, count, nxt in zip(offsets.tolist(), counts, following)]
