"""Draft trees: the one tree type every proposer, loop and backend uses, and EAGLE-2's dynamic
tree.

A `Tree` is a handful of tensors on the model's device: tokens, parents and depths, flattened
with the root (the last sampled token, not yet in the target's cache) at row 0, -1 as its
parent and every other node's parent at a smaller row. Graph steps (graph_step.py) build,
graft and verify it as device work of fixed shapes that a CUDA graph holds. What the host
reads (a step's checks and verdict, the live rule's choice, each node's children in row order,
which sampling verification tries in turn) comes from its rows as lists (`TreeRows`): kept
beside the tensors where the tree was built on the host, else read back once when first asked
for. A fixed-shape tree may carry rows that hold no
draft (a lookup path's padding, or the part of it the tree already has): `valid` marks the
others, and the eager loop drops them (`Tree.compact`), where padding would only cost rows.

EAGLE-2's tree (`TreeBuilder`): node values are log-probabilities summed along the path (log
of EAGLE-2's value, the product of draft confidences). The root's top-k children form depth 1;
at each expansion step the top-k nodes of the newest layer (by value) are expanded into their
top-k children each; finally all drafted nodes are reranked by value and the best
`total_tokens` kept, ties going to shallower nodes so that the kept set stays a connected tree.
`flatten` keeps the same nodes from a tree drafted as device work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..runtime.kv_cache import ancestor_mask
from ..runtime.step_rows import depths_of


@dataclass(eq=False)
class Tree:
    tokens: torch.Tensor    # (rows,) root first
    parents: torch.Tensor   # (rows,) parent row, -1 for the root
    depths: torch.Tensor    # (rows,) 0 for the root
    max_depth: int          # a bound on the depths, known to the host (the tree's shape fixes it)
    mask: torch.Tensor | None = None    # (rows, rows) ancestor mask; built when first asked for
    valid: torch.Tensor | None = None   # (rows,) bool: rows that hold a draft (None: every row)
    # Each node's place in the value ranking (0 = most valuable draft; -1 for the root and for
    # grafted rows): the tree of the best m nodes is exactly the nodes ranked below m (autotune).
    ranks: torch.Tensor | None = None
    # Each node's value (float64, host): the log of the product of the drafter's confidences
    # along its path, 0 for the root (EAGLE-2's trees; the live sizing rule reads it).
    values: torch.Tensor | None = None
    # The same rows as lists, made when first asked for (`rows`); not copied by `replace`, whose
    # changed tensors it would not follow.
    host: "TreeRows | None" = field(default=None, init=False, repr=False)

    @property
    def size(self) -> int:
        """Drafted rows, the root excluded."""
        return self.tokens.numel() - 1

    @classmethod
    def from_parents(cls, tokens: list[int] | torch.Tensor, parents: list[int] | torch.Tensor,
                     ranks: list[int] | None = None, values: list[float] | torch.Tensor | None = None,
                     device: torch.device | None = None) -> "Tree":
        """A tree built on the host (the native drafter's): tokens and parents (-1 for the root,
        each node's parent before it), the drafts' value ranks, the nodes' values."""
        tokens, parents = _listed(tokens), _listed(parents)
        return TreeRows(tokens, parents, depths_of(parents), [-1] + list(ranks) if ranks is not None else None,
                        _listed(values) if values is not None else None).tree(device)

    def rows(self) -> "TreeRows":
        """Its rows as host lists (read back once, in one transfer from a device, where it was
        not built from them)."""
        if self.host is None:
            fields = [self.tokens, self.parents, self.depths] + ([self.ranks] if self.ranks is not None else [])
            listed = torch.stack([f.to(self.tokens.device, torch.long) for f in fields]).tolist()
            self.host = TreeRows(*listed[:3], listed[3] if self.ranks is not None else None,
                                 self.values.tolist() if self.values is not None else None)
        return self.host

    def attention_mask(self) -> torch.Tensor:
        """(rows, rows) bool: row i sees row j iff j is i or one of its ancestors."""
        if self.mask is None:
            self.mask = ancestor_mask(self.parents, self.max_depth)
        return self.mask

    def positions(self, start: int) -> torch.Tensor:
        return self.depths + start

    @cached_property
    def children(self) -> list[list[int]]:
        """Each row's children, in row order (the drafter's most confident first), on the host."""
        parents = self.rows().parents
        children: list[list[int]] = [[] for _ in parents]
        for node in range(1, len(parents)):
            children[parents[node]].append(node)
        return children

    def path_to(self, node: int) -> list[int]:
        """The rows from the root to `node`."""
        path, parents = [], self.rows().parents
        while node != -1:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def leaf_paths(self) -> torch.Tensor:
        """Root-to-leaf paths, (leaves, max depth + 1), padded with -1."""
        paths = [self.path_to(leaf) for leaf, kids in enumerate(self.children) if not kids]
        width = max(map(len, paths))
        return torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.long)

    def compact(self) -> "Tree":
        """The tree without the rows that hold no draft (one read-back): what the eager loop
        verifies. A valid row's parent is valid, so the rows kept form a tree."""
        if self.valid is None:
            return self
        rows = self.valid.nonzero().squeeze(1)
        row_of = torch.full_like(self.parents, -1)
        row_of[rows] = torch.arange(rows.numel(), device=rows.device)
        parents = self.parents[rows]
        parents = torch.where(parents >= 0, row_of[parents.clamp_min(0)], parents)
        return Tree(self.tokens[rows], parents, self.depths[rows], self.max_depth,
                    ranks=self.ranks[rows] if self.ranks is not None else None,
                    values=self.values[rows.cpu()] if self.values is not None else None)

    def best(self, size: int) -> "Tree":
        """The tree of its `size` most valuable drafts (value rank < size): exactly the tree a
        drafter told to keep `size` nodes builds (a node's ancestors rank before it), in the
        same row order. Built from its host rows (`rows`); needs ranks."""
        if size >= self.size:
            return self
        return self.rows().best(size).tree(self.tokens.device)


