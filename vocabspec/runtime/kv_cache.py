"""Pre-allocated key/value cache that can keep any subset of freshly written slots.

Committed tokens occupy slots [0, length) and slot i always holds position i. A forward pass
appends its n new tokens (a whole draft tree, say) as pending slots after the committed ones;
further forwards may append more (the drafter grows its tree level by level). `commit` then
keeps the chosen pending slots (the accepted path), packing them right after the committed
prefix, and forgets the rest. Nothing here allocates during decoding.

Two layouts: "torch" (layers, 1, kv heads, slots, head_dim), which torch's attention reads,
and "native" (native.h's drawing: keys in blocks of 16 slots, the slots rounded up to them).

`DeviceKVCache` is the same cache with its committed length kept on the device: writes go to
device-computed slots (`index_copy_`), attention reads every slot under a mask built on the
device, and keeping a path copies a fixed number of slots. A step over it has the same shapes
every time and never asks the device for a value: what a CUDA graph can capture (gpt-fast's
graph cache, with EAGLE's tree on top).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device, layout: str = "torch"):
        if layout == "torch":
            shape = (n_layers, 1, n_kv_heads, max_len, head_dim)
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
        elif layout == "native":
            # Not zeroed: native.c reads a slot only once it is written (a partly filled block's
            # other lanes are loaded and dropped), so pages are touched as the sequence grows
            # (zeroing an 8B model's 4096-token cache took a second before the first token).
            slots = -(-max_len // 16) * 16        # whole blocks of 16 keys
            self.keys = torch.empty(n_layers, n_kv_heads, slots // 16, head_dim, 16, dtype=dtype, device=device)
            self.values = torch.empty(n_layers, n_kv_heads, slots, head_dim, dtype=dtype, device=device)
        else:
            raise ValueError(f"unknown cache layout {layout!r}")
        self.layout = layout
        self.max_len = max_len
        self.length = 0      # committed tokens
        self.pending = 0     # tokens written after `length` by the last forward, not committed

    def reset(self) -> None:
        self.length = 0
        self.pending = 0

    @property
    def used(self) -> int:
        """Slots taken (committed and pending), known on the host."""
        return self.length + self.pending

    def check_room(self, n_new: int) -> None:
        if self.used + n_new > self.max_len:
            raise ValueError(
                f"sequence would reach {self.used + n_new} tokens, beyond the cache's "
                f"{self.max_len}; raise max_seq_len or shorten the prompt/max_new_tokens")

    def write(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor):
        """Append new keys/values as pending; return every key/value visible (committed + pending).

        Each layer calls this once per forward; the pending count moves on in `advance`.
        """
        keys, values = self.layer_tensors(layer)
        start = self.length + self.pending
        end = start + new_keys.shape[2]
        keys[:, :, start:end] = new_keys
        values[:, :, start:end] = new_values
        return keys[:, :, :end], values[:, :, :end]

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A torch-layout layer's keys and values (1, kv heads, slots, head_dim), in place."""
        return self.keys[layer], self.values[layer]

    def storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A torch-layout layer's keys and values as (kv heads, slots, head_dim), contiguous
        views of the cache: what the row-invariant kernels write at a forward's slots and read
        in place (kernels.qkv_rope_cache, kernels.attention)."""
        if self.layout != "torch":
            raise ValueError("the kernels read the torch layout")
        keys, values = self.layer_tensors(layer)
        return keys[0], values[0]

    def advance(self, n_new: int) -> None:
        """Count the tokens of the forward that just ran as pending."""
        self.pending += n_new

    def commit(self, keep: torch.Tensor | list[int] | None = None) -> None:
        """Keep the pending slots listed in `keep` (indices into the pending block, in order).

        `keep=None` keeps every pending slot, which is what plain decoding wants. Nothing is
        copied when `keep` is 0, 1, 2, ... (asking costs a read-back of `keep`; a step that
        stays on the device keeps through DeviceKVCache.keep, which copies instead).
        """
        if keep is None:
            self.length += self.pending
        elif self.layout == "native":      # host memory: one native call moves what moves
            from .native import cache_keep

            keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
            if any(not 0 <= a < b for a, b in zip(keep, keep[1:] + [self.pending])):
                raise ValueError(f"slots to keep must increase within the {self.pending} pending: {keep}")
            if keep[-1:] != [len(keep) - 1]:     # else the kept slots are where they stay
                cache_keep(self.keys, self.values, self.length, keep)
            self.length += len(keep)
        else:
            keep = torch.as_tensor(keep, dtype=torch.long, device=self.storage(0)[0].device)
            n_keep = int(keep.numel())
            same = torch.equal(keep, torch.arange(n_keep, device=keep.device))
            if n_keep and not same:
                self.move(keep + self.length, slice(self.length, self.length + n_keep))
            self.length += n_keep
        self.pending = 0

    def move(self, source: torch.Tensor, target: slice) -> None:
        """Copy every layer's slots `source` to `target` (the torch layout)."""
        self.keys[:, :, :, target] = self.keys[:, :, :, source]
        self.values[:, :, :, target] = self.values[:, :, :, source]

    def discard(self) -> None:
        """Forget all pending slots."""
        self.pending = 0

    def key_slots(self) -> torch.Tensor:
        """The native layout's keys as (layers, kv heads, head_dim, slots): a copy, for reading."""
        layers, heads, blocks, head_dim, _ = self.keys.shape
        return self.keys.permute(0, 1, 3, 2, 4).reshape(layers, heads, head_dim, blocks * 16)


