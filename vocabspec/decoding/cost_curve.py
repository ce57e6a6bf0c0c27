"""The cost curve: seconds of the target's tree-masked forward against the rows it verifies.

Measured once per model and machine (`forward_seconds`), it is what every choice of draft
size reads: the autotuner's tree (autotune.py) and the batch's draft budget (`Costs`,
batch.py). Rows do not cost the same everywhere: on a CPU each row costs a share of a forward,
on a GPU rows are nearly free up to a kernel tile.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..runtime.step_rows import StepRows


def forward_seconds(model, sizes, context: int = 256, repeats: int = 5,
                    bar=None) -> dict[int, float]:
    """Median seconds of the verification forward at each size, sizes taken in turn within
    each round: a burst of load from elsewhere then slows one round of every size, which the
    median drops, instead of every repeat of a few neighbouring sizes. The context is cut to
    what the model's window leaves beside the largest tree."""
    room = model.args.max_seq_len - max(sizes) - 1
    if room < 1:
        raise ValueError(f"a forward of {max(sizes) + 1} rows does not fit the model's window of "
                         f"{model.args.max_seq_len} positions")
    context = min(context, room)
    cache = model.new_cache(context + max(sizes) + 1)
    device = model.device
    runs: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        ids = torch.randint(model.args.vocab_size, (context,), device=device)
        model.run(ids, cache)
        cache.commit()
        trees = {n: (torch.randint(model.args.vocab_size, (n + 1,), device=device), torch.arange(-1, n, device=device))
                 for n in sizes}
        for round_ in range(repeats + 1):          # the first round warms up
            for n, (tokens, parents) in trees.items():
                start = time.perf_counter()
                hidden = model.run(tokens, cache, parents=parents).hidden
                model.lm_head(hidden[:model.head_rows])   # what verification scores at first
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if round_:
                    runs[n].append(time.perf_counter() - start)
                cache.discard()
                if bar is not None:
                    bar.update()
    return {n: statistics.median(times) for n, times in runs.items()}


def head_seconds(model, sizes, repeats: int = 5) -> dict[int, float]:
    """Median seconds of greedy verification's LM head over n rows, each its own one-row tree
    (what a batch of n plain steps scores; on torch's kernels the logits and their argmax)."""
    device = model.device
    runs: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        roots = StepRows()
        for _ in range(max(sizes)):
            roots.add(torch.zeros(1, dtype=torch.long, device=device), None, positions=torch.zeros(1))
        roots.hidden = torch.randn(max(sizes), model.args.dim, device=device)
        for round_ in range(repeats + 1):          # the first round warms up
            for n in sizes:
                start = time.perf_counter()
                model.verify_greedy(roots, roots.spans[:n])
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if round_:
                    runs[n].append(time.perf_counter() - start)
    return {n: statistics.median(times) for n, times in runs.items()}


def _between(xs: list[int], ys: list[float], at: int) -> float:
    """ys at `at`, linear between the measured xs and beyond the largest."""
    if at <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if at <= xs[i] or i == len(xs) - 1:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (at - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[0]


class Costs:
    """c(rows): the seconds of a target forward over `rows` rows, from measured sizes, linear
    between them and beyond the largest. With the head's own curve, c(rows, head_rows) is a
    batch step's: the forward over all rows plus the head over the rows verification scores
    first (a plain request one, a tree up to the head's pass), which the one-sequence curve
    holds only once. Where the head is most of a step (Gemma's 262k rows), each tree's head
    rows decide whether it pays in a batch."""

    def __init__(self, seconds: dict[int, float], head: dict[int, float] | None = None,
                 head_rows: int = 1):
        self.rows = sorted(seconds)
        self.seconds = [seconds[n] for n in self.rows]
        self.head_rows = head_rows
        self.head = None
        if head:
            self.head = (sorted(head), [head[n] for n in sorted(head)])

    @classmethod
    def measure(cls, model, most: int, heads: int = 0) -> Costs:
        """The curve up to `most` rows, and the head's up to `heads` rows (0: none)."""
        sizes = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n < most} | {most - 1})
        head = None
        if heads:
            head = head_seconds(model, sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n < heads} | {heads}),
                                repeats=3)
        return cls({n + 1: s for n, s in forward_seconds(model, sizes, repeats=3).items()}, head,
                   model.head_rows)

    def head_pass(self) -> float:
        """Seconds of one more pass of the head over a tree's next rows (a path that leaves
        the first pass's rows); 0 without the head's curve."""
        return _between(*self.head, self.head_rows) if self.head is not None else 0.0

    def __call__(self, rows: int, head_rows: int | None = None) -> float:
        seconds = _between(self.rows, self.seconds, rows)
        if head_rows is None or self.head is None:
            return seconds
        # The curve's forward scored min(rows, head_rows) rows once; a batch scores head_rows.
        xs, ys = self.head
        return seconds - _between(xs, ys, min(rows, self.head_rows)) + _between(xs, ys, head_rows)