@dataclass(eq=False)
class TreeRows:
    """A tree's rows on the host, as lists (`Tree`'s fields, row for row): what a step's host
    work reads (the live rule's choice, greedy verification's children, the path accepted), kept
    beside the tensors so that it reads none of them back."""
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    ranks: list[int] | None = None
    values: list[float] | None = None

    def best(self, size: int) -> "TreeRows":
        """The rows of its `size` most valuable drafts (see `Tree.best`), in the same order."""
        ranks, parents, values = self.ranks, self.parents, self.values
        rows = [0] + [row for row in range(1, len(ranks)) if ranks[row] < size]
        row_of = {row: i for i, row in enumerate(rows)}
        return TreeRows([self.tokens[row] for row in rows], [-1] + [row_of[parents[row]] for row in rows[1:]],
                        [self.depths[row] for row in rows], [ranks[row] for row in rows],
                        None if values is None else [values[row] for row in rows])

    def tree(self, device: torch.device | None = None) -> Tree:
        """The tree of these rows, its tensors on `device` (values on the host)."""
        tree = Tree(torch.tensor(self.tokens, dtype=torch.long, device=device),
                    torch.tensor(self.parents, dtype=torch.long, device=device),
                    torch.tensor(self.depths, dtype=torch.long, device=device), max(self.depths),
                    ranks=None if self.ranks is None else torch.tensor(self.ranks, dtype=torch.long, device=device),
                    values=None if self.values is None else torch.tensor(self.values, dtype=torch.float64))
        tree.host = self
        return tree


def _listed(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


# A path's parents and depths by its rows and device, as tensors and as lists, shared by every
# chain of that length (a batch of plain decoding steps makes one a row a step): nothing writes
# into a tree's tensors or its rows' lists.
_PATH_SHAPES: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, list[int], list[int]]] = {}


