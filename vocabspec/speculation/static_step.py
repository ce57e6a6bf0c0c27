"""Greedy decoding steps that a CUDA graph can capture: fixed shapes, device tensors only.

On a GPU every `.item()`, `.tolist()` or `bool(tensor)` waits for the device, and a forward
that slices its KV cache by host-side lengths cannot be captured. Here a whole greedy step is
one function of fixed-shape device tensors (`StaticDecoder`): the draft tree (EAGLE-2's,
Medusa's, prompt lookup's path padded to its longest, EAGLE-2's with that path grafted on, or
the root alone), the target's
forward over a `DeviceKVCache` (slots written at device positions, attention over every slot
under a mask built on the device), verification, keeping the accepted path in both caches,
and the drafter's read of the accepted tokens. Its shapes depend only on the tree's size, so
on CUDA it is captured once per (tree size, drafting) as a CUDA graph and replayed; elsewhere
it runs eagerly, the same code. After each step the host reads back one small tensor: the
accepted tokens, the bonus token and the accepted nodes' value ranks.

EAGLE-2's tree is grown without the dynamic tree's frontier pruning (which skips nodes whose
descendants cannot make the final tree: it changes no kept node) and flattened in the order
nodes were drafted, so it is the same set of nodes as `tree.TreeBuilder` keeps, in another
order. Verification follows the target's argmax from the root: a node is accepted when its
token is its parent's argmax and its parent is accepted; the next token is the argmax at the
deepest accepted node (`verify.verify_greedy`, the eager steps' verifier too): plain decoding's output,
float32 ties apart on torch's kernels (not row-invariant). Sampling takes the eager steps
(generate.py), as does the native CPU engine, which keeps its own cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from ..engine.kv_cache import DeviceKVCache, ancestor_mask
from .verify import verify_greedy

log = logging.getLogger(__name__)


@dataclass
class StaticTree:
    tokens: torch.Tensor     # (rows,) root first, nodes in drafting order
    parents: torch.Tensor    # (rows,) parent row; the root's is itself (0)
    depths: torch.Tensor     # (rows,)
    mask: torch.Tensor       # (rows, rows) bool: row i sees row j iff j is i or an ancestor
    max_depth: int           # deepest node's depth (host: the tree's shape fixes it)
    valid: torch.Tensor | None = None   # (rows,) bool: rows that hold a draft (a padded path)
    ranks: torch.Tensor | None = None   # (rows,) each node's value rank (-1: the root; DraftTree.ranks)

    @property
    def size(self) -> int:
        return self.tokens.numel() - 1


def chain(root: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor) -> StaticTree:
    """A single path (prompt lookup) of fixed length: `tokens` (k,) on the device, of which the
    first `count` (0-dim) are drafts and the rest padding that verification rejects."""
    device = root.device
    n = tokens.numel() + 1
    parents = torch.arange(-1, n - 1, device=device).clamp_min(0)
    depths = torch.arange(n, device=device)
    ids = torch.cat([root.view(1), tokens])
    return StaticTree(ids, parents, depths, torch.ones(n, n, dtype=torch.bool, device=device).tril(),
                      n - 1, valid=depths <= count, ranks=depths - 1)


def root_only(root: torch.Tensor) -> StaticTree:
    """The root alone: plain decoding's step."""
    zero = torch.zeros(1, dtype=torch.long, device=root.device)
    return StaticTree(root.view(1), zero, zero, torch.ones(1, 1, dtype=torch.bool, device=root.device), 0)


def flatten(root: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor, parents: torch.Tensor,
            depths: torch.Tensor, keep: int, max_depth: int) -> StaticTree:
    """The `keep` most valuable of the drafted nodes (ties: shallower, then drafted earlier) as a
    tree in drafting order. parents: each node's parent node, -1 for the root's children;
    max_depth: the deepest depth drafted (host)."""
    order = torch.argsort(depths, stable=True)                        # ties of value: shallower,
    order = order[torch.argsort(-values[order], stable=True)]        # then drafted earlier
    kept = torch.sort(order[:keep]).values                           # parents come before children
    rank_of = torch.empty_like(values, dtype=torch.long)
    rank_of[order] = torch.arange(order.numel(), device=tokens.device)
    row_of = torch.zeros(tokens.numel() + 1, dtype=torch.long, device=tokens.device)
    row_of[kept + 1] = torch.arange(1, keep + 1, device=tokens.device)   # node j at row_of[j + 1]
    parent_rows = row_of[parents[kept] + 1]                          # -1 (the root) -> row 0
    zero = torch.zeros(1, dtype=torch.long, device=tokens.device)
    tree_parents = torch.cat([zero, parent_rows])
    tree_depths = torch.cat([zero, depths[kept]])
    minus_one = torch.full((1,), -1, dtype=torch.long, device=tokens.device)
    return StaticTree(torch.cat([root.view(1), tokens[kept]]), tree_parents, tree_depths,
                      ancestor_mask(tree_parents, max_depth), max_depth,
                      ranks=torch.cat([minus_one, rank_of[kept]]))


