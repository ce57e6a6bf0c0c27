"""A batch's requests stepped as rows of one forward, on torch's or the row-invariant kernels:
plain-decoding ones a row each, and drafted ones' trees beside them.

On the native engine a batch step runs every request's rows in one native call
(`Transformer.forward_batch`); on torch's kernels that call runs the requests in turn, a
forward each, which leaves a GPU idle: there a step of one row costs about what a step of a
thousand rows costs. `BatchedDecoding` gives each plain-decoding request a slot of one
`SlotCache` (engine/batched.py) and steps them all as one `DecodeStep`, one row each: a CUDA
graph per context bucket on a GPU, eagerly elsewhere. Joining requests' prompts are prefilled
together, padded, into their slots. Greedy steps run one ahead of the host, which reads a step
and emits its tokens while the device computes the next (`step`).

Where it runs: inside `BatchEngine` (batch.py), which picks it when its model runs on the
row-invariant kernels, or on torch's with inexact answers allowed (`BatchLimits.batched`),
rather than as an engine of its own: admission, the queue, cancellation, deadlines, streaming,
stop strings, logprobs and results stay the batch engine's and each request's `Generation`'s,
one path for the server, the batch job and the Python API. Only the forward and the choice of
each token move here.

Drafted requests: a drafted request keeps its keys in a slot too
(`sequence`: the slot as its KV cache), its prompt prefilled alone there by the model's own
forward (its proposer reads the prompt's hidden states and taps). At each step its tree, or its
root alone where the batch's cost rule says not to draft, runs as rows of the plain rows'
forward (`step_with_trees`, engine/batched.py's `SlotTree`): each tree's rows attend over its
slot with the visibility its forward alone gives them (on the row-invariant kernels they keep
their bits; on torch's, `TreeRowsOnTorch`, up to rounding), and the tree is verified,
committed (the accepted keys moved down in the slot) and emitted by the request's own
`Generation.finish`, greedy or sampling. Such a step runs eagerly, its proposals and its
verification reading the device as a request alone does.

A request's tokens are its own: a greedy row takes the step's argmax, a sampled row is drawn
from its row's logits with the request's settings and generator (`Generation.take`), the draw
serving it alone makes from the same logits. On the row-invariant kernels (`--backend triton`)
they are the same bits (engine/batched.py's `SlotRows`, the prefill's padding included), so
every answer is the one serving the request alone gives: greedy tokens identical, seeded draws
identical. torch's kernels round a row differently with other rows beside it (float32 in the
last bits, bfloat16 by units of its precision), which is why there this path needs inexact
answers allowed (`exact` says which).

Memory is fixed when the engine starts: the slots are sized from the device's free memory and
the window asked for (`SlotCache.fitting`: at most `max_batch` slots in half the free memory,
the rest for activations), and a prefill holds at most `prefill_tokens` padded tokens.
Requests beyond the slots wait in the engine's queue; one longer than a slot's window is refused
when submitted; where not even one slot fits, the engine refuses to start, naming the sizes.

A request keeps its slot (its `BatchEngine` slot's index) until it ends, and joining requests
take the lowest free ones. A free slot below a running one steps too, its row writing only into
its own slot (which a prefill overwrites), so running requests never move. A drafted request's
slot never steps that way: while one runs, every step is `step_with_trees`, whose rows are the
running requests' alone.
"""

from __future__ import annotations

import time

import torch

from ..engine.batched import (DecodeStep, SlotCache, SlotSequence, SlotTree, forward_with_trees, prefill_groups,
                              prefill_slots)
from ..engine.kv_cache import ancestor_mask
from ..engine.model import Transformer
from .generate import Generation, own_taps
from ..speculation.tree import Tree

PREFILL_TOKENS = 16384      # padded prompt tokens a prefill runs at once: bounds its activations


