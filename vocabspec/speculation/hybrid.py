"""EAGLE-2 with prompt lookup: the drafter's dynamic tree plus, when the context's last n-gram
occurred before, what followed it, grafted on as one more path from the root.

The two drafts fail in different places: the one-layer drafter guesses fluent text but rarely
a long verbatim copy, while prompt lookup is right exactly when the answer repeats its prompt
or itself (summaries, retrieval answers, code edits) and silent otherwise. Verification is
unchanged and needs nothing from the drafter (greedy follows the target's argmax; sampling
tries each node's children as deterministic candidates), so the union of both drafts stays
lossless. The grafted path costs up to `num_draft` more tokens in the target's forward, and
only where it leaves the drafter's tree; its length adapts as prompt lookup's own does (see
pld.py), to what the lookup path got accepted.

Copy mode: while the answer is copying (the last step accepted at least `copy_after` tokens
of the lookup path), the next step proposes the lookup path alone and skips the drafter's
tree, whose layer and head calls are then wasted time; the first step whose lookup path
falls short goes back to both. The drafter still reads every accepted token, so its state
is current when its tree is needed again.

As static steps (static_step.py, a GPU's path) the lookup runs on the host between steps, as
prompt lookup's own static steps do, and its path is grafted onto the drafter's static tree
on the device (`static_step.graft`): every step verifies the tree's rows plus `num_draft`,
the path's own rows invalid where the tree already holds them. Copy mode is a step of the
path alone, a second captured shape.
"""

from __future__ import annotations

import time

from .drafter import EagleProposer
from .pld import PromptLookupProposer
from .tree import DraftTree, chain_tree, graft_chain


class EagleLookupProposer(EagleProposer):
    def __init__(self, *args, lookup: PromptLookupProposer | None = None, copy_after: int = 2,
                 **kwargs):
        super().__init__(*args, **kwargs)
        if copy_after < 1:
            raise ValueError(f"copy_after must be >= 1, got {copy_after}")
        self.lookup = lookup or PromptLookupProposer(device=self.target.device)
        self.max_tree_tokens = self.total_tokens + self.lookup.num_draft
        self.copy_after = copy_after
        self.grafted = 0        # nodes added by prompt lookup, over all steps
        self.copy_steps = 0     # steps that proposed the lookup path alone
        self._chain: list[int] = []
        self._copying = False

    def observe(self, accepted, hidden, next_token) -> None:
        super().observe(accepted, hidden, next_token)
        self.lookup.observe(accepted, hidden, next_token)
        self._follow(accepted)

    def _follow(self, accepted: list[int]) -> None:
        """Copy mode on when the step accepted at least `copy_after` tokens of the path."""
        followed = 0
        for drafted, token in zip(self._chain, accepted[1:]):
            if drafted != token:
                break
            followed += 1
        self._copying = followed >= self.copy_after

    def propose(self, root_token: int) -> DraftTree:
        start = time.perf_counter()
        self._chain = self.lookup.draft()
        if self._copying and self._chain:
            self.copy_steps += 1
            self.grafted += len(self._chain)
            tree = chain_tree(root_token, self._chain, self.target.device)
            self._count_lookup(time.perf_counter() - start)
            return tree
        looked_up = time.perf_counter() - start
        tree = super().propose(root_token)          # counts its own time
        start = time.perf_counter()
        tree, added = graft_chain(tree, self._chain)
        self.grafted += added
        self._count_lookup(looked_up + time.perf_counter() - start)
        return tree

    # Static steps (static_step.StaticDecoder).

    @property
    def static_rows(self) -> int:
        """The next step's rows: the path alone while copying, else the tree and the path."""
        path = self.lookup.num_draft
        return path + 1 if self._copying and self._chain else super().static_rows + path

    def set_static(self, max_len: int | None) -> None:
        super().set_static(max_len)
        self.lookup.set_static(max_len)

    def reset(self, prompt_ids, prompt_hidden, first_token) -> None:
        super().reset(prompt_ids, prompt_hidden, first_token)
        self.lookup.reset(prompt_ids, prompt_hidden, first_token)
        self._chain = list(self.lookup._drafted)       # staged by a static lookup, else []
        self._copying = False

    def after_static(self, accepted: list[int], next_token: int, length: int) -> None:
        super().after_static(accepted, next_token, length)
        self._follow(accepted)
        self.lookup.after_static(accepted, next_token, length)      # stages the next path
        self._chain = list(self.lookup._drafted)
        if self._copying and self._chain:            # the next step is the path alone
            self.copy_steps += 1

    def propose_static(self, root):
        """The path alone while copying, else grafted onto the drafter's tree. Device work (a
        captured graph replays the branch it was captured in: the two have different row
        counts, so different graphs); `grafted` counts the general loop's added nodes only."""
        from .static_step import graft

        if self._copying and self._chain:
            return self.lookup.propose_static(root)
        tree = super().propose_static(root)          # counts its own time
        start = time.perf_counter()
        tree = graft(tree, self.lookup._buffer, self.lookup._count)
        self._count_lookup(time.perf_counter() - start)
        return tree

    def _count_lookup(self, seconds: float) -> None:
        self.timings["lookup"] = self.timings.get("lookup", 0.0) + seconds
        self.timings["total"] += seconds
