"""EAGLE-3's training with many sequences a step: the recipe of eagle3_train.py where a
device is wide (a GPU), features computed as each batch is drawn.

eagle3_train.py trains one sequence at a time, its features from `Model.forward`: right on a
2-core CPU, where one sequence keeps both cores busy, and far too slow on a GPU, where a few
hundred rows leave it idle. Here a step takes sequences of similar length, right-padded to
(B, L):
- the target's features for all of them come from one batched forward (batched.forward_rows,
  causal within each sequence), with its full-vocabulary choice at every position;
- training-time test runs the drafter over the B x n rows at once, attending within each
  sequence (StepAttention over B blocks); padded rows carry no loss.
The loss is eagle3_train's: soft labels (the target's distribution over the draft vocabulary)
or hard ones (the cross-entropy to the target's choice). Several drafters can train side by
side on the same features (`train`'s `drafters`), which is how the recipe compares two losses
at one token count for the price of one target pass.
"""

from __future__ import annotations

import json
import math
import random
import time

import torch

from ..engine.batched import forward_rows, pad_rows
from ..engine.backend import Backend
from ..speculation.families.eagle3 import Eagle3Drafter
from .eagle3_train import LABELS, agreement, batch_loss

def length_batches(sequences: list[list[int]], tokens: int, seed: int) -> list[list[int]]:
    """Indices of `sequences` in batches of similar length, each at most `tokens` padded
    tokens (one sequence at least), in a seeded random order."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batches, current = [], []
    for i in order:
        if current and len(sequences[i]) * (len(current) + 1) > tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    random.Random(seed).shuffle(batches)
    return batches


@torch.no_grad()
def target_features(target: Backend, sequences: list[list[int]], taps: tuple[int, ...],
                    head_rows: int = 8192) -> dict:
    """One batch's features: tokens (B, L) right-padded and their lengths (B,), the last
    layer's states (B, L, dim) before the final norm, the tapped layers' (B, L, taps x dim),
    and the target's choice over its whole vocabulary (B, L)."""
    tokens, lengths = pad_rows(sequences, target.device)
    positions = torch.arange(tokens.shape[1], device=target.device).expand_as(tokens)
    hidden, tapped = forward_rows(target, tokens, positions, taps=taps)
    flat = hidden.flatten(0, 1)
    chosen = torch.cat([target.lm_head(rows).argmax(-1) for rows in flat.split(head_rows)])
    return {"tokens": tokens, "lengths": lengths, "hidden": hidden, "tapped": tapped,
            "chosen": chosen.view(tokens.shape)}


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then a cosine down to a tenth of the peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(target: Backend, drafters: dict[str, tuple[Eagle3Drafter, str]],
          sequences: list[list[int]], heldout: list[list[int]], *, tokens_per_batch: int = 32768,
          steps: int = 3, decay: float = 0.8, lr: float = 1e-3, warmup: int = 40, grad_clip: float = 0.5,
          seed: int = 0, deadline: float | None = None, snapshot_tokens: tuple[int, ...] = (),
          log=print) -> list[dict]:
    """One epoch over `sequences` for each drafter ({name: (drafter, labels)}), all on the
    same batches and features. With a `deadline` (time.perf_counter()) the epoch is cut to the
    steps that fit, measured over its first steps, and the learning rate decays over those.
    Returns the scaling points: each drafter's held-out agreement after `snapshot_tokens`
    training tokens and at the end."""
    taps = _shared_taps(drafters)
    optimizers = {name: torch.optim.AdamW(d.parameters(), lr=lr, betas=(0.9, 0.95))
                  for name, (d, _) in drafters.items()}
    batches = length_batches(sequences, tokens_per_batch, seed)
    held = [target_features(target, [heldout[i] for i in batch], taps)
            for batch in length_batches(heldout, tokens_per_batch, seed)]
    device = target.device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    total, trained, started = len(batches), 0, time.perf_counter()
    points = _Points(drafters, held, steps, autocast, started, log)
    pending = sorted(snapshot_tokens)
    clock = _clock(device.type == "cuda")   # one step's split between the target and each drafter
    for step, batch in enumerate(batches):
        if step == total:
            break
        split = [clock()] if step == 5 else None
        features = target_features(target, [sequences[i] for i in batch], taps)
        if split:
            split.append(clock())
        for name, (drafter, labels) in drafters.items():
            loss, info = _drafter_step(drafter, optimizers[name], learning_rate(step, total, lr, warmup), autocast,
                                       features, steps, decay, labels, grad_clip)
            if loss is not None and split:
                split.append(clock())
        if split:
            log(f"step {step} of {int(features['lengths'].sum())} tokens: target {split[1] - split[0]:.3f} s, "
                + ", ".join(f"{name} {b - a:.3f} s" for name, a, b in zip(drafters, split[1:], split[2:])))
        trained += int(features["lengths"].sum())
        if deadline is not None and step == 9:     # the steps that fit, from the first ten's pace
            pace = (time.perf_counter() - started) / 10
            total = min(total, max(20, int((deadline - time.perf_counter()) / (1.15 * pace)) + 10))
            log(f"{pace * 1000:.0f} ms a step: {total} of {len(batches)} steps fit")
        while pending and trained >= pending[0]:
            points.add(f"{pending.pop(0)}", trained)
        if step % 50 == 0:
            log(f"step {step}/{total} tokens {trained} loss {float(loss.detach()):.3f} "
                + " ".join(f"{k} {float(v):.3f}" for k, v in info.items()))
    points.add("end", trained)
    for drafter, _ in drafters.values():
        drafter.eval().requires_grad_(False)
    return points.points


