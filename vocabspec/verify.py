"""Verification: which drafted tokens the target accepts, and the token it adds after them.

Greedy: follow the tree while a child carries the target's argmax; the bonus token is the
argmax at the last accepted node. The output is the target's own greedy sequence.

Sampling: the drafts are deterministic (top-k of the drafter), so at each node the children
are tried in draft order; child x is accepted with probability p(x) under the processed
target distribution p; on rejection p(x) is set to 0 and p renormalised before the next
child; when every child is rejected, or the node is a leaf, the next token is drawn from
what remains of p. Each emitted token is thereby distributed exactly as p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, greedy_token, target_probs
from .tree import DraftTree


@dataclass
class Verdict:
    path: list[int]      # accepted tree indices, root (index 0) first
    next_token: int      # the target's token after the path (the bonus token)

    @property
    def accept_length(self) -> int:
        """Tokens this step adds to the output: the accepted drafts plus the bonus token."""
        return len(self.path)


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """logits: (n + 1, vocab), row i scoring the token after tree node i.

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


def verify_sampling(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator) -> Verdict:
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        probs = target_probs(logits[node:node + 1], params)[0]
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


def verify(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> Verdict:
    if params.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, params, generator)
