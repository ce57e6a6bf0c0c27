"""EAGLE-2 with prompt lookup: the drafter's dynamic tree plus, when the context's last n-gram
occurred before, what followed it, grafted on as one more path from the root.

The two drafts fail in different places: the one-layer drafter guesses fluent text but rarely
a long verbatim copy, while prompt lookup is right exactly when the answer repeats its prompt
or itself (summaries, retrieval answers, code edits) and silent otherwise. Verification is
unchanged and needs nothing from the drafter (greedy follows the target's argmax; sampling
tries each node's children as deterministic candidates), so the union of both drafts stays
lossless. The grafted path costs up to `num_draft` more tokens in the target's forward, and
only where it leaves the drafter's tree; its length adapts as prompt lookup's own does (see
pld.py), to what the lookup path got accepted. Where the live rule sizes the tree
(live_tree.py) the path is scored by its own measured acceptance too: only the tokens whose
chance to be right (measured per position of past paths) pays for their rows are verified.

Copy mode: while the answer is copying (the last step accepted at least `copy_after` tokens
of the lookup path), the next step proposes the lookup path alone and skips the drafter's
tree, whose layer and head calls are then wasted time; the first step whose lookup path
falls short goes back to both. The drafter still reads every accepted token (in one read
when its tree is next needed), so its state is current then.

As graph steps (graph_step.py, a GPU's path) the lookup runs on the host between steps, as
prompt lookup's own graph steps do, and its path is grafted onto the drafter's graph tree
on the device (`graph_step.graft`): every step verifies the tree's rows plus `num_draft`,
the path's own rows invalid where the tree already holds them. Copy mode is a step of the
path alone, a second captured shape.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from ..config import Family, register
from .eagle import EagleProposer
from .eagle_family import EAGLE_OPTIONS, build_eagle, eagle_names
from ..proposer import GraphDrafting
from .pld import PromptLookupProposer, followed
from ..tree import Tree, chain, graft


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
        """Copy mode on when the step accepted at least `copy_after` tokens of the path; the
        path's outcome learned where the live rule scores it."""
        taken = followed(self._chain, accepted)
        self._copying = taken >= self.copy_after
        if self._chain and self.live_sizing() is not None:
            self.sizing.path.learn(len(self._chain), taken)

    def next_tree_tokens(self) -> int:
        """The next proposal's drafts at most: the lookup path (a cheap lookup) plus, outside
        copy mode, the drafter's tree. A batch's draft budget weighs this, not the largest
        graft: with that, no tree ever paid for a lone request's rows."""
        path = self.lookup.next_tree_tokens()
        return path if self._copying and path else super().next_tree_tokens() + path

    def propose(self, root_token: int) -> Tree:
        start = time.perf_counter()
        self._chain = self.lookup.draft()
        if self.live_sizing() is not None:      # the path's tokens that pay for their rows
            self._chain = self.lookup.drafted = self._chain[:self.sizing.path_rows(len(self._chain))]
        if self._copying and self._chain:
            self.copy_steps += 1
            self.grafted += len(self._chain)
            tree = chain(root_token, self._chain, device=self.target.device)
            self._count_lookup(time.perf_counter() - start)
            if self.live_sizing() is not None:      # a step the rule did not size: its cost alone
                self.sizing.tree, self.sizing.extra_rows = None, len(self._chain)
            return tree
        looked_up = time.perf_counter() - start
        if self.sizing is not None:         # the path's rows come on top of the tree it sizes
            self.sizing.extra_rows = len(self._chain)
        tree = super().propose(root_token)          # counts its own time
        start = time.perf_counter()
        if self._chain:
            size = tree.size
            tree = graft(tree, torch.tensor(self._chain, device=tree.tokens.device),
                         torch.tensor(len(self._chain), device=tree.tokens.device)).compact()
            self.grafted += tree.size - size
            if self.sizing is not None:
                self.sizing.extra_rows = tree.size - size      # less what the tree already had
        self._count_lookup(looked_up + time.perf_counter() - start)
        return tree

    def reset(self, prompt_ids, prompt_hidden, first_token) -> None:
        super().reset(prompt_ids, prompt_hidden, first_token)
        self.lookup.reset(prompt_ids, prompt_hidden, first_token)
        self._chain = list(self.lookup.drafted)       # staged by a graph step's lookup, else []
        self._copying = False

    def graph_form(self, max_len: int | None) -> "HybridGraphDrafting | None":
        tree_form = super().graph_form(max_len)
        path_form = self.lookup.graph_form(max_len)
        return HybridGraphDrafting(self, tree_form, path_form) if max_len is not None else None

    def _count_lookup(self, seconds: float) -> None:
        self.timings["lookup"] = self.timings.get("lookup", 0.0) + seconds
        self.timings["total"] += seconds


class HybridGraphDrafting(GraphDrafting):
    """eagle+pld in graph steps: the path alone while copying, else grafted onto the
    drafter's tree, as device work (a captured graph replays the branch it was captured in: the
    two have different row counts, so different graphs). `grafted` counts the general loop's
    added nodes only."""

    def __init__(self, proposer: EagleLookupProposer, tree_form: GraphDrafting, path_form: GraphDrafting):
        self.proposer, self.tree_form, self.path_form = proposer, tree_form, path_form
        self.cache = tree_form.cache

    def _path_alone(self) -> bool:
        return self.proposer._copying and bool(self.proposer._chain)

    @property
    def rows(self) -> int:
        """The next step's rows: the path alone while copying, else the tree and the path."""
        path = self.proposer.lookup.num_draft
        return path + 1 if self._path_alone() else self.tree_form.rows + path

    def propose(self, root: torch.Tensor) -> Tree:
        if self._path_alone():
            return self.path_form.propose(root)
        tree = self.tree_form.propose(root)          # counts its own time
        start = time.perf_counter()
        lookup = self.proposer.lookup
        tree = graft(tree, lookup.staged, lookup.staged_count)
        self.proposer._count_lookup(time.perf_counter() - start)
        return tree

    def buffers(self) -> list[torch.Tensor]:
        return self.tree_form.buffers() + self.path_form.buffers()

    def observe(self, reads, rows, count) -> None:
        self.tree_form.observe(reads, rows, count)

    def after(self, accepted: list[int], next_token: int, length: int) -> None:
        p = self.proposer
        self.tree_form.after(accepted, next_token, length)
        p._follow(accepted)
        self.path_form.after(accepted, next_token, length)      # stages the next path
        p._chain = list(p.lookup.drafted)
        if self._path_alone():            # the next step is the path alone
            p.copy_steps += 1


register(Family("eagle+pld", "EAGLE-2's tree plus prompt lookup's path", EAGLE_OPTIONS,
                partial(build_eagle, kind=EagleLookupProposer), eagle_names(True),
                "eagle+pld, eagle2+pld, eagle2+VOCAB+pld", draft_vocab=True))
