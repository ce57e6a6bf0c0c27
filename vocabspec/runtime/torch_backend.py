"""torch's backend: the reference `Transformer` (model.py) on torch's kernels, any device.

A step's spans run a forward each over their own KV caches, or, where a batch runs its requests'
rows together (`caches(together=True)`: a GPU's batches), as rows of one forward over per-slot
caches (slots.py): every span a tree or a prompt's chunk in its slot, and a step of plain
rows alone one captured decode step on a GPU. torch's kernels round a row differently with
other rows beside it (SDPA's and the matmuls' reduction order follows the row count), so this
backend is not exact: drafting on it needs inexact answers allowed, and so do rows together.
`KernelBackend` (kernel_backend.py) is the same model on the row-invariant kernels, exact.
"""

from __future__ import annotations

import torch

from .backend import Backend
from .kv_cache import KVCache, ancestor_mask
from .model import Transformer
from .slots import DecodeStep, SlotCache, SlotSequence, SlotTree, forward_rows_on_torch, forward_with_trees_on_torch
from .step_rows import StepRows


def _of_module(name: str) -> property:
    """The wrapped module's attribute `name`, read when asked (moving the module remakes its
    RoPE tables)."""
    return property(lambda self: getattr(self.module, name))


class TorchBackend(Backend):
    """`module` (a Transformer, its weights loaded) on torch's kernels; `runs_on`: what runs it,
    and why (loading.load_model says)."""

    slot_elements: int | None = None    # the most elements a layer's slot table may hold (None: any)
    context_bound = True    # a decode step's attention reads its slots up to the step's context
    device_steps = True

    def __init__(self, module: Transformer, runs_on: str = ""):
        super().__init__(module.args)
        self.module = module
        self.runs_on = runs_on or f"torch's kernels on {module.device.type}"
        self.decodes = {}       # slots.DecodeStep by slot table: a step of plain rows on a GPU

    device = _of_module("device")
    dtype = _of_module("dtype")
    rope = _of_module("rope")
    norm = _of_module("norm")
    head_weight = _of_module("head_weight")
    embed_tokens = _of_module("embed_tokens")
    embedding_rows = _of_module("embed")
    lm_head = _of_module("lm_head")

    @property
    def weights(self) -> str:
        return "torch-" + str(self.dtype).removeprefix("torch.")

    def new_cache(self, max_len: int | None = None) -> KVCache:
        a = self.args
        return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, max_len or a.max_seq_len, self.dtype, self.device)

    # ------------------------------------------------------------ a forward

    def tree_forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, tree_mask=None,
                     taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Backend.tree_forward over a KVCache or a graph step's DeviceKVCache."""
        return self.module(tokens, positions, cache, tree_mask, taps)

    def block(self, block, x, cos, sin, cache, mask) -> torch.Tensor:
        """One decoder layer over rows `x` (slots.py runs a slot table's layers through it)."""
        return block(x, cos, sin, cache, mask, 0)

    def slot_visibility(self, sequence, positions: torch.Tensor, tree_mask):
        """What a span's rows see in its slot, as this backend's slot layers read it (None:
        `tree_mask` as it is)."""
        return None

    slot_forward = forward_with_trees_on_torch      # slots.forward_with_trees' forward here
    rows_forward = forward_rows_on_torch            # slots.forward_rows' here

    def forward(self, rows: StepRows) -> StepRows:
        tables = {id(span.cache.table) if isinstance(span.cache, SlotSequence) else None for span in rows.spans}
        if len(tables) == 1 and None not in tables:
            return self._forward_slots(rows, rows.spans[0].cache.table)
        hidden, tapped = [], []
        for span in rows.spans:
            mask = ancestor_mask(span.parents) if span.parents is not None else None
            h, t = self.tree_forward(span.tokens, span.positions, span.cache, mask, rows.taps)
            hidden.append(h)
            tapped.append(t)
        one = len(hidden) == 1
        return rows.set_outputs(hidden[0] if one else torch.cat(hidden),
                                (tapped[0] if one else torch.cat(tapped)) if rows.taps else None)

    # ------------------------------------------------------------ rows together, over slots

    def together(self, allow_inexact: bool, asked: bool | None = None) -> bool:
        """By default where inexact answers are allowed (torch rounds a row differently beside
        other rows)."""
        if asked and not allow_inexact:
            raise ValueError(f"batched rows on {self.runs_on} round each row differently with "
                             "other rows beside it, so an answer could differ from serving it alone: "
                             "run on the row-invariant kernels (--backend triton), or allow inexact "
                             "answers (--allow-inexact, allow_inexact=True)")
        return allow_inexact if asked is None else asked

    def caches(self, count: int, window: int, together: bool = False) -> list:
        """With `together`, one slot table of as many slots of `window` tokens as half the free
        memory holds (at most `count`), each slot a request's cache (slots.SlotSequence)."""
        if not together:
            return super().caches(count, window)
        table = SlotCache.fitting(self, window, count)
        if self.device.type == "cuda":
            self.decodes[id(table)] = DecodeStep(self, table, head=False)
        return [SlotSequence(table, slot) for slot in range(table.slots)]

    def _forward_slots(self, rows: StepRows, table) -> StepRows:
        """Every span as rows of one forward over the slot table: a step of plain rows alone
        as one decode step (a CUDA graph on a GPU), else each span a tree (`SlotTree`) of
        `forward_with_trees` (a causal chunk as the chain it is)."""
        from .slots import forward_with_trees     # looked up at each call, where tests watch it

        spans, device = rows.spans, self.device
        decode = self.decodes.get(id(table))
        if decode is not None and not rows.taps and all(span.rows == 1 for span in spans):
            return rows.set_outputs(self._decode_step(decode, spans), None)
        trees = []
        for span in spans:
            mask = ancestor_mask(span.parents) if span.parents is not None else \
                torch.ones(span.rows, span.rows, dtype=torch.bool, device=device).tril() if span.rows > 1 else None
            trees.append(SlotTree(self, span.cache, span.tokens.to(device), span.positions.to(device), mask))
        none = torch.zeros(0, dtype=torch.long, device=device)
        out = forward_with_trees(self, table, none, none, none, trees, rows.taps)
        return rows.set_outputs(*(out if rows.taps else (out, None)))

    def _decode_step(self, decode, spans) -> torch.Tensor:
        """Plain rows alone as one captured decode step over the first slots (an idle slot's row
        feeds token 0 at position 0 into its own slot only); each span's hidden state."""
        slots = [span.cache.slot for span in spans]
        rows = decode.rows(max(slots) + 1)
        tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        at = torch.tensor(slots, device=self.device)
        tokens[at] = torch.cat([span.tokens for span in spans]).to(self.device)
        positions[at] = torch.tensor([span.cache.length for span in spans], device=self.device)
        hidden = decode(tokens, positions, max(span.cache.length for span in spans) + 1)[at]
        for span in spans:
            span.cache.advance(1)
        return hidden
