"""Draft LM-head strategies: which vocabulary the drafter scores, and at what cost.

A strategy turns normalised drafter states (rows, dim) into each row's top-k draft tokens
(target vocabulary ids) with their log-probabilities. Verification never looks here: it always
scores the full target vocabulary, so every strategy is lossless.

- FullVocab: the target's whole LM head (EAGLE-2).
- StaticSubset: the head's rows for a fixed ranked token list (FR-Spec from corpus
  frequencies, VocabTrim from target-generated text); the softmax runs over the subset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class FullVocab:
    name = "full"

    def __init__(self, head_weight: torch.Tensor):
        self.weight = head_weight

    def top_k(self, states: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(states, self.weight).float()
        top = torch.topk(logits, k, dim=-1)
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
        return top.indices, top.values - log_z

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (training and evaluation)."""
        return F.linear(states, self.weight).float()


class StaticSubset:
    """Draft over a fixed token list: the head's rows for those tokens, ids mapped back."""

    def __init__(self, head_weight: torch.Tensor, token_ids: torch.Tensor, name: str = "subset"):
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        vocab = head_weight.shape[0]
        if token_ids.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab:
            raise ValueError(f"draft vocabulary holds ids outside the target vocabulary [0, {vocab})")
        if torch.unique(token_ids).numel() != token_ids.numel():
            raise ValueError("draft vocabulary lists a token twice")
        self.name = name
        self.draft_to_target = token_ids.to(head_weight.device)
        self.weight = head_weight[self.draft_to_target].contiguous()

    def top_k(self, states: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(states, self.weight).float()
        k = min(k, logits.shape[-1])
        top = torch.topk(logits, k, dim=-1)
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
        return self.draft_to_target[top.indices], top.values - log_z
