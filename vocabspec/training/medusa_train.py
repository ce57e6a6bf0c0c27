"""Training Medusa heads on the target's feature shards (train.py's data and features stages).

Medusa-1's recipe with the target frozen: head k's block learns to turn the target's feature
at position i into one the LM head scores token i + k + 1 from, by cross-entropy, head k's
loss weighted 0.8^(k-1) (later tokens are harder and matter less: a deep node is accepted only
after its ancestors). The data are the target's own answers (self-distillation, Medusa-2's
remedy for data that differ from what the target writes).

As for the EAGLE drafter, the softmax runs over a candidate set per sequence rather than the
whole vocabulary (262k rows for Gemma would dominate a CPU step): the target's top candidates
at the positions sampled and at the positions each head predicts, the labels, and uniformly
drawn negatives. Each step samples `positions` positions of one sequence.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..speculation.families.medusa import MedusaHeads
from ..runtime.backend import Backend
from .train import ship_dir, training_sets

HEAD_DECAY = 0.8


def _batch(target: Backend, sequence, n_heads: int, positions: int, negatives: int,
           generator: torch.Generator):
    """(features (P, dim), labels (heads, P) as candidate indices, candidate ids) for one
    sequence; None if it is too short."""
    tokens, hidden, candidates, _ = sequence
    n = tokens.numel()
    last = n - 1 - n_heads            # position i needs tokens up to i + n_heads + 1
    if last < 1:
        return None
    picked = torch.randperm(last, generator=generator)[:positions].sort().values
    tokens = tokens.long()
    labels = torch.stack([tokens[picked + 1 + k] for k in range(1, n_heads + 1)])
    ahead = torch.cat([picked + k for k in range(n_heads + 1)])
    pool = torch.cat([candidates[ahead].flatten().long(), labels.flatten(),
                      torch.randint(target.args.vocab_size, (negatives,), generator=generator)])
    ids, inverse = torch.unique(pool, return_inverse=True)
    label_index = inverse[candidates[ahead].numel():candidates[ahead].numel() + labels.numel()]
    features = target.norm(hidden[picked].float())
    return features, label_index.view(labels.shape), ids


def head_loss(heads: MedusaHeads, head_weight: torch.Tensor, features, labels, ids) -> torch.Tensor:
    states = heads(features)                                   # (heads, P, dim)
    logits = states @ head_weight[ids].T                       # (heads, P, candidates)
    weights = torch.tensor([HEAD_DECAY ** k for k in range(heads.n_heads)])
    losses = torch.stack([F.cross_entropy(logits[k], labels[k]) for k in range(heads.n_heads)])
    return (weights * losses).sum() / weights.sum()


@torch.no_grad()
def accuracy(heads: MedusaHeads, target: Backend, sequences, limit: int = 16,
             positions: int = 256) -> dict:
    """Each head's top-1 and top-10 accuracy over the whole vocabulary, on the first
    `positions` positions of `limit` held-out sequences."""
    hits1 = torch.zeros(heads.n_heads)
    hits10 = torch.zeros(heads.n_heads)
    count = 0
    weight = target.head_weight.float()
    for tokens, hidden, _, _ in sequences[:limit]:
        n = min(positions, tokens.numel() - 1 - heads.n_heads)
        if n < 1:
            continue
        states = heads(target.norm(hidden[:n].float()))
        tokens = tokens.long()
        for k in range(heads.n_heads):
            top = torch.cat([torch.topk(rows @ weight.T, 10, dim=-1).indices for rows in states[k].split(128)])
            label = tokens[2 + k:2 + k + n]
            hits1[k] += (top[:, 0] == label).sum()
            hits10[k] += (top == label[:, None]).any(-1).sum()
        count += n
    return {"top1": [round(float(h) / max(count, 1), 4) for h in hits1],
            "top10": [round(float(h) / max(count, 1), 4) for h in hits10], "positions": count}


def train_medusa(cfg, target: Backend, train_set, heldout, log=print) -> tuple[MedusaHeads, dict]:
    """Heads trained from zero blocks on `train_set` (train.load_shards' sequences)."""
    if not train_set:
        raise ValueError("no training features: run the features stage")
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    heads = MedusaHeads.zeros(target.args.dim, cfg.medusa.heads).float().train().requires_grad_(True)
    head_weight = target.head_weight.detach().float()
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    total = len(train_set) * cfg.optim.epochs
    if cfg.optim.max_steps:
        total = min(total, cfg.optim.max_steps)
    order = list(range(len(train_set)))
    rng = random.Random(cfg.seed)
    step, history, start = 0, [], time.perf_counter()
    with tqdm(total=total, desc="medusa", unit="seq") as bar:
        while step < total:
            rng.shuffle(order)
            for index in order:
                if step >= total:
                    break
                batch = _batch(target, train_set[index], heads.n_heads, cfg.medusa.positions,
                               cfg.eagle.negatives, generator)
                step += 1
                bar.update()
                if batch is None:
                    continue
                lr = cfg.optim.lr * min(1.0, step / max(1, cfg.optim.warmup_steps)) * \
                    0.5 * (1 + math.cos(math.pi * step / total))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss = head_loss(heads, head_weight, *batch)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(heads.parameters(), cfg.optim.grad_clip)
                optimizer.step()
                history.append(float(loss.detach()))
                if step % 50 == 0:
                    bar.set_postfix(loss=f"{sum(history[-50:]) / len(history[-50:]):.3f}")
    heads = heads.eval().requires_grad_(False)
    report = {"steps": step, "train_seconds": round(time.perf_counter() - start, 1),
              "loss_first": round(sum(history[:50]) / max(1, len(history[:50])), 4),
              "loss_last": round(sum(history[-50:]) / max(1, len(history[-50:])), 4),
              "heldout": accuracy(heads, target, heldout)}
    log(f"medusa: {report}")
    return heads, report


def train_and_save(cfg, target: Backend, split: dict, report: dict, ship: bool, log) -> None:
    """The Medusa family's trainer (config.Family.trainer): train the heads on the feature
    shards, save them to `cfg.out`/medusa, and with `ship` into the package."""
    heads, figures = train_medusa(cfg, target, *training_sets(cfg, split), log=log)
    report.update(figures)
    extra = {"training": dict(report)}
    heads.save(Path(cfg.out) / "medusa", target.args, extra=extra)
    if ship:
        from ..speculation.config import default_vocab

        directory = ship_dir(cfg.model) / "medusa"
        # The shipped heads' default draft vocabulary is a measured choice: keep it.
        keep = {"draft_vocab": default_vocab(directory)} if (directory / "config.json").exists() else {}
        heads.save(directory, target.args, extra={**keep, **extra})
        log(f"shipped to {directory}")
