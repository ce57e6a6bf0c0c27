"""A batch's plain-decoding requests on torch's kernels, stepped as rows of one forward.

On the native engine a batch step runs every request's rows in one native call
(`Transformer.forward_batch`); on torch's kernels that call runs the requests in turn, a
forward each, which leaves a GPU idle: there a step of one row costs about what a step of a
thousand rows costs. `BatchedDecoding` gives each plain-decoding request a slot of one
`SlotCache` (engine/batched.py) and steps them all as one `DecodeStep`, one row each: a CUDA
graph per context bucket on a GPU, eagerly elsewhere. Joining requests' prompts are prefilled
together, padded, into their slots.

Where it runs: inside `BatchEngine` (batch.py), which picks it when its model runs on torch's
kernels and inexact answers are allowed (`BatchLimits.batched`), rather than as an engine of
its own: admission, the queue, cancellation, deadlines, streaming, stop strings, logprobs and
results stay the batch engine's and each request's `Generation`'s, one path for the server,
the batch job and the Python API; and a drafted request, which keeps its own KV cache and the
per-request step, runs beside plain ones in the same engine. Only the forward and the choice
of each token move here.

A request's tokens are its own: a greedy row takes the step's argmax, a sampled row is drawn
from its row's logits with the request's settings and generator (`Generation.take`), the draw
serving it alone makes from the same logits. The logits are not the same bits: torch's kernels
round a row differently with other rows beside it (float32 in the last bits, bfloat16 by units
of its precision), which is why this path needs inexact answers allowed.

Memory is fixed when the engine starts: the slots are sized from the device's free memory and
the window asked for (`SlotCache.fitting`: at most `max_batch` slots in half the free memory,
the rest for activations; a quarter where requests may draft, whose own caches take the next
quarter), and a prefill holds at most `prefill_tokens` padded tokens. Requests beyond the
slots wait in the engine's queue; one longer than a slot's window is refused when submitted;
where not even one slot fits, the engine refuses to start, naming the sizes.

A request keeps its slot (its `BatchEngine` slot's index) until it ends, and joining requests
take the lowest free ones. A free slot below a running one steps too, its row writing only into
its own slot (which a prefill overwrites), so running requests never move.
"""

from __future__ import annotations

import time

import torch

from ..engine.batched import DecodeStep, SlotCache, prefill_groups, prefill_slots
from ..engine.model import Transformer
from .generate import Generation

PREFILL_TOKENS = 16384      # padded prompt tokens a prefill runs at once: bounds its activations


class BatchedDecoding:
    """Plain decoding of up to `slots` requests in one forward a step (module docstring)."""

    def __init__(self, model: Transformer, window: int, most_slots: int,
                 prefill_tokens: int = PREFILL_TOKENS, memory_share: float = 0.5):
        self.model = model
        self.cache = SlotCache.fitting(model, window, most_slots, memory_share)
        self.decode = DecodeStep(model, self.cache)
        self.prefill_tokens = prefill_tokens
        # Per slot, on the host: the position its next row goes to (the tokens its slot holds).
        self.positions = [0] * self.cache.slots
        self.steps = 0

    @property
    def slots(self) -> int:
        return self.cache.slots

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
        """One token for each (slot, generation), every row in one forward; per generation, the
        text its token shows or the exception that ended it."""
        started = time.perf_counter()
        device = self.model.device
        rows = self.decode.rows(max(slot for slot, _ in running) + 1)
        last = [0] * rows                        # a free slot's row feeds token 0
        for slot, generation in running:
            last[slot] = generation.token
        context = max(self.positions[slot] for slot, _ in running) + 1
        positions = [min(p, self.cache.window - 1) for p in self.positions[:rows]]
        greedy, logits = self.decode.with_logits(torch.tensor(last, device=device),
                                                 torch.tensor(positions, device=device), context)
        chosen = greedy.tolist()                 # the step's one read-back
        seconds = time.perf_counter() - started
        outcomes: list[str | BaseException] = []
        for slot, generation in running:
            self.positions[slot] += 1
            try:
                row = logits[slot] if generation.reads_logits else None
                outcomes.append(generation.take(chosen[slot], row, seconds))
            except Exception as exc:             # noqa: BLE001 - ends that request alone
                outcomes.append(exc)
        self.steps += 1
        return outcomes
