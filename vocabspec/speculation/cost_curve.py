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


def forward_seconds(model, sizes, context: int = 256, repeats: int = 5,
                    bar=None) -> dict[int, float]:
    """Median seconds of the verification forward at each size, sizes taken in turn within
    each round: a burst of load from elsewhere then slows one round of every size, which the
    median drops, instead of every repeat of a few neighbouring sizes."""
    cache = model.new_cache(context + max(sizes) + 1)
    device = model.device
    runs: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        ids = torch.randint(model.args.vocab_size, (context,), device=device)
        model(ids, torch.arange(context, device=device), cache)
        cache.commit()
        trees = {}
        for n in sizes:
            trees[n] = (torch.randint(model.args.vocab_size, (n + 1,), device=device),
                        torch.arange(context, context + n + 1, device=device),
                        torch.ones(n + 1, n + 1, dtype=torch.bool, device=device).tril())
        for round_ in range(repeats + 1):          # the first round warms up
            for n, (tokens, positions, mask) in trees.items():
                start = time.perf_counter()
                hidden, _ = model(tokens, positions, cache, tree_mask=mask, logits_rows=[])
                model.lm_head(hidden[:model.verify_head_rows])   # what verification scores at first
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if round_:
                    runs[n].append(time.perf_counter() - start)
                cache.discard()
                if bar is not None:
                    bar.update()
    return {n: statistics.median(times) for n, times in runs.items()}


class Costs:
    """c(rows): the seconds of a target forward over `rows` rows, from measured sizes, linear
    between them and beyond the largest."""

    def __init__(self, seconds: dict[int, float]):
        self.rows = sorted(seconds)
        self.seconds = [seconds[n] for n in self.rows]

    @classmethod
    def measure(cls, model, most: int) -> Costs:
        sizes = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n < most} | {most - 1})
        return cls({n + 1: s for n, s in forward_seconds(model, sizes, repeats=3).items()})

    def __call__(self, rows: int) -> float:
        xs, ys = self.rows, self.seconds
        if rows <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if rows <= xs[i] or i == len(xs) - 1:
                return ys[i - 1] + (ys[i] - ys[i - 1]) * (rows - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[0]
