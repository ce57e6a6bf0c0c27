"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the context's
last n-gram. No model, no training; it shares the tree and verification code with EAGLE.

The draft's length adapts: after a step that accepted the whole draft it doubles (up to
`num_draft`), otherwise it becomes one more than the tokens accepted. A verification row
costs a share of a forward on a CPU, so a long draft that is cut early is paid for; while
the answer copies its prompt the draft grows back in two or three steps."""

from __future__ import annotations

import time

import torch

from ..config import Family, bench_names, register
from ..proposer import Proposer, GraphDrafting
from ..tree import Tree, chain


def followed(path: list[int], accepted: list[int]) -> int:
    """How many of a drafted `path`'s tokens a step accepted (`accepted`: the root first)."""
    return next((i for i, (drafted, token) in enumerate(zip(path, accepted[1:])) if drafted != token),
                min(len(path), len(accepted) - 1))


class PromptLookupProposer(Proposer):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_draft: int = 10,
                 device: torch.device | str = "cpu"):
        if not 1 <= min_ngram <= max_ngram or num_draft < 1:
            raise ValueError("need 1 <= min_ngram <= max_ngram and num_draft >= 1")
        self.max_ngram, self.min_ngram, self.num_draft = max_ngram, min_ngram, num_draft
        self.max_tree_tokens = num_draft
        self.taps: tuple[int, ...] = ()
        self.tree_shape = None
        self.timing_sync = False       # nothing to wait for
        self.seconds = 0.0
        self.device = torch.device(device)
        self.context: list[int] = []
        self.length = num_draft        # the next draft's length (see the module docstring)
        self.drafted: list[int] = []     # the last draft (a hybrid grafts it)
        # Each n-gram's latest start among those that end before the context's last token (so
        # a match has a continuation); n-grams ending at or before _indexed are in it.
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed = 0
        self._graphed = False
        self.staged = self.staged_count = None     # graph steps' staged path (k,), its drafts (0-dim)

    def reset(self, prompt_ids, prompt_hidden, first_token) -> None:
        self.context = list(prompt_ids) + [first_token]
        self.length = self.num_draft
        self.drafted = []
        self._latest, self._indexed = {}, 0
        if self._graphed:
            self._stage()

    def reads_rows(self) -> bool:
        return False

    def observe(self, accepted, hidden, next_token) -> None:
        self.context.extend(accepted[1:] + [next_token])
        if self.drafted:
            # In a hybrid tree the accepted path may leave the lookup's.
            taken = followed(self.drafted, accepted)
            self.length = min(self.num_draft, 2 * self.length) if taken == len(self.drafted) \
                else taken + 1
        self.drafted = []

    def draft(self) -> list[int]:
        """The next draft: the lookup's continuation at the adaptive length (see the module
        docstring), remembered for `observe`."""
        self.drafted = self.lookup()[:self.length]
        return self.drafted

    def next_tree_tokens(self) -> int:
        """The tokens the next proposal will hold (the lookup is cheap: a batch asks before
        choosing who drafts)."""
        return len(self.lookup()[:self.length])

    def propose(self, root_token: int) -> Tree:
        start = time.perf_counter()
        tree = chain(root_token, self.draft(), device=self.device)
        self.seconds += time.perf_counter() - start
        return tree

    # Graph steps (graph_step.GraphDecoder): the lookup runs on the host between steps and
    # its path goes to a device buffer of num_draft tokens, padded; the step reads the buffer.
    graphs = True

    def graph_form(self, max_len: int | None) -> "LookupGraphDrafting | None":
        if max_len is not None and self.staged is None:
            self.staged = torch.zeros(self.num_draft, dtype=torch.long, device=self.device)
            self.staged_count = torch.zeros((), dtype=torch.long, device=self.device)
        self._graphed = max_len is not None
        return LookupGraphDrafting(self) if self._graphed else None

    def _stage(self) -> None:
        start = time.perf_counter()
        drafted = self.draft()
        self.staged.copy_(torch.tensor(drafted + [0] * (self.num_draft - len(drafted))))
        self.staged_count.fill_(len(drafted))
        self.seconds += time.perf_counter() - start

    def time_breakdown(self) -> dict[str, float]:
        return {"lookup": self.seconds}

    def reset_timings(self) -> None:
        self.seconds = 0.0

    def draft_parameters(self) -> int:
        return 0

    def lookup(self) -> list[int]:
        """What followed the latest earlier occurrence of the context's last n-gram, longest n
        first (up to num_draft tokens; [] if none occurred)."""
        context = self.context
        last = len(context) - 1       # n-grams ending before the last token, by their end
        for end in range(self._indexed + 1, last + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._latest[tuple(context[end - n:end])] = end - n
        self._indexed = max(self._indexed, last)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(context[-n:]))
            if start is not None:
                return context[start + n:start + n + self.num_draft]
        return []


class LookupGraphDrafting(GraphDrafting):
    """Prompt lookup in graph steps: the path staged on the device between steps (padded to
    num_draft tokens) as a chain; the next path is staged after each step's read-back."""

    def __init__(self, proposer: PromptLookupProposer):
        self.proposer = proposer

    @property
    def rows(self) -> int:
        return self.proposer.num_draft + 1

    def propose(self, root: torch.Tensor) -> Tree:
        return chain(root, self.proposer.staged, self.proposer.staged_count)

    def after(self, accepted, next_token, length) -> None:
        self.proposer.observe(accepted, None, next_token)
        self.proposer._stage()


def _build(model, config, model_name, tokenizer=None, log=None):
    return PromptLookupProposer(device=model.device)


register(Family("pld", "prompt lookup", frozenset(), _build, bench_names("pld"), "pld"))
