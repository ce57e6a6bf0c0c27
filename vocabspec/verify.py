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


HEAD_ROWS = 4


class TreeLogits:
    """The target's logits at tree nodes, computed as verification asks for them.

    Verification reads the root and the nodes it accepts, about tau of the tree's n + 1 rows,
    and the LM head is much of a forward's cost with a large vocabulary (Gemma's 262k rows are
    most of the model). Rows are scored in small batches along the likeliest path: a node, its
    first child (the drafter's most confident), that child's first child, and so on, up to
    `head_rows` rows, which cost about one row's pass over the head weights. The root's batch,
    filled up with the tree's other rows in order while it has room (a second pass would cost a
    whole one), is scored at once; a node outside every batch so far starts its own when reached. Rows go
    through the same `lm_head` as plain decoding's one-row steps, and on the native engine a
    row's bits do not depend on the batch, so a token gets exactly the logits it would get
    decoded alone.
    """

    def __init__(self, lm_head, hidden: torch.Tensor, tree: DraftTree, head_rows: int = HEAD_ROWS):
        self.lm_head = lm_head
        self.hidden = hidden
        self.children = tree.children
        self.head_rows = max(1, head_rows)
        self.rows: dict[int, torch.Tensor] = {}
        self._score(0, fill=True)

    def _score(self, node: int, fill: bool = False) -> None:
        batch = [node]
        while len(batch) < self.head_rows and self.children[batch[-1]]:
            child = self.children[batch[-1]][0]
            if child in self.rows:
                break
            batch.append(child)
        if fill:
            chain = set(batch)
            batch += [i for i in range(len(self.children)) if i not in chain][:self.head_rows - len(batch)]
        for index, row in zip(batch, self.lm_head(self.hidden[batch])):
            self.rows[index] = row

    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            self._score(node)
        return self.rows[node]


@dataclass
class Verdict:
    path: list[int]      # accepted tree indices, root (index 0) first
    next_token: int      # the target's token after the path (the bonus token)


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