def chain(root: int | torch.Tensor, tokens: list[int] | torch.Tensor, count: torch.Tensor | None = None,
          device: torch.device | None = None) -> Tree:
    """A single path after the root (prompt lookup's; no tokens: the root alone, plain
    decoding's step). For graph steps `tokens` is a device tensor (k,) of which the first
    `count` (0-dim) are drafts and the rest padding that verification rejects."""
    if count is None and isinstance(root, int) and isinstance(tokens, list):     # from the host
        device = torch.device("cpu") if device is None else torch.device(device)
        n = len(tokens) + 1
        shape = _PATH_SHAPES.get((n, device))
        if shape is None:
            depths = torch.arange(n, device=device)
            shape = _PATH_SHAPES[(n, device)] = (depths - 1, depths, list(range(-1, n - 1)), list(range(n)))
        parents, depths, parent_list, depth_list = shape
        tree = Tree(torch.tensor([root, *tokens], dtype=torch.long, device=device), parents, depths, n - 1,
                    ranks=parents)
        tree.host = TreeRows([root, *tokens], parent_list, depth_list, parent_list)
        return tree
    root = torch.as_tensor(root, dtype=torch.long, device=device).view(1)
    device = root.device
    tokens = torch.as_tensor(tokens, dtype=torch.long, device=device)
    n = tokens.numel() + 1
    depths = torch.arange(n, device=device)
    return Tree(torch.cat([root, tokens]), depths - 1, depths, n - 1,
                valid=depths <= count if count is not None else None, ranks=depths - 1)


def flatten(root: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor, parents: torch.Tensor,
            depths: torch.Tensor, keep: int, max_depth: int) -> Tree:
    """The `keep` most valuable of the drafted nodes (ties: shallower, then drafted earlier) as a
    tree in drafting order, as device work. parents: each node's parent node, -1 for the root's
    children; max_depth: the deepest depth drafted (host)."""
    order = torch.argsort(depths, stable=True)                        # ties of value: shallower,
    order = order[torch.argsort(-values[order], stable=True)]        # then drafted earlier
    kept = torch.sort(order[:keep]).values                           # parents come before children
    rank_of = torch.empty_like(values, dtype=torch.long)
    rank_of[order] = torch.arange(order.numel(), device=tokens.device)
    row_of = torch.zeros(tokens.numel() + 1, dtype=torch.long, device=tokens.device)
    row_of[kept + 1] = torch.arange(1, keep + 1, device=tokens.device)   # node j at row_of[j + 1]
    minus_one = torch.full((1,), -1, dtype=torch.long, device=tokens.device)
    tree_parents = torch.cat([minus_one, row_of[parents[kept] + 1]])   # the root's children: row 0
    return Tree(torch.cat([root.view(1), tokens[kept]]), tree_parents,
                torch.cat([torch.zeros_like(minus_one), depths[kept]]), max_depth,
                ranks=torch.cat([minus_one, rank_of[kept]]))


def graft(tree: Tree, chain_tokens: torch.Tensor, count: torch.Tensor) -> Tree:
    """`tree` with a path from the root grafted on (prompt lookup's, hybrid.py): `chain_tokens`
    (k,) of which the first `count` (0-dim) are drafts, as device work of fixed shapes. The path
    follows the tree's nodes while they carry its tokens and leaves it as new rows; all k rows
    are appended, and those the tree already holds, or past `count`, are invalid (`compact`
    drops them). A tree's siblings carry distinct tokens (a row's top k), so at most one node
    per depth lies on the path."""
    device = tree.tokens.device
    rows, k = tree.tokens.numel(), chain_tokens.numel()
    index = torch.arange(rows, device=device)
    up = tree.parents.clamp_min(0)                                  # the root its own parent
    # Nodes whose whole path from the root spells the path's first tokens.
    want = chain_tokens[(tree.depths - 1).clamp(0, k - 1)]
    on_path = ((tree.tokens == want) & (tree.depths >= 1)) | (index == 0)
    if tree.valid is not None:
        on_path = on_path & tree.valid
    for _ in range(tree.max_depth):
        on_path = on_path & on_path[up]
    # at_depth[d]: the tree's node at depth d on the path, -1 where it left the tree.
    slot = torch.where(on_path & (tree.depths <= k), tree.depths, torch.full_like(tree.depths, k + 1))
    at_depth = torch.full((k + 2,), -1, dtype=torch.long, device=device).scatter_(0, slot, index)
    held = at_depth[1:k + 1] >= 0                                  # path token i is a tree node
    steps = torch.arange(k, device=device)
    # A new row hangs from the tree's node one level up while the path was still on the tree,
    # else from the path's previous row.
    parents = torch.where(at_depth[:k] >= 0, at_depth[:k], rows + steps - 1)
    valid = ~held & (steps < count)
    tree_valid = tree.valid if tree.valid is not None else torch.ones(rows, dtype=torch.bool, device=device)
    ranks = tree.ranks if tree.ranks is not None else torch.full_like(tree.tokens, -1)
    return Tree(torch.cat([tree.tokens, chain_tokens]), torch.cat([tree.parents, parents]),
                torch.cat([tree.depths, steps + 1]), max(tree.max_depth, k), valid=torch.cat([tree_valid, valid]),
                ranks=torch.cat([ranks, torch.full_like(chain_tokens, -1)]),
                values=None if tree.values is None else      # a grafted row has no drafter's value
                torch.cat([tree.values, torch.full((k,), float("nan"), dtype=torch.float64)]))


