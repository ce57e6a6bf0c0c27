"""Verification: which drafted tokens the target accepts, and the token it adds after them.

Greedy: follow the tree while a child carries the target's argmax; the bonus token is the
argmax at the last accepted node. The output is the target's own greedy sequence.
`verify_greedy` does it as device work on fixed shapes (a node is accepted when its token is
its parent's argmax and its parent is accepted), the one torch verifier of the eager loop and
of the captured graph steps alike; the native engine has its own one-call verifier.

Sampling: the drafts are deterministic (top-k of the drafter), so at each node the children
are tried in draft order; child x is accepted with probability p(x) under the processed
target distribution p; on rejection p(x) is set to 0 and p renormalised before the next
child; when every child is rejected, or the node is a leaf, the next token is drawn from
what remains of p. Each emitted token is thereby distributed exactly as p.

Sampling reads the target's logits only at the root and at the nodes it accepts, so
`TreeLogits` runs the LM head over those rows rather than over the whole tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, target_probs
from ..runtime.kv_cache import ancestor_mask
from ..runtime.backend import HEAD_ROWS
from .tree import Tree



class TreeLogits:
    """The target's logits at tree nodes, computed as sampling verification asks for them.

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

    def __init__(self, lm_head, hidden: torch.Tensor, tree: Tree, head_rows: int = HEAD_ROWS):
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


def verify_greedy(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, logits: torch.Tensor,
                  max_depth: int | None = None, valid: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a flattened tree as device work: (path, [length, bonus]).

    tokens, parents (the root's -1 or itself), depths: (rows,); logits: (rows, vocab), row i
    the scores of the token after node i, or each row's argmax (rows,) taken already
    (Backend.greedy_tokens); max_depth: a bound on the tree's depth (default rows - 1);
    valid: rows that hold a draft (a padded path's padding is rejected); mask: the tree's
    ancestor mask (`ancestor_mask`; built here where not given). path holds
    the accepted rows by depth, padded to max_depth + 1; length counts the root and the
    accepted drafts; bonus is the argmax at the deepest accepted node (torch.argmax: the first
    index on ties, as plain decoding's `greedy_token`). No read-back, so a CUDA graph holds it."""
    rows = tokens.numel()
    depth = rows - 1 if max_depth is None else max_depth
    if mask is None:
        mask = ancestor_mask(parents, depth)
    best = logits.argmax(-1) if logits.dim() == 2 else logits
    ok = tokens == best[parents.clamp_min(0)]
    if valid is not None:
        ok = ok & valid
    ok[0].fill_(True)          # a fill, not `ok[0] = True`: that copies a host tensor in, which no graph holds
    ok = ~(mask & ~ok).any(-1)          # accepted: the node and every ancestor carry the argmax
    slots = depth + 2                                                  # the last slot collects rejects
    index = torch.where(ok, depths, torch.full_like(depths, slots - 1))
    path = torch.zeros(slots, dtype=torch.long, device=logits.device).scatter_(
        0, index, torch.arange(rows, device=logits.device))
    length = ok.sum()
    bonus = best.gather(0, path.gather(0, (length - 1).view(1)))
    return path[:-1], torch.cat([length.view(1), bonus])


def greedy_verdict(tree: Tree, logits: torch.Tensor) -> Verdict:
    """`verify_greedy` over a host tree and all its rows' logits, as a Verdict (one read-back)."""
    path, length_bonus = verify_greedy(tree.tokens, tree.parents, tree.depths, logits, tree.max_depth,
                                       tree.valid, tree.mask)
    length, bonus = length_bonus.tolist()
    return Verdict(path[:length].tolist(), bonus)


def verify_sampling(tree: Tree, logits, params: SamplingParams,
                    generator: torch.Generator) -> Verdict:
    tokens = tree.rows().tokens
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

