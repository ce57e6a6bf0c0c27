"""One step's rows: what every part of a decoding step shares (the loop's counterpart of vLLM's
`SpecDecodeMetadata`).

A step runs each running request's rows through the target in one forward: a drafted tree
(its root, the last token chosen, first; each other row's parent an earlier row), its root
alone where it drafts nothing, or a prompt's chunk (causal rows, when a request joins). The
loop lays them out as one `StepRows`, a `RowSpan` per request: its tokens, its parents (None
for causal rows), its positions, its KV cache and where its rows lie among the step's. A
backend's `forward` fills in the hidden states (and the tapped layers' outputs a fused-feature
drafter reads), `verify_greedy` each greedy span's accepted path and next token, and the loop
then verifies the rest, commits and emits from the same object.

A span's rows go after its cache's committed tokens and stay there as pending slots until the
loop commits the accepted ones (`KVCache.commit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def depths_of(parents: list[int]) -> list[int]:
    """Each row's depth below the root of a tree given by its parents (-1 for the root, each
    row's parent before it)."""
    depths = [0] * len(parents)
    for row in range(1, len(parents)):
        depths[row] = depths[parents[row]] + 1
    return depths


@dataclass(eq=False)
class RowSpan:
    """One request's rows in a step."""
    tokens: torch.Tensor                 # (n,) a tree's root first, or a prompt chunk's tokens
    cache: object                        # its KVCache: the rows go after its committed tokens
    parents: torch.Tensor | None = None  # (n,) each row's parent row, -1 for the root; None: causal
    positions: torch.Tensor | None = None  # (n,) each row's position (made from the above if not given)
    start: int = 0                       # its first row among the step's
    owner: object = None                 # whoever laid it out (the loop's slot)
    # Greedy verification's verdict (Backend.verify_greedy): the accepted rows, root first,
    # and the target's token after them.
    path: list[int] | None = None
    next_token: int = -1
    # Set by a backend whose forward ran the whole step on the device (the graph decoder):
    # the accepted tokens, their value ranks and the drafts verified, the cache committed and
    # the proposer told already.
    settled: tuple | None = None

    def __post_init__(self):
        if self.positions is None:
            base = self.cache.length
            if self.parents is None:
                self.positions = torch.arange(base, base + self.tokens.numel(), device=self.tokens.device)
            else:
                self.positions = torch.tensor(depths_of(self.parents.tolist()), device=self.tokens.device) + base

    @property
    def rows(self) -> int:
        return self.tokens.numel()

    @property
    def stop(self) -> int:
        return self.start + self.rows


@dataclass(eq=False)
class StepRows:
    """Every span of a step, their rows one after another; `taps`: the layers whose outputs
    the step's drafters read (the union of theirs), ascending."""
    spans: list[RowSpan] = field(default_factory=list)
    taps: tuple[int, ...] = ()
    hidden: torch.Tensor | None = None   # (rows, dim): the last layer's states, before the final norm
    tapped: torch.Tensor | None = None   # (rows, len(taps) * dim): the tapped layers' outputs

    def add(self, tokens: torch.Tensor, cache, parents: torch.Tensor | None = None,
            positions: torch.Tensor | None = None, owner=None) -> RowSpan:
        span = RowSpan(tokens, cache, parents, positions, start=self.rows, owner=owner)
        self.spans.append(span)
        return span

    @property
    def rows(self) -> int:
        return self.spans[-1].stop if self.spans else 0

    def hidden_of(self, span: RowSpan) -> torch.Tensor:
        return self.hidden[span.start:span.stop]

    def tapped_of(self, span: RowSpan, wanted: tuple[int, ...]) -> list[torch.Tensor]:
        """The outputs of the layers `wanted` (a drafter's taps, a subset of the step's) at the
        span's rows, side by side in `wanted`'s order: [] without taps."""
        if not wanted:
            return []
        rows = self.tapped[span.start:span.stop]
        if tuple(wanted) == self.taps:
            return [rows]
        dim = rows.shape[-1] // len(self.taps)
        return [torch.cat([rows[:, self.taps.index(t) * dim:(self.taps.index(t) + 1) * dim] for t in wanted],
                          dim=-1)]

    def set_outputs(self, hidden: torch.Tensor, tapped: torch.Tensor | None) -> "StepRows":
        self.hidden, self.tapped = hidden, tapped
        return self
