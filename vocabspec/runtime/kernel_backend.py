"""The row-invariant Triton kernels' backend: the reference model's weights run by kernels.py,
so that every row gets the same bits whatever the rows beside it, in any dtype, on a GPU.

`KernelBackend` is torch's backend (torch_backend.py) with its own layer: a decoder block as
the kernels compute it (`kernel_block`), fused (each norm inside the projection that reads it,
each residual in the epilogue of the projection before it where no norm comes between, rotary
and the cache write inside the QKV projection, or with query/key norms in one kernel after it)
or not (one kernel per operation, for timing the fusions). What each row attends to is a
`Visibility` (native.h's drawing), so that a tree's row and its path's one-token row reduce
over the same keys in the same order. Greedy verification takes each row's argmax inside the
LM head's kernel (`linear_argmax`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels
from .slots import SlotCache, SlotTree, blocks_over_slots
from .kv_cache import DeviceKVCache, KVCache
from .model import LayerPlan, ModelArgs, Transformer, check_sequence
from .torch_backend import TorchBackend

# kernels.attention addresses a key as (group * T + slot) * head_dim in 32-bit integers: on the
# kernels a layer's table (every slot's keys) stays within that.
KERNEL_TABLE_ELEMENTS = 2**31 - 1


@dataclass
class Visibility:
    """What each new row attends to (native.h's drawing, on the device) in a cache's `storage`,
    and the sliding window where a layer has one."""
    prefix: torch.Tensor
    xoff: torch.Tensor
    extra: torch.Tensor
    positions: torch.Tensor
    window: int = 0
    xend: torch.Tensor | None = None     # where each row's extra slots end (None: xoff[1:])
    slots: torch.Tensor | None = None    # where each row's key and value are written
    base: torch.Tensor | None = None     # where each row's slots begin (None: at 0)


class KernelPlan(LayerPlan):
    """RoPE rows and each row's `Visibility` for one forward on the row-invariant kernels, and
    the slot each row's key is written to. Over a DeviceKVCache (a graph step's) it is built on
    the device with fixed shapes (`DeviceKVCache.fresh_visibility`)."""

    def __init__(self, args: ModelArgs, cache: KVCache | DeviceKVCache, positions: torch.Tensor,
                 tree_mask: torch.Tensor | None, rope: dict):
        from .native import visibility

        self.rows = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in rope.items()}
        n, device = positions.shape[0], positions.device
        if isinstance(cache, DeviceKVCache):
            fresh, count = cache.fresh_visibility(n, tree_mask)
            xoff = torch.arange(n, device=device) * fresh.shape[1]
            seen = Visibility(cache.length.expand(n), xoff, fresh.reshape(-1), positions, xend=xoff + count,
                              slots=cache.slots)
        else:
            prefix, xoff, extra = (t.to(device) for t in
                                   visibility(cache.length, cache.pending, positions.cpu(),
                                              tree_mask.cpu() if tree_mask is not None else None))
            slots = torch.arange(cache.used, cache.used + n, device=device)
            seen = Visibility(prefix, xoff, extra, positions, slots=slots)
        self.masks = {"global": (seen, 0)}
        if args.sliding_window is not None:
            self.masks["local"] = (dataclasses.replace(seen, window=args.sliding_window), 0)


class SlotRows:
    """One forward's rows over a SlotCache on the row-invariant kernels, as a forward over a
    KVCache of its own has them: where each row writes (`storage`, or `write` where the
    projection is not fused) and what it sees (`visibility`). Row r's slot starts at `base` in
    the table; its key goes to `base + place` and it reads its slot's positions 0 to its own:
    the list a forward of its request alone gives the same row, reduced in the same chunks by
    the same kernels, so the same bits. After the plain rows come the `trees` (SlotTree), each
    seeing what a forward of its request alone shows it (its KernelPlan's), from its base."""

    def __init__(self, cache: SlotCache, slots: torch.Tensor, positions: torch.Tensor,
                 places: torch.Tensor | None = None, trees: list[SlotTree] = ()):
        self.cache, self.slots, self.positions = cache, slots, positions
        self.places = places = positions if places is None else places     # where each row's keys go
        self.trees = list(trees)
        self.plain = slots.numel() - sum(tree.rows for tree in self.trees)
        device = slots.device
        base = cache.base(slots)
        # Plain rows: their slot's positions up to their own, no further list. Trees: their
        # KernelPlan's lists side by side. Built with fixed shapes from device values alone (a
        # captured decode step builds them).
        none = torch.zeros(self.plain, dtype=torch.int32, device=device)
        prefix, xoff, xend = [(positions[:self.plain] + 1).to(torch.int32)], [none], [none]
        extra, listed = [torch.zeros(1, dtype=torch.int32, device=device)], 1
        for tree in self.trees:
            seen = tree.seen
            n = tree.rows
            ends = seen.xoff[1:n + 1] if seen.xend is None else seen.xend
            prefix.append(seen.prefix.to(torch.int32))
            xoff.append((seen.xoff[:n] + listed).to(torch.int32))
            xend.append((ends + listed).to(torch.int32))
            extra.append(seen.extra.to(torch.int32))
            listed += seen.extra.numel()
        one = len(prefix) == 1
        self.seen = Visibility(prefix[0] if one else torch.cat(prefix), xoff[0] if one else torch.cat(xoff),
                               extra[0] if one else torch.cat(extra), positions,
                               xend=xend[0] if one else torch.cat(xend), slots=base + places, base=base)

    def storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.storage(layer)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """k, v (1, kv heads, N, head dim): row r's into its slot at its place; the layer's
        `storage` (as a KVCache's `write` returns its layer, batched (1, ...))."""
        self.cache.keys[layer][self.slots, :, self.places] = k[0].transpose(0, 1)
        self.cache.values[layer][self.slots, :, self.places] = v[0].transpose(0, 1)
        keys, values = self.storage(layer)
        return keys[None], values[None]

    def visibility(self, window: int) -> Visibility:
        """What each row sees in a layer sliding over `window` positions (0: a global layer)."""
        return dataclasses.replace(self.seen, window=window) if window else self.seen


def _linear(module, x: torch.Tensor, norm=None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """A Linear module's product on the fixed-order kernel; `norm` (an RMSNorm) inside it, and
    `residual` added in its epilogue, where given."""
    rows = x.reshape(-1, x.shape[-1])
    y = kernels.linear(rows, module.weight, module.bias, norm=norm.weight if norm is not None else None,
                       eps=norm.eps if norm is not None else 0.0,
                       residual=residual.reshape(rows.shape[0], -1) if residual is not None else None)
    return y.view(*x.shape[:-1], -1)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    return kernels.rms_norm(x.reshape(-1, x.shape[-1]), module.weight, module.eps).view(x.shape)


def _attention(attn, x, cos, sin, cache, seen: Visibility, fused: bool, norm=None, residual=None):
    """A layer's attention over rows x (n, dim) on the kernels: keys and values into `cache`
    (its `storage` in place where fused, its `write` otherwise), each row over the keys `seen`
    lists; `norm` and `residual` go inside the projections (fused)."""
    n, args = x.shape[0], attn.args
    if fused:
        keys, values = cache.storage(attn.layer)
        if attn.q_norm is None:
            q = kernels.qkv_rope_cache(x.reshape(n, -1), attn.wqkv.weight, attn.wqkv.bias, cos, sin, seen.slots,
                                       keys, values, args.n_heads, norm=norm.weight if norm is not None else None,
                                       eps=norm.eps if norm is not None else 0.0)
        else:       # the query/key norms need whole heads: a second kernel after the projection
            q = kernels.head_norm_rope_cache(_linear(attn.wqkv, x, norm).reshape(n, -1), attn.q_norm.weight,
                                             attn.k_norm.weight, attn.q_norm.eps, cos, sin, seen.slots, keys,
                                             values, args.n_heads)
    else:
        q, k, v = attn.rotate(_linear(attn.wqkv, x), cos, sin, norm=_norm)
        keys, values = cache.write(attn.layer, k, v)
        q, keys, values = q[0].transpose(0, 1), keys[0], values[0]
    out = kernels.attention(q, keys, values, seen.prefix, seen.xoff, seen.extra, attn.scale, seen.positions,
                            seen.window, seen.xend, base=seen.base)
    return _linear(attn.wo, out.reshape(n, attn.q_size), residual=residual)


def _mlp(mlp, x: torch.Tensor, fused: bool, norm=None, residual=None) -> torch.Tensor:
    if fused:
        h = kernels.gated_linear(x.reshape(-1, x.shape[-1]), mlp.w_gate_up.weight,
                                 kernels.GELU if mlp.gelu else kernels.SILU,
                                 norm=norm.weight if norm is not None else None, eps=norm.eps if norm is not None else 0.0)
        return _linear(mlp.w_down, h.view(*x.shape[:-1], -1), residual=residual)
    gate, up = _linear(mlp.w_gate_up, x).split(mlp.hidden, dim=-1)
    gate = F.gelu(gate, approximate="tanh") if mlp.gelu else F.silu(gate)
    return _linear(mlp.w_down, gate * up)


def kernel_block(block, x: torch.Tensor, cos, sin, cache, seen: Visibility, fused: bool) -> torch.Tensor:
    """A decoder block (model.Block's weights) over rows x on the kernels (module docstring)."""
    if not fused:
        h = _attention(block.attn, _norm(block.attn_norm, x), cos, sin, cache, seen, False)
        if block.post_attn_norm is not None:
            h = _norm(block.post_attn_norm, h)
        x = x + h
        h = _mlp(block.mlp, _norm(block.mlp_norm, x), False)
        if block.post_mlp_norm is not None:
            h = _norm(block.post_mlp_norm, h)
        return x + h
    summed = block.post_attn_norm is None
    h = _attention(block.attn, x, cos, sin, cache, seen, True, norm=block.attn_norm, residual=x if summed else None)
    if block.post_attn_norm is not None:
        h = _norm(block.post_attn_norm, h)
    x = h if summed else x + h
    if block.post_mlp_norm is None:
        return _mlp(block.mlp, x, True, norm=block.mlp_norm, residual=x)
    return x + _norm(block.post_mlp_norm, _mlp(block.mlp, x, True, norm=block.mlp_norm))


class KernelBackend(TorchBackend):
    """`module`'s weights on the row-invariant kernels (module docstring); fused: the fused
    layer (the default), or one kernel per operation."""

    exact = True
    slot_elements = KERNEL_TABLE_ELEMENTS
    context_bound = False   # a row's attention ends at its own position, whatever the context

    def __init__(self, module: Transformer, runs_on: str = "", fused: bool = True):
        ok, why = kernels.available()
        if not ok:
            raise ValueError(f"the row-invariant kernels cannot run here: {why}")
        super().__init__(module, runs_on or f"row-invariant Triton kernels on {module.device.type}")
        self.fused = fused
        # Which linear kernel runs here is decided now, once, not inside a captured step.
        kernels.dot_is_row_invariant(self.device, self.dtype)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused:         # the final norm inside the head's kernel
            return kernels.linear(hidden, self.head_weight, norm=self.norm.weight, eps=self.norm.eps).float()
        return kernels.linear(_norm(self.norm, hidden), self.head_weight).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax taken inside the LM head's kernel where fused, the logits never
        stored (the same index as lm_head's argmax: the same bits are compared)."""
        if self.fused:
            return kernels.linear_argmax(hidden, self.head_weight, norm=self.norm.weight, eps=self.norm.eps)
        return self.lm_head(hidden).argmax(-1)

    def block(self, block, x, cos, sin, cache, mask) -> torch.Tensor:
        return kernel_block(block, x, cos, sin, cache, mask, self.fused)

    def tree_forward(self, tokens, positions, cache, tree_mask=None, taps: tuple[int, ...] = ()):
        check_sequence(self.args, tokens.shape[0], cache, taps)
        plan = KernelPlan(self.args, cache, positions, tree_mask, self.rope)
        out = self.module.run_layers(self.embed_tokens(tokens), plan, cache, taps, self.block)
        cache.advance(tokens.shape[0])
        return out

    def together(self, allow_inexact: bool, asked: bool | None = None) -> bool:
        return True if asked is None else asked

    def slot_visibility(self, sequence, positions: torch.Tensor, tree_mask):
        return KernelPlan(self.args, sequence, positions, tree_mask, self.rope).masks["global"][0]

    def slot_forward(self, cache: SlotCache, tokens, positions, slots, trees, taps):
        """slots.forward_with_trees on the kernels: plain rows, then each tree's, over `SlotRows`."""
        device = tokens.device
        all_tokens = torch.cat([tokens, *(tree.tokens for tree in trees)])
        all_positions = torch.cat([positions, *(tree.positions for tree in trees)])
        all_slots = torch.cat([slots, *(torch.full((tree.rows,), tree.slot, dtype=torch.long, device=device)
                                        for tree in trees)])
        places = torch.cat([positions, *(tree.places() for tree in trees)])
        rows = SlotRows(cache, all_slots, all_positions, places, trees)
        return blocks_over_slots(self, self.embed_tokens(all_tokens), all_positions, rows, taps)

    def rows_forward(self, tokens, positions, cache, first_slot, context, taps, slots):
        """slots.forward_rows on the kernels: with a slot table, the rows (B, n) flattened, each
        layer over `SlotRows` (sequence b's rows in slot slots[b]); without one, torch's way."""
        if cache is None:
            return super().rows_forward(tokens, positions, cache, first_slot, context, taps, slots)
        b, n = tokens.shape
        if (n == 1 and context > 0) or slots is None:
            slots = torch.arange(b, device=tokens.device) + (0 if n == 1 and context > 0 else first_slot)
        flat = positions.reshape(-1)
        rows = SlotRows(cache, slots[:, None].expand(-1, n).reshape(-1), flat)
        out = blocks_over_slots(self, self.embed_tokens(tokens.reshape(-1)), flat, rows, taps)
        if taps:
            return out[0].view(b, n, -1), out[1].view(b, n, -1)
        return out.view(b, n, -1)
