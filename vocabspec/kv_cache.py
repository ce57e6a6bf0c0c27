"""Pre-allocated key/value cache that can keep any subset of freshly written slots.

Committed tokens occupy slots [0, length) and slot i always holds position i. A forward pass
appends its n new tokens (a whole draft tree, say) as pending slots after the committed ones;
further forwards may append more (the drafter grows its tree level by level). `commit` then
keeps the chosen pending slots (the accepted path), packing them right after the committed
prefix, and forgets the rest. Nothing here allocates during decoding.

Two layouts: "torch" (layers, 1, kv heads, slots, head_dim), which torch's attention reads,
and "native" (native.c), where keys are (layers, kv heads, head_dim, slots) so that a vector
holds one dimension of 16 keys, and values are (layers, kv heads, slots, head_dim).
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
            self.keys = torch.zeros(n_layers, n_kv_heads, head_dim, max_len, dtype=dtype, device=device)
            self.values = torch.zeros(n_layers, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        else:
            raise ValueError(f"unknown cache layout {layout!r}")
        self.layout = layout
        self.max_len = max_len
        self.length = 0      # committed tokens
        self.pending = 0     # tokens written after `length` by the last forward, not committed

    def reset(self) -> None:
        self.length = 0
        self.pending = 0

    def check_room(self, n_new: int) -> None:
        if self.length + self.pending + n_new > self.max_len:
            raise ValueError(
                f"sequence would reach {self.length + self.pending + n_new} tokens, beyond the cache's "
                f"{self.max_len}; raise max_seq_len or shorten the prompt/max_new_tokens")

    def write(self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor):
        """Append new keys/values as pending; return every key/value visible (committed + pending).

        Each layer calls this once per forward; the pending count moves on in `advance`.
        """
        start = self.length + self.pending
        end = start + new_keys.shape[2]
        self.keys[layer, :, :, start:end] = new_keys
        self.values[layer, :, :, start:end] = new_values
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def advance(self, n_new: int) -> None:
        """Count the tokens of the forward that just ran as pending."""
        self.pending += n_new

    def commit(self, keep: torch.Tensor | list[int] | None = None, skip_kept_prefix: bool = True) -> None:
        """Keep the pending slots listed in `keep` (indices into the pending block, in order).

        `keep=None` keeps every pending slot, which is what plain decoding wants.
        skip_kept_prefix: copy nothing when `keep` is 0, 1, 2, ... (asking costs a read-back of
        `keep`; a step that stays on the device copies instead).
        """
        if keep is None:
            self.length += self.pending
        elif self.layout == "native":      # host memory: one native call moves what moves
            from .native import cache_keep

            keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
            if any(not 0 <= a < b for a, b in zip(keep, keep[1:] + [self.pending])):
                raise ValueError(f"slots to keep must increase within the {self.pending} pending: {keep}")
            cache_keep(self.keys, self.values, self.length, keep)
            self.length += len(keep)
        else:
            keep = torch.as_tensor(keep, dtype=torch.long, device=self.keys.device)
            n_keep = int(keep.numel())
            same = skip_kept_prefix and torch.equal(keep, torch.arange(n_keep, device=keep.device))
            if n_keep and not same:
                src = keep + self.length
                dst = slice(self.length, self.length + n_keep)
                self.keys[:, :, :, dst] = self.keys[:, :, :, src]
                self.values[:, :, :, dst] = self.values[:, :, :, src]
            self.length += n_keep
        self.pending = 0

    def discard(self) -> None:
        """Forget all pending slots."""
        self.pending = 0

    def rollback(self, length: int) -> None:
        """Forget committed tokens past `length` (tests replay paths from one context)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        self.length = length
        self.pending = 0
