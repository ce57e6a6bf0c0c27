"""EAGLE-2 with prompt lookup: the drafter's dynamic tree plus, when the context's last n-gram
occurred before, what followed it, grafted on as one more path from the root.

The two drafts fail in different places: the one-layer drafter guesses fluent text but rarely
a long verbatim copy, while prompt lookup is right exactly when the answer repeats its prompt
or itself (summaries, retrieval answers, code edits) and silent otherwise. Verification is
unchanged and needs nothing from the drafter (greedy follows the target's argmax; sampling
tries each node's children as deterministic candidates), so the union of both drafts stays
lossless. The grafted path costs up to `num_draft` more tokens in the target's forward, and
only where it leaves the drafter's tree.
"""

from __future__ import annotations

import time

from .drafter import EagleProposer
from .pld import PromptLookupProposer
from .tree import DraftTree, graft_chain


class EagleLookupProposer(EagleProposer):
    def __init__(self, *args, lookup: PromptLookupProposer | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lookup = lookup or PromptLookupProposer(device=self.target.device)
        self.max_tree_tokens = self.total_tokens + self.lookup.num_draft
        self.grafted = 0        # nodes added by prompt lookup, over all steps

    def reset(self, prompt_ids, prompt_hidden, first_token) -> None:
        super().reset(prompt_ids, prompt_hidden, first_token)
        self.lookup.reset(prompt_ids, prompt_hidden, first_token)

    def observe(self, accepted, hidden, next_token) -> None:
        super().observe(accepted, hidden, next_token)
        self.lookup.observe(accepted, hidden, next_token)

    def propose(self, root_token: int) -> DraftTree:
        tree = super().propose(root_token)
        start = time.perf_counter()
        tree, added = graft_chain(tree, self.lookup.lookup(self.lookup.context))
        self.grafted += added
        spent = time.perf_counter() - start
        self.timings["lookup"] = self.timings.get("lookup", 0.0) + spent
        self.timings["total"] += spent
        return tree

    def time_breakdown(self) -> dict[str, float]:
        parts = super().time_breakdown()
        parts["lookup"] = self.timings.get("lookup", 0.0)
        parts["tree"] = max(0.0, parts["tree"] - parts["lookup"])
        return parts
