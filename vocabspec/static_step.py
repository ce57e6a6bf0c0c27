"""A greedy decoding step with static shapes that stays on the device: one read-back a step.

On a GPU every `.item()`, `.tolist()` or `bool(tensor)` waits for the device, and EAGLE-2's tree
built in Python reads values back at every draft level. Here the tree, its attention mask,
verification and the accepted path are tensor operations of fixed shapes (the tree has
`total_tokens + 1` rows for a given size; each draft level runs `top_k` rows), and the step
reads back once: the accept length, the bonus token and the accepted tokens.

EAGLE-2's tree is grown without the dynamic tree's frontier pruning (which skips nodes whose
descendants cannot make the final tree: it changes no kept node) and flattened in the order
nodes were drafted, so it is the same set of nodes as `tree.TreeBuilder` keeps, in another
order. Verification follows the target's argmax from the root: a node is accepted when its
token is its parent's argmax and its parent is accepted; the next token is the argmax at the
deepest accepted node. That is `verify.verify_greedy`, as tensors: the output is plain
decoding's, bit for bit where the forward is (the native engine), float32 ties apart on
torch's kernels. Sampling uses the general loop (generate.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class StaticTree:
    tokens: torch.Tensor     # (rows,) root first, nodes in drafting order
    parents: torch.Tensor    # (rows,) parent row; the root's is itself (0)
    depths: torch.Tensor     # (rows,)
    mask: torch.Tensor       # (rows, rows) bool: row i sees row j iff j is i or an ancestor
    max_depth: int           # deepest node's depth (host: the tree's shape fixes it)

    @property
    def size(self) -> int:
        return self.tokens.numel() - 1


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """(rows, rows): each row's ancestors and itself, by gathering parents' rows max_depth times."""
    rows = parents.numel()
    mask = torch.eye(rows, dtype=torch.bool, device=parents.device)
    for _ in range(max_depth):
        mask = mask | mask[parents]
    return mask


def chain(root: torch.Tensor, tokens: list[int]) -> StaticTree:
    """A single path (prompt lookup): host tokens copied to the device, no read-back."""
    device = root.device
    n = len(tokens) + 1
    parents = torch.arange(-1, n - 1, device=device).clamp_min(0)
    depths = torch.arange(n, device=device)
    ids = torch.cat([root.view(1), torch.tensor(tokens, dtype=torch.long, device=device)])
    return StaticTree(ids, parents, depths, torch.ones(n, n, dtype=torch.bool, device=device).tril(), n - 1)


def flatten(root: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor, parents: torch.Tensor,
            depths: torch.Tensor, keep: int, max_depth: int) -> StaticTree:
    """The `keep` most valuable of the drafted nodes (ties: shallower, then drafted earlier) as a
    tree in drafting order. parents: each node's parent node, -1 for the root's children;
    max_depth: the deepest depth drafted (host)."""
    order = torch.argsort(depths, stable=True)                        # ties of value: shallower,
    order = order[torch.argsort(-values[order], stable=True)]        # then drafted earlier
    kept = torch.sort(order[:keep]).values                           # parents come before children
    row_of = torch.zeros(tokens.numel() + 1, dtype=torch.long, device=tokens.device)
    row_of[kept + 1] = torch.arange(1, keep + 1, device=tokens.device)   # node j at row_of[j + 1]
    parent_rows = row_of[parents[kept] + 1]                          # -1 (the root) -> row 0
    zero = torch.zeros(1, dtype=torch.long, device=tokens.device)
    tree_parents = torch.cat([zero, parent_rows])
    tree_depths = torch.cat([zero, depths[kept]])
    return StaticTree(torch.cat([root.view(1), tokens[kept]]), tree_parents, tree_depths,
                      ancestor_mask(tree_parents, max_depth), max_depth)


def verify_greedy(tree: StaticTree, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(path, length): rows of the accepted path by depth (padded, max_depth + 1 of them) and how
    many there are (the root and the accepted drafts), then the bonus token, as device tensors."""
    best = logits.argmax(-1)
    ok = tree.tokens == best[tree.parents]
    ok[0] = True
    for _ in range(tree.max_depth):
        ok = ok & ok[tree.parents]
    depth_slots = tree.max_depth + 2                                  # the last slot collects rejects
    index = torch.where(ok, tree.depths, torch.full_like(tree.depths, depth_slots - 1))
    rows = torch.arange(tree.tokens.numel(), device=logits.device)
    path = torch.zeros(depth_slots, dtype=torch.long, device=logits.device).scatter_(0, index, rows)
    length = ok.sum()
    bonus = best.gather(0, path.gather(0, (length - 1).view(1)))
    return path[:-1], torch.cat([length.view(1), bonus])


def read_back(tree: StaticTree, path: torch.Tensor, length_bonus: torch.Tensor) -> tuple[list[int], int]:
    """The step's only read-back: (accepted tokens, root first; the bonus token)."""
    values = torch.cat([length_bonus, tree.tokens[path]]).tolist()
    length, bonus = values[0], values[1]
    return values[2:2 + length], bonus


@contextlib.contextmanager
def count_read_backs():
    """Counts every call that hands a tensor's value to the host (tensor methods and
    torch.equal): the tests and the GPU check hold a step to one."""
    counts = {"n": 0}
    patched = {}
    names = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")
    for name in names:
        original = getattr(torch.Tensor, name)
        patched[name] = original

        def wrapper(self, *a, _original=original, **k):
            counts["n"] += 1
            return _original(self, *a, **k)
        setattr(torch.Tensor, name, wrapper)
    equal = torch.equal

    def counted_equal(*a, **k):
        counts["n"] += 1
        return equal(*a, **k)
    torch.equal = counted_equal
    try:
        yield counts
    finally:
        for name, original in patched.items():
            setattr(torch.Tensor, name, original)
        torch.equal = equal