def graft(tree: StaticTree, chain_tokens: torch.Tensor, count: torch.Tensor) -> StaticTree:
    """`tree` with a path from the root grafted on (prompt lookup's, hybrid.py): `chain_tokens`
    (k,) of which the first `count` (0-dim) are drafts. As `tree.graft_chain` does on the host,
    the path follows the tree's nodes while they carry its tokens and leaves it as new rows; here
    all k rows are always appended (shapes stay fixed) and those the tree already holds, or past
    `count`, are invalid. A tree's siblings carry distinct tokens (a row's top k), so at most one
    node per depth lies on the path."""
    device = tree.tokens.device
    rows, k = tree.tokens.numel(), chain_tokens.numel()
    index = torch.arange(rows, device=device)
    # Nodes whose whole path from the root spells the path's first tokens.
    want = chain_tokens[(tree.depths - 1).clamp(0, k - 1)]
    on_path = ((tree.tokens == want) & (tree.depths >= 1)) | (index == 0)
    if tree.valid is not None:
        on_path = on_path & tree.valid
    for _ in range(tree.max_depth):
        on_path = on_path & on_path[tree.parents]
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
    tree_parents = torch.cat([tree.parents, parents])
    max_depth = max(tree.max_depth, k)
    ranks = tree.ranks if tree.ranks is not None else torch.full_like(tree.tokens, -1)
    return StaticTree(torch.cat([tree.tokens, chain_tokens]), tree_parents,
                      torch.cat([tree.depths, steps + 1]), ancestor_mask(tree_parents, max_depth),
                      max_depth, valid=torch.cat([tree_valid, valid]),
                      ranks=torch.cat([ranks, torch.full_like(chain_tokens, -1)]))


