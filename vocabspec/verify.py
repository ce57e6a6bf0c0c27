"""Verification: which drafted tokens the target accepts, and the token it adds after them.

Greedy: follow the tree while a child carries the target's argmax; the bonus token is the
argmax at the last accepted node. The output is the target's own greedy sequence.

Sampling: the drafts are deterministic (top-k of the drafter), so at each node the children
are tried in draft order; child x is accepted with probability p(x) under the processed
target distribution p; on rejection p(x) is set to 0 and p renormalised before the next
child; when every child is rejected, or the node is a leaf, the next token is drawn from
what remains of p. Each emitted token is thereby distributed exactly as p.

Either way verification reads the target's logits only at the root and at the nodes it
accepts, so `TreeLogits` runs the LM head over those rows rather than over the whole tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, greedy_token, target_probs
from .tree import DraftTree


HEAD_ROWS = 16


class TreeLogits:
    """The target's logits at tree nodes, computed as verification asks for them.

    Verification reads about tau of the tree's n + 1 rows, and the LM head over all of them
    is much of a large tree's forward (Gemma's 262k-row head is most of the model). The head
    runs at once over the root and the drafted nodes most likely to be accepted (the best
    `HEAD_ROWS` - 1 by value, EAGLE-2's product of draft confidences; every row of a tree that
    small, and nodes grafted from prompt lookup, which carry no value), a batch that costs
    about one row's pass over the head weights; a node outside it is scored when reached.
    Rows go through the same `lm_head` as vanilla decoding's one-row steps, so on the packed
    CPU path (each row's bits independent of the row count) a token gets the logits it would
    get decoded alone.
    """

    def __init__(self, lm_head, hidden: torch.Tensor, tree: DraftTree, head_rows: int = HEAD_ROWS):
        self.lm_head = lm_head
        self.hidden = hidden
        self.rows: dict[int, torch.Tensor] = {}
        nodes = range(hidden.shape[0])
        if hidden.shape[0] > head_rows and tree.ranks is not None:
            nodes = [i for i in nodes if tree.ranks[i] < head_rows - 1]
        self._score(list(nodes))

    def _score(self, nodes: list[int]) -> None:
        for node, row in zip(nodes, self.lm_head(self.hidden[nodes])):
            self.rows[node] = row

    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            self._score([node])
        return self.rows[node]


@dataclass
class Verdict:
    path: list[int]      # accepted tree indices, root (index 0) first
    next_token: int      # the target's token after the path (the bonus token)

    @property
    def accept_length(self) -> int:
        """Tokens this step adds to the output: the accepted drafts plus the bonus token."""
        return len(self.path)


def verify_greedy(tree: DraftTree, logits) -> Verdict:
    """logits[i]: (vocab,) scores of the token after tree node i (a tensor, or TreeLogits).

    Only the rows on the accepted path are reduced (a few of a tree's rows; each costs a pass
    over the vocabulary), with the same argmax as vanilla decoding (`greedy_token`)."""
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        best = greedy_token(logits[node])
        match = next((c for c in tree.children[node] if tokens[c] == best), None)
        if match is None:
            return Verdict(path, best)
        node = match
        path.append(node)


def verify_sampling(tree: DraftTree, logits, params: SamplingParams,
                    generator: torch.Generator) -> Verdict:
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        probs = target_probs(logits[node][None], params)[0]
        accepted = None
        for child in tree.children[node]:
            token = tokens[child]
            p = float(probs[token])
            if p > 0 and float(torch.rand((), generator=generator, device=probs.device)) < p:
                accepted = child
                break
            probs[token] = 0.0
            total = float(probs.sum())
            if total <= 0:
                break
            probs /= total
        if accepted is None:
            next_token = int(torch.multinomial(probs, 1, generator=generator))
            return Verdict(path, next_token)
        node = accepted
        path.append(node)


def verify(tree: DraftTree, logits, params: SamplingParams,
           generator: torch.Generator | None) -> Verdict:
    if params.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, params, generator)
