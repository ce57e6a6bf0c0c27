"""Greedy decoding steps that a CUDA graph can capture: fixed shapes, device tensors only.

On a GPU every `.item()`, `.tolist()` or `bool(tensor)` waits for the device, and a forward
that slices its KV cache by host-side lengths cannot be captured. Here a whole greedy step is
one function of fixed-shape device tensors (`GraphDecoder`): the draft tree (tree.Tree, the
one tree type, from the proposer's `GraphDrafting`: EAGLE-2's, Medusa's, prompt lookup's path
padded to its longest, EAGLE-2's with that path grafted on, or the root alone), the target's
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
float32 ties apart on torch's kernels (not row-invariant), exactly on the row-invariant ones
(--backend triton: each row's keys listed on the device, kernel_backend.KernelPlan; the argmax
taken in the LM head's kernel, Transformer.greedy_tokens). Sampling
takes the eager steps (generate.py), as does the native CPU engine, which keeps its own cache.

`GraphBackend` is how the loop runs them: the backend of an `Engine` with graph steps, whose
`forward` runs a greedy request's whole step on the device and hands the loop what was
accepted (`RowSpan.settled`).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from ..runtime.backend import Backend
from ..runtime.cuda_graph import capture_graph, kept_state
from ..runtime.kv_cache import DeviceKVCache
from ..runtime.step_rows import RowSpan, StepRows
from ..speculation.proposer import Proposer
from ..speculation.tree import Tree, chain
from ..speculation.verify import verify_greedy

log = logging.getLogger(__name__)


class GraphDecoder:
    """Greedy steps over a DeviceKVCache of `max_len` slots for one model and proposer (see the
    module docstring). On CUDA each (drafting, tree size) step is captured as a CUDA graph
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
        self.drafting = None     # the proposer's GraphDrafting, once `enter` has run
        self.root = torch.zeros(1, dtype=torch.long, device=model.device)
        self.capture = model.device.type == "cuda" and os.environ.get("VOCABSPEC_CUDA_GRAPHS", "1") != "0"
        self.graphs: dict[tuple[bool, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_failures: dict[tuple[bool, int], str] = {}
        self.draft_next = False  # whether the next step drafts (its request's GraphProposal says)

    @property
    def length(self) -> int:
        """Committed tokens, as the host knows them: the cache's bound, settled after each
        step's read-back."""
        return self.cache.bound

    def start(self, token: int) -> None:
        """After the prompt has run through `self.cache` (Backend.prefill): its first token."""
        self.root.fill_(token)

    def enter(self) -> int:
        """A request's start: the proposer drafts in its graph form for this decoder's cache
        (the general loop may have had it since). Returns the largest step's rows."""
        if self.proposer is not None:
            self.drafting = self.proposer.graph_form(self.max_len)
        return self.rows(True)

    def rows(self, draft: bool) -> int:
        """The step's tree rows (host: the proposer's shape fixes them)."""
        return self.drafting.rows if draft and self.drafting is not None else 1

    def step(self, draft: bool) -> tuple[list[int], int, tuple[int, ...], int]:
        """One greedy step: (accepted tokens, root first; the next token; the accepted drafts'
        value ranks; the drafted tokens verified). The host reads the device back once."""
        rows = self.rows(draft)
        committed = self.length
        if committed + rows > self.max_len:
            raise ValueError(f"a step of {rows} rows after {committed} tokens overruns the "
                             f"graph cache's {self.max_len}")
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
        model, cache, drafting = self.model, self.cache, self.drafting
        tree = drafting.propose(self.root) if draft else chain(self.root, self.root[:0])
        mask = tree.attention_mask()
        hidden, tapped = model.tree_forward(tree.tokens, tree.depths + cache.length, cache, mask, self.taps)
        # Greedy verification reads each row's argmax only: on the fused kernels the LM head's
        # kernel takes it, and the logits are never stored.
        best = model.greedy_tokens(hidden)
        path, length_bonus = verify_greedy(tree.tokens, tree.parents, tree.depths, best, tree.max_depth,
                                           tree.valid, mask)
        count, bonus = length_bonus[0], length_bonus[1:]
        cache.keep(path, count)
        accepted = tree.tokens[path]
        if drafting is not None:
            # What the drafter reads: each accepted token's successor, the next token last.
            at_end = torch.arange(path.numel(), device=path.device) == count - 1
            reads = torch.where(at_end, bonus, accepted.roll(-1))
            rows = torch.cat([tapped[path], hidden[path]], dim=-1) if tapped is not None else hidden[path]
            drafting.observe(reads, rows, count)
        self.root.copy_(bonus)
        ranks = tree.ranks[path] if tree.ranks is not None else torch.full_like(path, -1)
        return torch.cat([length_bonus, accepted, ranks])

    def _state(self) -> list[torch.Tensor]:
        """Device tensors a step updates in place (restored after warm-up and capture)."""
        extra = self.drafting.buffers() if self.drafting is not None else []
        return [self.cache.length, self.root, *extra]

    def _caches(self) -> list[DeviceKVCache]:
        """The device caches a step writes: the target's, and the drafter's if it keeps one."""
        drafter_cache = self.drafting.cache if self.drafting is not None else None
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


class GraphProposal(Proposer):
    """A greedy request's proposer on graph steps: its drafting happens inside the decoder's
    step, so a proposal is the root alone, marked to draft; the request's own proposer (if any)
    drafts in its graph form."""

    drafts_on_device = True

    def __init__(self, decoder: GraphDecoder, proposer: Proposer | None):
        self.decoder, self.proposer = decoder, proposer
        self.taps = decoder.taps
        self.max_tree_tokens = decoder.enter() - 1

    def reset(self, prompt_ids: list[int], prompt_hidden: torch.Tensor, first_token: int) -> None:
        if self.proposer is not None:
            self.proposer.size_live = self.size_live
            self.proposer.reset(prompt_ids, prompt_hidden, first_token)
        self.decoder.start(first_token)

    def propose(self, root_token: int) -> Tree:
        self.decoder.draft_next = True
        return chain(root_token, [], device=self.decoder.root.device)

    def observe(self, accepted: list[int], hidden: torch.Tensor, next_token: int) -> None:
        pass        # the decoder's step told the drafting (`GraphDrafting.observe`, `after`)


class GraphBackend:
    """Greedy steps as graph steps over `inner` (torch's backend, or the row-invariant
    kernels'), for one `proposer` (module docstring): a Backend whose `prepare`, `forward` and
    `verify_greedy` are its own, everything else `inner`'s (the model it runs: its head, cache,
    prefill). The decoders keep a cache each, by size (`decoder`)."""

    def __init__(self, inner: Backend, proposer: Proposer | None):
        if not inner.device_steps:
            raise ValueError("graph steps run on torch's kernels (a GPU's path); the native "
                             "engine keeps its own cache: load with backend='torch'")
        self.inner, self.proposer = inner, proposer
        self.decoders: dict[int, GraphDecoder] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decoder(self, tokens: int) -> GraphDecoder:
        """The decoder with room for `tokens`, its cache's slots rounded up to a power of two
        (from 256) so that a few sizes, and their CUDA graphs, serve every request."""
        size = 256
        while size < tokens:
            size *= 2
        size = min(size, self.inner.args.max_seq_len)
        if size not in self.decoders:
            self.decoders[size] = GraphDecoder(self.inner, self.proposer, size)
        return self.decoders[size]

    def prepare(self, generation) -> None:
        """A greedy request without logprobs runs graph steps: a decoder's cache and a
        GraphProposal (its proposer drafting in its graph form); any other leaves the graph
        form for the general loop's."""
        proposer = generation.proposer
        if proposer is not None and proposer.graphs:
            proposer.graph_form(None)
        if not generation.verifies_greedily:
            return
        room = len(generation.prompt_ids) + generation.config.max_new_tokens + generation.tree_room
        decoder = self.decoder(room)
        generation.proposer = GraphProposal(decoder, proposer)
        generation.cache = decoder.cache

    def forward(self, rows: StepRows) -> StepRows:
        """A graph request's step whole (its span the root; what it accepted `settled`), or
        `inner`'s forward."""
        span = rows.spans[0]
        decoder = next((d for d in self.decoders.values() if d.cache is span.cache), None)
        if decoder is None or len(rows.spans) > 1:
            return self.inner.forward(rows)
        draft, decoder.draft_next = decoder.draft_next, False
        accepted, token, ranks, size = decoder.step(draft)
        if decoder.drafting is not None:
            decoder.drafting.after(accepted, token, decoder.length)
        span.next_token, span.settled = token, (accepted, ranks, size)
        return rows

    def verify_greedy(self, rows: StepRows, spans: list[RowSpan]) -> None:
        self.inner.verify_greedy(rows, [span for span in spans if span.settled is None])

    def together(self, allow_inexact: bool, asked: bool | None = None) -> bool:
        return asked is not None and self.inner.together(allow_inexact, asked)


@contextlib.contextmanager
def count_read_backs():
    """Counts every call that hands a tensor's value to the host (tensor methods and
    torch.equal): the tests and the GPU check hold a step to one."""
    counts = {"n": 0}
    patched = {name: getattr(torch.Tensor, name)
               for name in ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")}
    for name, original in patched.items():
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
