"""Turning logits into the distribution we sample from, and sampling it reproducibly.

Every decoding method calls the same `target_probs`, so vanilla sampling and speculative
verification draw from exactly the same processed distribution (temperature, then top-k,
then top-p, as transformers orders them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# The seeds torch's generator takes (a negative one stands for itself plus 2**64).
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1
# The lowest temperature but 0 (greedy): logits over one below ~1e-37 pass float32's range, and
# their softmax is NaN.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 means no top-k cut
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE or self.temperature == float("inf"):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number from {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(rows, vocab) float logits -> (rows, vocab) float32 probabilities after processing."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1.0 - params.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax of one row of logits, the first index on ties (as torch.argmax).

    `max(-1)` rather than `argmax`: the same answer, and faster on this CPU; greedy decoding
    pays it every step."""
    return int(logits.max(-1).indices)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a (vocab,) distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