# The largest trees drafting accepts (the CLI's and DraftConfig's bounds, the trees the fuzz
# tests cover): deeper or wider trees cost more to draft than any acceptance repays on a CPU,
# and the native drafter ranks at most 64 children a node (native.c's topk_rows).
MAX_DEPTH = 8
MAX_TOP_K = 64
MAX_TOTAL_TOKENS = 64


def tree_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """Drafted children's log-probabilities as a tree's values add them (native.c's
    tree_log_prob does the same): NaN (a head with NaN weights, as a checkpoint saved before
    its head was filled) counts as -inf and a rounding above 0 as 0, so that no value is NaN
    and none exceeds its parent's: the ranking's order and the kept tree's closure rest on it."""
    return torch.nan_to_num(log_probs, nan=float("-inf")).clamp(max=0.0)


class TreeBuilder:
    """Collects drafted nodes level by level, then reranks them into a Tree.

    Node ids are indices into the builder's flat lists; id 0 is the root.
    """

    def __init__(self, root_token: int, top_k: int, total_tokens: int):
        if top_k < 1 or total_tokens < 1:
            raise ValueError(f"top_k and total_tokens must be >= 1, got {top_k}, {total_tokens}")
        self.top_k = top_k
        self.total_tokens = total_tokens
        self.token = [root_token]
        self.parent = [-1]
        self.depth = [0]
        self.value = [0.0]        # log of the product of confidences along the path
        self.newest: list[int] = [0]

    def add_children(self, parents: list[int], tokens: torch.Tensor, log_probs: torch.Tensor) -> list[int]:
        """Attach children: row r of tokens/log_probs (k each) hangs under parents[r]."""
        tokens_l, log_probs_l = tokens.tolist(), tree_log_probs(log_probs).tolist()
        new = []
        for parent, row_tokens, row_lp in zip(parents, tokens_l, log_probs_l):
            base = self.value[parent]
            for token, lp in zip(row_tokens, row_lp):
                new.append(len(self.token))
                self.token.append(token)
                self.parent.append(parent)
                self.depth.append(self.depth[parent] + 1)
                self.value.append(base + lp)
        self.newest = new
        return new

    def frontier(self) -> list[int]:
        """The top_k nodes of the newest layer by value: the next to expand, less those that
        cannot reach the final tree."""
        # Ties go to the earlier drafted node, so a tree grown with a smaller total_tokens
        # expands the same nodes, in the same order, as the part of a larger one it keeps.
        chosen = sorted(self.newest, key=lambda i: (-self.value[i], i))[:self.top_k]
        if len(self.value) - 1 < self.total_tokens:
            return chosen
        # total_tokens nodes are valued at least the cutoff, and a child's value never exceeds
        # its parent's while build() ranks deeper nodes after shallower ones of equal value: the
        # descendants of a node valued at most the cutoff would all be dropped. Skipping them
        # leaves the built tree as it was and spares the drafter those rows.
        cutoff = sorted(self.value[1:], reverse=True)[self.total_tokens - 1]
        return [node for node in chosen if self.value[node] > cutoff]

    def cut_node(self) -> tuple[int, float] | None:
        """(depth, value) of the node ranked total_tokens-th, which a new node kept would push
        out (build()'s order); None while the tree holds no more than total_tokens nodes."""
        if len(self.value) - 1 < self.total_tokens:
            return None
        cut = self._ranked()[self.total_tokens - 1]
        return self.depth[cut], self.value[cut]

    def _ranked(self) -> list[int]:
        """The drafted nodes, most valuable first; on equal value the shallower node, then the
        earlier drafted. A child's value never exceeds its parent's, so every node's parent
        ranks before it: the first n are a tree."""
        return sorted(range(1, len(self.token)), key=lambda i: (-self.value[i], self.depth[i], i))

    def grow(self, levels: int, expand, pending, device: torch.device | None = None, stop=None) -> dict[int, int]:
        """Grow the tree level by level, at most `levels` times, as a drafter with its own KV
        cache does (EAGLE's drafter, a draft model): `expand(level, frontier, mask)` runs the
        frontier's nodes (mask: `frontier_mask`'s, over `pending()` slots before them) and
        returns each row's top children (tokens, log_probs). `stop` (live_tree.TreeStop, or
        None): a level expands only its frontier's first `stop.width(their depths, values,
        cut_node())` nodes, and none ends the tree; its `levels` and `rows` are set to the
        levels drafted and the rows they scored, the root's children counted.
        Returns the pending slot of every expanded node."""
        slot_of: dict[int, int] = {}
        if stop is not None:
            stop.levels, stop.rows = 1, 1       # the root's children, drafted before the tree grows
        for level in range(1, levels + 1):
            frontier = self.frontier()
            if frontier and stop is not None:
                frontier = frontier[:stop.width([self.depth[n] for n in frontier],
                                                [self.value[n] for n in frontier], self.cut_node())]
            if not frontier:
                break
            n_pending = pending()
            mask = self.frontier_mask(frontier, slot_of, n_pending, device)
            tokens, log_probs = expand(level, frontier, mask)
            for row, node in enumerate(frontier):
                slot_of[node] = n_pending + row
            self.add_children(frontier, tokens, log_probs)
            if stop is not None:
                stop.levels, stop.rows = level + 1, stop.rows + len(frontier)
        return slot_of

    def frontier_mask(self, frontier: list[int], slot_of: dict[int, int], pending: int,
                      device: torch.device | None = None) -> torch.Tensor:
        """(len(frontier), pending + len(frontier)) bool, for a drafter that grows the tree level
        by level in its own KV cache: each frontier node sees the pending slots of its expanded
        ancestors (`slot_of`; the root's is committed) and itself. Built on the host, moved once."""
        mask = torch.zeros(len(frontier), pending + len(frontier), dtype=torch.bool)
        for row, node in enumerate(frontier):
            mask[row, pending + row] = True
            ancestor = self.parent[node]
            while ancestor != 0:
                mask[row, slot_of[ancestor]] = True
                ancestor = self.parent[ancestor]
        return mask.to(device)

    def build(self, device: torch.device | None = None) -> Tree:
        """Rerank all drafted nodes, keep the best total_tokens, flatten depth by depth."""
        candidates = self._ranked()           # every kept node's parent kept too
        rank_of = {node: r for r, node in enumerate(candidates[: self.total_tokens])}
        by_depth: dict[int, list[int]] = {}
        for node in candidates[: self.total_tokens]:
            by_depth.setdefault(self.depth[node], []).append(node)
        order, flat_index = [0], {0: 0}
        for depth in sorted(by_depth):
            # Siblings stay together, in their parents' order, most confident first.
            level = sorted(by_depth[depth],
                           key=lambda i: (flat_index[self.parent[i]], -self.value[i], i))
            for node in level:
                flat_index[node] = len(order)
                order.append(node)
        self.flat_index = flat_index      # builder node -> its index in the tree (kept nodes)
        parents = [-1] + [flat_index[self.parent[i]] for i in order[1:]]
        depths = [self.depth[i] for i in order]
        ranks = [-1] + [rank_of[i] for i in order[1:]]
        return TreeRows([self.token[i] for i in order], parents, depths, ranks,
                        [self.value[i] for i in order]).tree(device)