class BatchedDecoding:
    """Plain decoding of up to `slots` requests in one forward a step (module docstring)."""

    def __init__(self, model: Transformer, window: int, most_slots: int,
                 prefill_tokens: int = PREFILL_TOKENS):
        self.model = model
        self.cache = SlotCache.fitting(model, window, most_slots)
        self.decode = DecodeStep(model, self.cache)
        self.prefill_tokens = prefill_tokens
        # Per slot, on the host: the position its next row goes to (the tokens its slot holds).
        self.positions = [0] * self.cache.slots
        self.steps = 0
        self.ahead: Launched | None = None       # a greedy step launched and not yet read (`step`)
        # Steps that drafted requests' rows joined, and those rows (trees and lone roots): the
        # trees at work in the shared step.
        self.tree_steps = self.tree_rows = 0

    def sequence(self, slot: int) -> SlotSequence:
        """Slot `slot` as a drafted request's KV cache."""
        return SlotSequence(self.cache, slot)

    @property
    def slots(self) -> int:
        return self.cache.slots

    @property
    def exact(self) -> bool:
        """Whether every answer is bit for bit the one serving its request alone gives (on the
        row-invariant kernels), not only up to rounding (on torch's)."""
        return self.model.kernels

    def start(self, joining: list[tuple[int, Generation]]) -> list[str | BaseException]:
        """Prefill each (slot, generation)'s prompt into its slot, shortest first in groups of
        at most `prefill_tokens`, and give it its first token; per generation, the text that
        token shows or the exception that ended it."""
        outcomes: list[str | BaseException] = [""] * len(joining)
        order = sorted(range(len(joining)), key=lambda i: len(joining[i][1].prompt_ids))
        sizes = prefill_groups([len(joining[i][1].prompt_ids) for i in order], self.prefill_tokens)
        done = 0
        for size in sizes:
            group, done = order[done:done + size], done + size
            for i in group:
                joining[i][1].started = joining[i][1].started or time.perf_counter()
            slots = torch.tensor([joining[i][0] for i in group], device=self.model.device)
            logits = prefill_slots(self.model, self.cache, [joining[i][1].prompt_ids for i in group], slots=slots)
            greedy = logits.argmax(-1).tolist()
            for row, i in enumerate(group):
                slot, generation = joining[i]
                self.positions[slot] = len(generation.prompt_ids)
                try:
                    outcomes[i] = generation.start_outside(greedy[row], logits[row])
                except Exception as exc:          # noqa: BLE001 - ends that request alone
                    outcomes[i] = exc
        return outcomes

    def step(self, running: list[tuple[int, Generation]]) -> list[str | BaseException]:
        """A step of every running (slot, generation)'s row, all in one forward; per generation,
        the text its new token shows ("" where its token is still on its way), or the exception
        that ended it.

        Greedy rows run a step ahead: a step is launched from the device's own argmax of the
        step before, with no read-back between them, and the host reads that earlier step and
        emits its tokens while the device computes the new one (the host's share of a step of
        a thousand rows is about the device's). A request that ended in the earlier step has a
        row wasted in the new one, written into its own slot only. A row that reads its logits
        (sampling, logprobs) needs its step read before the next is launched: while one runs,
        a step ahead is read first, and steps then run one at a time."""
        started = time.perf_counter()
        ahead, self.ahead = self.ahead, None
        if any(generation.reads_logits for _, generation in running):
            if ahead is None:
                ahead = self._launch(running, None)
            return self._read(ahead, running, started)
        if ahead is None:
            ahead = self._launch(running, None)
        self.ahead = self._launch(running, ahead)
        return self._read(ahead, running, started)

    def _launch(self, running: list[tuple[int, Generation]], ahead: "Launched | None") -> "Launched":
        """Start a step of the running rows, each fed its last token: the device's argmax in
        `ahead` where its request was in that step, else its request's own (the host's)."""
        device = self.model.device
        rows = self.decode.rows(max(slot for slot, _ in running) + 1)
        tokens = torch.zeros(rows, dtype=torch.long, device=device)   # a free slot's row feeds 0
        if ahead is not None:
            carried = min(rows, ahead.next_tokens.numel())
            tokens[:carried] = ahead.next_tokens[:carried]
        fed = [(slot, generation.token) for slot, generation in running
               if ahead is None or ahead.members.get(slot) is not generation]
        if fed:
            slots, last = zip(*fed)
            tokens[torch.tensor(slots, device=device)] = torch.tensor(last, device=device)
        context = max(self.positions[slot] for slot, _ in running) + 1
        positions = [min(p, self.cache.window - 1) for p in self.positions[:rows]]
        greedy, logits = self.decode.with_logits(tokens, torch.tensor(positions, device=device), context)
        for slot, _ in running:
            self.positions[slot] += 1
        return Launched(dict(running), greedy, logits)

    def _read(self, launched: "Launched", running: list[tuple[int, Generation]],
              started: float) -> list[str | BaseException]:
        """The launched step's tokens to the running requests that were in it (the step's one
        wait for the device)."""
        chosen = launched.read()
        seconds = time.perf_counter() - started
        outcomes: list[str | BaseException] = []
        for slot, generation in running:
            if launched.members.get(slot) is not generation:        # joined since: its turn is next
                outcomes.append("")
                continue
            try:
                row = launched.logits[slot] if generation.reads_logits else None
                outcomes.append(generation.take(chosen[slot], row, seconds))
            except Exception as exc:             # noqa: BLE001 - ends that request alone
                outcomes.append(exc)
        self.steps += 1
        return outcomes


    def step_with_trees(self, running: list[tuple[int, Generation]],
                        trees: list[tuple[Generation, Tree]]) -> tuple[list, list]:
        """A step of every running (slot, generation)'s row and of each drafted generation's
        proposed tree (its cache a `sequence`), all in one forward;
        then each plain row takes its token (`Generation.take`) and each tree is verified,
        committed and emitted (`Generation.finish`, as when its request steps alone). Per plain
        generation the text it shows or the exception that ended it; per tree (tree, that).

        Trees in the step need every row's token before the forward: no step runs ahead. Where
        one is on its way, it is the plain rows' step (read here) and the trees step alone."""
        if not trees:
            return self.step(running), []
        started = time.perf_counter()
        ahead, self.ahead = self.ahead, None
        plain: list[str | BaseException] = []
        if ahead is not None:
            plain, running = self._read(ahead, running, started), []
        device = self.model.device
        slots = [slot for slot, _ in running]
        tokens = torch.tensor([generation.token for _, generation in running], dtype=torch.long, device=device)
        positions = torch.tensor([self.positions[slot] for slot in slots], dtype=torch.long, device=device)
        # Each tree laid out in its slot; one that cannot be (no room left, say) ends its own
        # request before the shared forward, not the requests beside it.
        finished: list = [None] * len(trees)
        laid, joined = [], []
        for index, (generation, tree) in enumerate(trees):
            try:
                laid.append(SlotTree(self.model, generation.cache, tree.tokens.to(device),
                                     tree.positions(generation.cache.length).to(device),
                                     ancestor_mask(tree.parents) if tree.size else None))
                joined.append(index)
            except Exception as exc:             # noqa: BLE001 - ends that request alone
                finished[index] = (tree, exc)
        if not running and not laid:
            return plain, finished
        taps = tuple(sorted({t for i in joined for t in trees[i][0].taps}))
        t1 = time.perf_counter()
        out = forward_with_trees(self.model, self.cache, tokens, positions,
                                 torch.tensor(slots, dtype=torch.long, device=device), laid, taps)
        hidden, tapped = out if taps else (out, None)
        logits = self.model.lm_head(hidden[:len(running)]) if running else None
        chosen = logits.argmax(-1).tolist() if running else []
        forwarded = time.perf_counter()
        for slot in slots:
            self.positions[slot] += 1
        for row, (slot, generation) in enumerate(running):
            try:
                own = logits[row] if generation.reads_logits else None
                plain.append(generation.take(chosen[row], own, forwarded - started))
            except Exception as exc:             # noqa: BLE001 - ends that request alone
                plain.append(exc)
        first = len(running)
        for index, rows in zip(joined, laid):
            generation, tree = trees[index]
            part = slice(first, first + rows.rows)
            first += rows.rows
            try:
                mine = own_taps(tapped[part] if taps else None, taps, generation.taps)
                finished[index] = (tree, generation.finish(tree, hidden[part], mine, t1, None, forwarded))
            except BaseException as exc:
                finished[index] = (tree, exc)
        self.steps += 1
        self.tree_steps += bool(laid)
        self.tree_rows += sum(rows.rows for rows in laid)
        return plain, finished


class Launched:
    """A decode step on its way: the requests in it by slot, its argmax kept on the device (the
    next step's input: a captured step's own outputs are rewritten by its next replay) and on
    its way to the host, and its logits (read only before another step is launched)."""

    def __init__(self, members: dict[int, Generation], greedy: torch.Tensor, logits: torch.Tensor):
        self.members, self.logits = members, logits
        self.next_tokens = greedy.clone()
        self.done = None
        if greedy.device.type == "cuda":
            self.host = torch.empty(greedy.shape, dtype=greedy.dtype, pin_memory=True)
            self.host.copy_(greedy, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = self.next_tokens

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()