class DeviceKVCache(KVCache):
    """The torch layout with `length` a 0-dim device tensor (see the module docstring).

    The host keeps `pending` (a step's structure fixes it) and `bound`, an upper bound on the
    committed length that needs no read-back: it grows by every slot a `keep` could keep, and
    `settle` lowers it to the true length once the caller has read that back anyway.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(n_layers, n_kv_heads, head_dim, max_len, dtype, device)
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.slot_ids = torch.arange(max_len, device=device)
        self.slots = None        # where the running forward writes (set by `begin`)
        self.bound = 0

    def reset(self) -> None:
        self.length.zero_()
        self.pending = 0
        self.bound = 0

    @property
    def used(self) -> int:
        return self.bound + self.pending

    def start_forward(self, n: int) -> None:
        """Where a forward of `n` new tokens after the pending ones writes (`slots`)."""
        self.check_room(n)
        self.slots = self.slot_ids[:n] + self.length + self.pending

    def fresh_visibility(self, n: int, tree_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a forward of `n` new tokens after the pending ones, for attention that reads
        each row's keys as a list (kernels.attention): (fresh, count), where fresh (n, pending +
        n) holds the slots of the pending and new tokens row r sees, in slot order, in its first
        count[r] places (`tree_mask` (n, pending + n), or causal when None). Built on the
        device with fixed shapes: a captured step can run it."""
        self.start_forward(n)
        width = self.pending + n
        places = self.slot_ids[:width]
        if tree_mask is None:
            seen = places[None, :] <= (self.slot_ids[:n, None] + self.pending)
        else:
            seen = tree_mask.to(torch.bool)
        # The seen places first, in order, then the rest: each place's rank among its kind,
        # scattered there (no sort, no read-back).
        count = seen.sum(1)
        rank = torch.where(seen, seen.cumsum(1) - 1, (~seen).cumsum(1) - 1 + count[:, None])
        order = torch.empty_like(rank).scatter_(1, rank, places.expand(n, -1))
        return order + self.length, count

    def begin(self, n: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
        """Start a forward of `n` new tokens after the pending ones; returns which slots each
        new token sees (n, max_len): every committed slot, then the pending and new ones per
        `tree_mask` (n, pending + n), or causally when it is None."""
        self.start_forward(n)
        width = self.pending + n
        offset = self.slot_ids - self.length                  # slot's place after the committed
        if tree_mask is None:
            rows = self.slot_ids[:n, None] + self.pending
            fresh = offset[None, :] <= rows
        else:
            index = offset.clamp(0, width - 1).expand(n, -1)
            fresh = tree_mask.gather(1, index) & (offset < width)[None, :]
        return (offset < 0)[None, :] | fresh

    def write(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor):
        self.keys[layer].index_copy_(2, self.slots, new_keys)
        self.values[layer].index_copy_(2, self.slots, new_values)
        return self.keys[layer], self.values[layer]

    def commit(self, keep=None) -> None:
        """Keep every pending slot (a prompt, a drafter's read); `keep` rows: see `keep`."""
        if keep is not None:
            raise ValueError("a device cache keeps rows with `keep(rows, count)`")
        self.length.add_(self.pending)
        self.bound += self.pending
        self.pending = 0

    def keep(self, rows: torch.Tensor, count: torch.Tensor) -> None:
        """Keep the first `count` (0-dim) of the pending slots `rows` (m,), in order: all m
        slots move (the rest land past the committed length, where nothing reads them), so
        the copy has one shape whatever is kept."""
        m = rows.numel()
        self.check_room(m)       # the slots moved land after the pending ones at worst
        source = rows + self.length
        target = self.slot_ids[:m] + self.length
        self.keys.index_copy_(3, target, self.keys.index_select(3, source))
        self.values.index_copy_(3, target, self.values.index_select(3, source))
        self.length.add_(count)
        self.bound += min(m, self.pending)
        self.pending = 0

    def settle(self, length: int) -> None:
        """The committed length as read back by the caller: the host bound becomes exact."""
        self.bound = length

def ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """(n, n) bool for a flattened tree: row i sees j iff j is i or one of its ancestors.
    parents (n,): each node's parent row, the root's -1 or itself; max_depth: a bound on the
    tree's depth (default n - 1). Built where parents are, by pointer jumping: about
    log2(max_depth) gathers and no read-back, so a captured step can build it too."""
    n = parents.numel()
    up = parents.clamp_min(0)             # the root is its own parent
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    depth = n - 1 if max_depth is None else max_depth
    reach = 1                             # mask holds every ancestor fewer than `reach` steps up
    while reach <= depth:
        mask = mask | mask[up]
        up = up[up]
        reach *= 2
    return mask