class StaticDecoder:
    """Greedy steps over a DeviceKVCache of `max_len` slots for one model and proposer (see the
    module docstring). `start` takes a generation's first token once its prompt is in the cache;
    each `step` verifies one tree and returns what the host needs. On CUDA each (tree size, drafting) step is captured as a CUDA graph
    after two warm-up runs and replayed; if capture fails the step runs eagerly, and
    `graph_failures` says why (VOCABSPEC_CUDA_GRAPHS=0 turns capture off)."""

    def __init__(self, model, proposer, max_len: int):
        self.model = model
        self.proposer = proposer
        self.max_len = max_len
        args = model.args
        self.cache = DeviceKVCache(args.n_layers, args.n_kv_heads, args.head_dim, max_len,
                                   model.dtype, model.device)
        self.taps = proposer.taps if proposer is not None else ()
        self.root = torch.zeros(1, dtype=torch.long, device=model.device)
        self.capture = model.device.type == "cuda" and os.environ.get("VOCABSPEC_CUDA_GRAPHS", "1") != "0"
        self.graphs: dict[tuple[bool, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_failures: dict[tuple[bool, int], str] = {}

    @property
    def length(self) -> int:
        """Committed tokens, as the host knows them: the cache's bound, settled after each
        step's read-back."""
        return self.cache.bound

    def start(self, token: int) -> None:
        """After the prompt has run through `self.cache` (generate.prefill): its first token."""
        self.root.fill_(token)

    def rows(self, draft: bool) -> int:
        """The step's tree rows (host: the proposer's shape fixes them)."""
        return self.proposer.static_rows if draft else 1

    def step(self, draft: bool) -> tuple[list[int], int, tuple[int, ...], int]:
        """One greedy step: (accepted tokens, root first; the next token; the accepted drafts'
        value ranks; the drafted tokens verified). The host reads the device back once."""
        rows = self.rows(draft)
        committed = self.length
        if committed + rows > self.max_len:
            raise ValueError(f"a step of {rows} rows after {committed} tokens overruns the "
                             f"static cache's {self.max_len}")
        key = (draft, rows)
        out = self._replay(key) if self.capture else None
        if out is None:
            out = self._step(draft)
        values = out.tolist()
        length, token = values[0], values[1]
        width = (len(values) - 2) // 2
        accepted = values[2:2 + length]
        ranks = tuple(values[2 + width + 1:2 + width + length])
        self.cache.settle(committed + length)
        return accepted, token, ranks, rows - 1

    def _step(self, draft: bool) -> torch.Tensor:
        """The step as device work only: [accept length, next token, accepted tokens padded to
        the tree's depth + 1, their value ranks (padded the same)]."""
        model, cache, proposer = self.model, self.cache, self.proposer
        tree = proposer.propose_static(self.root) if draft else root_only(self.root)
        hidden, logits, *tapped = model(tree.tokens, tree.depths + cache.length, cache,
                                        tree_mask=tree.mask, all_logits=True, taps=self.taps)
        path, length_bonus = verify_greedy(tree.tokens, tree.parents, tree.depths, logits, tree.max_depth,
                                           tree.valid, tree.mask)
        count, bonus = length_bonus[0], length_bonus[1:]
        cache.keep(path, count)
        accepted = tree.tokens[path]
        if proposer is not None:
            # What the drafter reads: each accepted token's successor, the next token last.
            at_end = torch.arange(path.numel(), device=path.device) == count - 1
            reads = torch.where(at_end, bonus, accepted.roll(-1))
            rows = torch.cat([*[t[path] for t in tapped], hidden[path]], dim=-1) if tapped else hidden[path]
            proposer.observe_static(reads, rows, count)
        self.root.copy_(bonus)
        ranks = tree.ranks[path] if tree.ranks is not None else torch.full_like(path, -1)
        return torch.cat([length_bonus, accepted, ranks])

    def _state(self) -> list[torch.Tensor]:
        """Device tensors a step updates in place (restored after warm-up and capture)."""
        extra = self.proposer.static_buffers() if self.proposer is not None else []
        return [self.cache.length, self.root, *extra]

    def _caches(self) -> list[DeviceKVCache]:
        """The device caches a step writes: the target's, and the drafter's if it keeps one."""
        drafter_cache = self.proposer.cache if self.proposer is not None else None
        return [self.cache] + ([drafter_cache] if isinstance(drafter_cache, DeviceKVCache) else [])

    def rewound(self):
        """A context in which steps run and are then undone: the decoder, its caches' lengths
        and the drafter's state are as they were before (what steps wrote to cache slots past
        the committed ones is never read). For timing a step in place (autotune.py)."""
        return kept_state(self._state(), self._caches())

    def _replay(self, key) -> torch.Tensor | None:
        """The captured step for `key`, capturing it first; None where capture failed."""
        if key in self.graph_failures:
            return None
        if key not in self.graphs:
            if self.proposer is not None and self.proposer.timing_sync:
                self.graph_failures[key] = "a timing breakdown waits for the device inside the step"
                log.warning("CUDA graph for step %s not captured: %s", key, self.graph_failures[key])
                return None
            try:
                self.graphs[key] = capture_graph(lambda: self._step(key[0]), self._state(), self._caches())
            except Exception as exc:       # any capture error: run eagerly, say why
                self.graph_failures[key] = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph for step %s not captured, running eagerly: %s", key, exc)
                return None
        graph, out = self.graphs[key]
        graph.replay()
        return out


@contextlib.contextmanager
def kept_state(state: list[torch.Tensor], caches: list[DeviceKVCache]):
    """Leaves the device tensors `state` and the caches' host counts as the block found them."""
    saved = [t.clone() for t in state]
    hosts = [(c, c.bound, c.pending) for c in caches]
    try:
        yield
    finally:
        for tensor, value in zip(state, saved):
            tensor.copy_(value)
        for cache, bound, pending in hosts:
            cache.bound, cache.pending = bound, pending


def capture_graph(fn, state: list[torch.Tensor], caches: list[DeviceKVCache], warmup: int = 2):
    """(graph, output): `fn` (device work that updates `state` in place) captured as a CUDA
    graph after `warmup` runs on a side stream. The warm-up runs and the capture leave `state`
    and the caches' host counts as they found them (what they wrote to cache slots past the
    committed ones is never read)."""
    with kept_state(state, caches):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out


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