def _shared_taps(drafters: dict[str, tuple[Eagle3Drafter, str]]) -> tuple[int, ...]:
    """The target layers every drafter fuses, each drafter put in training mode; ValueError
    where two fuse different ones or labels are unknown."""
    taps = tuple(sorted({t for d, _ in drafters.values() for t in d.taps}))
    for name, (drafter, labels) in drafters.items():
        if drafter.taps != taps:
            raise ValueError(f"drafter {name} fuses taps {drafter.taps}, the others {taps}")
        if labels not in LABELS:
            raise ValueError(f"drafter {name}: labels are {' or '.join(LABELS)}, not {labels!r}")
        drafter.train().requires_grad_(True)
    return taps


def _clock(timed: bool):
    """time.perf_counter, after the device's work so far where `timed` (a GPU)."""
    def clock():
        if timed:
            torch.cuda.synchronize()
        return time.perf_counter()
    return clock


def _drafter_step(drafter: Eagle3Drafter, optimizer, rate: float, autocast, features: dict, steps: int,
                  decay: float, labels: str, grad_clip: float) -> tuple:
    """One optimizer step of one drafter on a batch's features at learning rate `rate`;
    (loss, figures), the loss None where the batch has no position to train (no step then)."""
    for group in optimizer.param_groups:
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)
    with autocast:
        loss, info = batch_loss(drafter, features, steps, decay, labels)
    if loss is None:
        return loss, info
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
    optimizer.step()
    return loss, info


class _Points:
    """The scaling points of a run: each drafter's held-out agreement after so many tokens."""

    def __init__(self, drafters: dict, held: list[dict], steps: int, autocast, started: float, log):
        self.drafters, self.held, self.steps, self.autocast = drafters, held, steps, autocast
        self.started, self.log = started, log
        self.points: list[dict] = []

    def add(self, label: str, trained: int) -> None:
        for name, (drafter, _) in self.drafters.items():
            drafter.eval()
            with self.autocast:
                measured = agreement(drafter, self.held, self.steps)
            drafter.train()
            self.points.append({"drafter": name, "tokens": trained, "at": label,
                                "seconds": round(time.perf_counter() - self.started, 1), **measured})
            self.log(json.dumps(self.points[-1]))
