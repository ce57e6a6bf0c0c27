"""Draft trees: EAGLE-2's context-aware dynamic tree, and the masks the target needs.

Node values are log-probabilities summed along the path (log of EAGLE-2's value, the product
of draft confidences). Building follows EAGLE-2: the root's top-k children form depth 1; at
each expansion step the top-k nodes of the newest layer (by value) are expanded into their
top-k children each; finally all drafted nodes are reranked by value and the best
`total_tokens` kept, ties going to shallower nodes so that the kept set stays a connected tree.

A `DraftTree` is flattened depth by depth with the root (the last sampled token, not yet in
the target's cache) at index 0; node i's parent index is smaller than i. `graft_chain` adds a
path from another source (prompt lookup) after those nodes, sharing the prefix already there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.kv_cache import ancestor_mask


@dataclass
class DraftTree:
    tokens: torch.Tensor    # (n + 1,) root first
    parents: torch.Tensor   # (n + 1,) parent index, -1 for the root
    depths: torch.Tensor    # (n + 1,) 0 for the root
    # Each node's children in draft order (most confident first): verification tries them so.
    children: list[list[int]]
    # Each node's place in the value ranking (0 = most valuable draft; -1 for the root): the
    # tree of the best m nodes is exactly the nodes ranked below m (autotune uses this).
    ranks: list[int] | None = None

    @property
    def size(self) -> int:
        """Drafted tokens, the root excluded."""
        return self.tokens.numel() - 1

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor, ranks: list[int] | None = None) -> "DraftTree":
        """A flattened tree from its tokens and parents (-1 for the root; each node's parent
        before it), children in index order."""
        parent_list = parents.tolist()
        depths, children = [0] * len(parent_list), [[] for _ in parent_list]
        for node in range(1, len(parent_list)):
            depths[node] = depths[parent_list[node]] + 1
            children[parent_list[node]].append(node)
        return cls(tokens=tokens, parents=parents,
                   depths=torch.tensor(depths, dtype=torch.long, device=tokens.device),
                   children=children, ranks=[-1] + list(ranks) if ranks is not None else None)

    def attention_mask(self) -> torch.Tensor:
        """(n + 1, n + 1) bool: node i sees node j iff j is i or one of its ancestors."""
        return ancestor_mask(self.parents)

    def positions(self, start: int) -> torch.Tensor:
        return self.depths + start

    def path_to(self, node: int) -> list[int]:
        path = []
        parents = self.parents.tolist()
        while node != -1:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def leaf_paths(self) -> torch.Tensor:
        """Root-to-leaf retrieval paths, (leaves, max_depth + 1), padded with -1."""
        leaves = [i for i, kids in enumerate(self.children) if not kids]
        paths = [self.path_to(leaf) for leaf in leaves]
        width = max(len(p) for p in paths)
        return torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.long)




def chain_tree(root: int, tokens: list[int], device: torch.device | None = None) -> DraftTree:
    """A single path (prompt lookup, or no draft at all)."""
    n = len(tokens) + 1
    return DraftTree(
        tokens=torch.tensor([root] + list(tokens), dtype=torch.long, device=device),
        parents=torch.arange(-1, n - 1, dtype=torch.long, device=device),
        depths=torch.arange(n, dtype=torch.long, device=device),
        children=[[i + 1] for i in range(n - 1)] + [[]],
        ranks=list(range(-1, n - 1)),
    )


def graft_chain(tree: DraftTree, chain: list[int]) -> tuple[DraftTree, int]:
    """The tree with `chain` as a path from the root: existing nodes are followed while they
    carry the chain's tokens, the rest is appended (ranked -1: outside the value ranking).
    Returns the tree and how many nodes were added. Children stay distinct per node, which
    exact sampling verification needs."""
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    children = [list(kids) for kids in tree.children]
    ranks = list(tree.ranks) if tree.ranks is not None else [-1] * len(tokens)
    node, added = 0, 0
    for token in chain:
        match = next((c for c in children[node] if tokens[c] == token), None)
        if match is None:
            match = len(tokens)
            tokens.append(token)
            parents.append(node)
            depths.append(depths[node] + 1)
            children.append([])
            ranks.append(-1)
            children[node].append(match)
            added += 1
        node = match
    if not added:
        return tree, 0
    device = tree.tokens.device
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                     parents=torch.tensor(parents, dtype=torch.long, device=device),
                     depths=torch.tensor(depths, dtype=torch.long, device=device),
                     children=children, ranks=ranks), added


class TreeBuilder:
    """Collects drafted nodes level by level, then reranks them into a DraftTree.

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
        tokens_l, log_probs_l = tokens.tolist(), log_probs.tolist()
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

    def grow(self, levels: int, expand, pending, device: torch.device | None = None) -> dict[int, int]:
        """Grow the tree level by level, at most `levels` times, as a drafter with its own KV
        cache does (EAGLE's drafter, a draft model): `expand(level, frontier, mask)` runs the
        frontier's nodes (mask: `frontier_mask`'s, over `pending()` slots before them) and
        returns each row's top children (tokens, log_probs). Returns the pending slot of every
        expanded node."""
        slot_of: dict[int, int] = {}
        for level in range(1, levels + 1):
            frontier = self.frontier()
            if not frontier:
                break
            n_pending = pending()
            mask = self.frontier_mask(frontier, slot_of, n_pending, device)
            tokens, log_probs = expand(level, frontier, mask)
            for row, node in enumerate(frontier):
                slot_of[node] = n_pending + row
            self.add_children(frontier, tokens, log_probs)
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

    def build(self, device: torch.device | None = None) -> DraftTree:
        """Rerank all drafted nodes, keep the best total_tokens, flatten depth by depth."""
        candidates = list(range(1, len(self.token)))
        # Higher value first; on equal value the shallower node, then the earlier drafted. A
        # child's value never exceeds its parent's, so every kept node's parent is kept too.
        candidates.sort(key=lambda i: (-self.value[i], self.depth[i], i))
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
        children: list[list[int]] = [[] for _ in order]
        for idx in range(1, len(order)):
            children[parents[idx]].append(idx)
        return DraftTree(
            tokens=torch.tensor([self.token[i] for i in order], dtype=torch.long, device=device),
            parents=torch.tensor(parents, dtype=torch.long, device=device),
            depths=torch.tensor([self.depth[i] for i in order], dtype=torch.long, device=device),
            children=children,
            ranks=[-1] + [rank_of[i] for i in order[1:]],
        )
