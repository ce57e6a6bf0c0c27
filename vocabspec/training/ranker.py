"""SpecVocab's low-rank ranker: training by distillation (its file: draft_vocab.load_ranker).

The ranker scores every token as (W_vocab @ W_down) x with rank d' ~ d/16, sixteen times
cheaper than the LM head. It only has to put the right tokens among its top ~2048 candidates;
the exact head then scores those. It starts from the truncated SVD of the LM head (the best
rank-d' approximation of the head itself) and is distilled on the frozen drafter's states
(what it sees when drafting) towards the target's next-token distribution at the same
position (stored as the target's top candidates in the feature shards). The same loss also
trains it jointly with the drafter, as the SpecVocab paper does (`train.py`, ranker_weight).
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..speculation.vocab.draft_vocab import load_ranker, save_ranker  # noqa: F401  (training writes what drafting reads)
from ..speculation.families.eagle import EagleDrafter, draft_states, features_of


def svd_init(head_weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = head_weight.float()
    u, s, v = torch.svd_lowrank(weight, q=rank + 16, niter=4)
    down = v[:, :rank].T.contiguous()                 # (rank, d)
    vocab = (u[:, :rank] * s[:rank]).contiguous()      # (V, rank)
    return down, vocab


def starting_ranker(head_weight: torch.Tensor, rank: int,
                    init: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 copies of `init` (down, vocab), or the head's truncated SVD at `rank`."""
    if init is None:
        return svd_init(head_weight, rank)        # svd_init works in float32
    down, vocab = (t.float().clone() for t in init)
    if down.shape[0] != rank:
        raise ValueError(f"the starting ranker has rank {down.shape[0]}, not {rank}")
    return down, vocab


def teacher(target, features: torch.Tensor, candidates: torch.Tensor):
    """Target distribution over its stored top candidates at each position (features are
    already through the target's final norm)."""
    logits = torch.einsum("nd,nkd->nk", features, target.head_weight[candidates])
    return candidates, F.softmax(logits.float(), dim=-1)


def distillation_loss(states: torch.Tensor, down: torch.Tensor, vocab: torch.Tensor,
                      ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy from the teacher's distribution (`probs` over `ids`) to the ranker's
    softmax over the whole vocabulary: the whole vocabulary, because what the ranker must get
    right is which tokens fall outside its top k."""
    scores = F.linear(F.linear(states, down), vocab)
    log_probs = scores - torch.logsumexp(scores, dim=-1, keepdim=True)
    return -(probs * log_probs.gather(1, ids)).sum(-1).mean()


def hits_in_top(scores: torch.Tensor, tokens: torch.Tensor, ks) -> dict[int, int]:
    """For each k in ks: how many rows of `scores` rank their row's token among their top k."""
    top = torch.topk(scores, min(max(ks), scores.shape[-1]), dim=-1).indices
    return {k: int((top[:, :k] == tokens[:, None]).any(-1).sum()) for k in ks}


@torch.no_grad()
def recall(drafter: EagleDrafter, down, vocab, sequences, k: int = 2048) -> dict:
    """How often the target's next token, and the drafter's own top-1, are among the ranker's
    top-k candidates for the drafter's state."""

    target = drafter.target
    hits_target = hits_draft = count = 0
    for tokens, hidden, candidates, tapped in sequences:
        features = drafter.input_features(features_of(target, hidden), tapped)
        states = draft_states(drafter, tokens.long(), features)
        scores = F.linear(F.linear(states, down), vocab)
        wanted = candidates[1:, 0].long()
        drafted = F.linear(states, target.head_weight).argmax(-1)
        hits_target += hits_in_top(scores, wanted, [k])[k]
        hits_draft += hits_in_top(scores, drafted, [k])[k]
        count += wanted.numel()
    return {"recall_target": hits_target / max(count, 1), "recall_draft": hits_draft / max(count, 1),
            "positions": count}


def train_ranker(drafter: EagleDrafter, train_set, heldout, rank: int, epochs: int = 1,
                 lr: float = 2e-3, max_sequences: int | None = None, positions: int | None = 128,
                 seed: int = 0, init: tuple[torch.Tensor, torch.Tensor] | None = None, log=print):
    """Distil the ranker on `max_sequences` sequences of the feature shards.

    positions: positions per sequence that enter the loss (None: all). The loss needs the
    ranker's scores over the whole vocabulary at every position it uses, so a few positions
    from many sequences buy more variety than every position of a few: for Gemma's 262k
    vocabulary, all of a 700-token sequence's positions cost about 10 s, 128 of them 2 s.
    init: (down, vocab) to start from (default: the head's truncated SVD); a shipped ranker
    trained further this way gains recall (more passes over the data, not a new loss).
    """

    target = drafter.target
    down, vocab = starting_ranker(target.head_weight, rank, init)
    log(f"{'warm' if init is not None else 'SVD'} start: {recall(drafter, down, vocab, heldout[:16])}")
    down.requires_grad_(True)
    vocab.requires_grad_(True)
    optimizer = torch.optim.Adam([down, vocab], lr=lr)
    order = list(range(len(train_set)))
    random.Random(seed).shuffle(order)
    order = order[:max_sequences] if max_sequences else order
    generator = torch.Generator().manual_seed(seed)
    total = len(order) * epochs
    started = time.perf_counter()
    losses = []
    with tqdm(total=total, desc="ranker", unit="seq") as bar:
        for step in range(total):
            tokens, hidden, candidates, tapped = train_set[order[step % len(order)]]
            with torch.no_grad():
                features = features_of(target, hidden)
                states = draft_states(drafter, tokens.long(), drafter.input_features(features, tapped))
                rows = torch.arange(states.shape[0])
                if positions and positions < rows.numel():
                    rows = torch.randperm(rows.numel(), generator=generator)[:positions]
                states = states[rows]
                ids, probs = teacher(target, features[1:][rows], candidates[1:][rows].long())
            for group in optimizer.param_groups:
                group["lr"] = lr * (1 - step / total)
            loss = distillation_loss(states, down, vocab, ids, probs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update(1)
    down, vocab = down.detach(), vocab.detach()
    metrics = recall(drafter, down, vocab, heldout)
    metrics["train_seconds"] = round(time.perf_counter() - started, 1)
    metrics["sequences"] = len(order)
    tenth = max(1, len(losses) // 10)
    metrics["loss_first_tenth"] = round(sum(losses[:tenth]) / tenth, 4)
    metrics["loss_last_tenth"] = round(sum(losses[-tenth:]) / tenth, 4)
    metrics["positions_per_sequence"] = positions or "all"
    metrics["rank"] = rank
    metrics["warm_start"] = init is not None
    log(f"trained: {metrics}")
    return down, vocab, metrics
