"""Training an EAGLE-3 drafter (eagle3.py) on the feature shards of train.py: `--recipe eagle3`.

EAGLE-3's recipe (Li et al., 2025), against EAGLE-2's (train.py):
- the input fuses three target layers (hidden states 2, N/2 and N - 3, the features stage's
  taps), not the last layer's feature alone;
- no feature regression: the loss is the token loss alone, so the drafter's states are free
  to be whatever predicts the next tokens best;
- training-time test: each position is drafted `ttt_steps` steps deep, step k reading the
  states step k - 1 produced, with the attention a tree's level k has (the context causally,
  then its own earlier steps), and every step's loss counts;
- a compressed draft vocabulary (EAGLE-3's d2t): the head scores `draft_vocab` (a VocabTrim or
  FR-Spec list's first N tokens), and the target's distribution is restricted to those tokens.
  That makes the head, and the loss, affordable on Gemma's 262k vocabulary; positions whose
  target token lies outside it carry no loss.

The head starts as the target's own rows for the draft tokens and the final norm as the
target's, so that the drafter starts out reading its states as the target reads its own.

Two loops share that loss:
- `train` takes one sequence at a time, its features from the feature shards (or computed as
  it draws them): right on a 2-core CPU, where one sequence keeps both cores busy;
- `train_batched` takes many sequences a step, for a wide device (a GPU, eagle3_device.py, the
  device form of this recipe): sequences of similar length right-padded to (B, L), their
  features from one batched forward (slots.forward_rows, causal within each sequence) with
  the target's full-vocabulary choice at every position, and training-time test over the B x n
  rows at once (StepAttention over B blocks); padded rows carry no loss. Several drafters can
  train side by side on the same features, which is how the recipe compares two losses at one
  token count for the price of one target pass.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..speculation.families.eagle3 import Eagle3Config, Eagle3Drafter, default_aux_layers
from ..runtime.backend import Backend
from ..runtime.slots import forward_rows, pad_rows
from ..runtime.model import CustomAttention
from .config import TrainConfig
from .train import learning_rate, parse_taps, parse_token_counts, train_loop

LABELS = ("soft", "hard")


def draft_vocabulary(spec: str, target: Backend, files: Path | None) -> torch.Tensor:
    """The draft vocabulary's target ids, from a bundled token map (fr:N or trim:N)."""
    from ..speculation.vocab.draft_vocab import parse_draft_vocab
    from ..speculation.vocab.token_map import load_token_map

    kind, size = parse_draft_vocab(spec)
    if kind not in ("fr", "trim"):
        raise ValueError(f"an EAGLE-3 draft vocabulary is fr:N or trim:N, not {spec}")
    path = files / f"token_map_{kind}.pt" if files else None
    if path is None or not path.exists():
        raise ValueError(f"draft vocabulary {spec} needs {path}: make it with `vocabspec vocab`")
    ids = load_token_map(path, target.args.vocab_size)
    if size > ids.numel():
        raise ValueError(f"{path} ranks {ids.numel()} tokens, {size} asked for")
    return ids[:size].clone()


def new_drafter(target: Backend, ids: torch.Tensor, seed: int) -> Eagle3Drafter:
    a = target.args
    config = Eagle3Config(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                          intermediate_size=a.intermediate_size, n_layers=1, norm_eps=a.norm_eps,
                          rope_base=a.rope_base,
                          draft_vocab_size=ids.numel(), aux_layers=default_aux_layers(a.n_layers),
                          target_dim=a.dim)
    drafter = Eagle3Drafter.random(target, config, seed=seed, dtype=torch.float32)
    with torch.no_grad():
        drafter.draft_ids.copy_(ids)
        drafter.lm_head.weight.copy_(target.head_weight[ids.to(target.head_weight.device)].float())
        drafter.norm.weight.copy_(target.norm.weight.float())
    return drafter


def starting_drafter(target: Backend, ids: torch.Tensor, init: str, seed: int) -> Eagle3Drafter:
    """The drafter at `init` (a directory; float32), else a new one over the draft vocabulary `ids`."""
    return Eagle3Drafter.load(init, target, dtype=torch.float32) if init else new_drafter(target, ids, seed)


def drafter_from_checkpoint(path: Path, target: Backend) -> Eagle3Drafter:
    """The drafter a training checkpoint (OUT/checkpoint-eagle3.pt) holds, as `train` left it
    at that step: for measuring a run part of the way through its data."""
    from ..speculation.config import bundled_drafter_dir

    state = torch.load(path, map_location="cpu")
    config = TrainConfig.settings_of(state["config"])
    drafter = new_drafter(target, draft_vocabulary(config["draft_vocab"], target,
                                                   bundled_drafter_dir(config["model"])), config["seed"])
    drafter.load_state_dict(state["drafter"])
    return drafter.eval().requires_grad_(False)


class StepKeys:
    """The keys and values of every training-time-test step so far, differentiable: step k's
    rows see step 0's causally and their own rows of steps 1 to k (as KVCache's tree rows see
    committed and pending slots)."""

    length = 0

    def __init__(self):
        self.pending = 0
        self.keys, self.values = {}, {}

    def write(self, layer, keys, values):
        if layer in self.keys:
            keys = torch.cat([self.keys[layer], keys], dim=2)
            values = torch.cat([self.values[layer], values], dim=2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def advance(self, n):
        self.pending += n


class StepAttention(CustomAttention):
    """Training-time test's attention at step `step` over StepKeys' keys (each step's rows
    after the last): row i sees step 0's rows up to i, then row i of each later step. Computed
    as a causal product over step 0 and one dot product per later step, not as a dense mask
    over all (step + 1) n keys (three times the work at step 2, and no block skipped).

    With `sequences` > 1 a step's rows are that many sequences of equal length side by side
    (a padded batch, train_batched): each attends within its own, as if alone."""

    def __init__(self, step: int, sequences: int = 1):
        self.step = step
        self.sequences = sequences

    def attend(self, q, keys, values, scale):
        b = self.sequences
        rows = q.shape[2]
        n, group = rows // b, q.shape[1] // keys.shape[1]
        if group > 1:
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)

        def apart(t):       # (1, heads, b n, dim) -> (b, heads, n, dim)
            return t[0].unflatten(1, (b, n)).transpose(0, 1)

        def own(t):         # later steps' rows -> (b, heads, step, n, dim)
            return t[0, :, rows:].unflatten(1, (self.step, b, n)).permute(2, 0, 1, 3, 4)

        q, first_keys, first_values = apart(q), apart(keys[:, :, :rows]), apart(values[:, :, :rows])
        if self.step == 0:
            out = F.scaled_dot_product_attention(q, first_keys, first_values, is_causal=True, scale=scale)
        else:
            own_keys, own_values = own(keys), own(values)
            causal = (q @ first_keys.transpose(-1, -2)) * scale
            seen = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            causal = causal.masked_fill(~seen, float("-inf"))
            mine = (q.unsqueeze(2) * own_keys).sum(-1).transpose(2, 3) * scale   # (b, heads, n, step)
            weights = torch.softmax(torch.cat([causal, mine], dim=-1), dim=-1).to(first_values.dtype)
            out = weights[..., :n] @ first_values + \
                (weights[..., n:].transpose(2, 3).unsqueeze(-1) * own_values).sum(2)
        return out.transpose(0, 1).flatten(1, 2).unsqueeze(0)


def on_device(row, device: torch.device) -> tuple:
    """A training row (tokens, hidden, candidates, tapped), as features come (on the CPU), on
    the drafter's device."""
    return tuple(t.to(device, non_blocking=True) if t is not None else None for t in row)


def batch_loss(drafter: Eagle3Drafter, features: dict, steps: int, decay: float = 0.8,
               labels: str = "soft"):
    """Training-time test over a batch: (loss, per-step accuracy as 0-dim tensors), as one
    sequence's rows would each give it alone. Row i of step k reads token i + 1 + k and predicts token
    i + 2 + k, where that is inside its sequence and the target's choice is in the draft
    vocabulary; step k weighs decay**k (normalized)."""
    if labels not in LABELS:
        raise ValueError(f"labels are {' or '.join(LABELS)}, not {labels!r}")
    target, device, ids = drafter.target, features["tokens"].device, drafter.draft_ids
    n = features["tokens"].shape[1] - 1 - steps
    if n < 1:
        return None, {}
    with torch.no_grad(), torch.autocast(device.type, enabled=False):     # the teacher in float32
        teacher = F.linear(target.norm(features["hidden"].float()), target.head_weight[ids].float())
        in_draft = torch.zeros(target.args.vocab_size, dtype=torch.bool, device=device)
        in_draft[ids] = True
    weights = [decay ** k for k in range(steps)]
    loss, info = 0.0, {}
    for k, rows_in, logits in _test_steps(drafter, features, steps):
        logits = logits.float()
        target_logits = teacher[:, 1 + k:1 + k + n].flatten(0, 1)
        wanted = target_logits.argmax(-1)
        keep = in_draft[features["chosen"][:, 1 + k:1 + k + n]].flatten() & rows_in
        if labels == "soft":
            per_row = -(F.softmax(target_logits, -1) * F.log_softmax(logits, -1)).sum(-1)
        else:
            per_row = F.cross_entropy(logits, wanted, reduction="none")
        loss = loss + (per_row * keep).sum() / keep.sum().clamp_min(1) * (weights[k] / sum(weights))
        with torch.no_grad():     # left on the device: reading it back would wait for the step
            hit = (logits.argmax(-1) == wanted) & keep
            info[f"acc{k + 1}"] = hit.sum() / keep.sum().clamp_min(1)
    return loss, info


def _test_steps(drafter: Eagle3Drafter, features: dict, steps: int):
    """The training-time test's steps over a batch (none where its sequences are too short):
    per step k, which of the B n rows train (row i of a sequence reads its token i + 1 + k:
    inside it) and the drafter's logits over its vocabulary at every row."""
    tokens, lengths = features["tokens"], features["lengths"]
    b, width = tokens.shape
    n = width - 1 - steps
    if n < 1:
        return
    device = tokens.device
    rows_in = (torch.arange(n, device=device)[None, :] < (lengths[:, None] - 1 - steps)).flatten()
    x = drafter.input_rows(torch.cat([features["tapped"], features["hidden"]], dim=-1)[:, :n].flatten(0, 1))
    cache = StepKeys()
    for k in range(steps):
        positions = (torch.arange(n, device=device) + k).repeat(b)
        states = drafter(tokens[:, 1 + k:1 + k + n].flatten(), x, positions, cache,
                         tree_mask=StepAttention(k, sequences=b))
        yield k, rows_in, drafter.lm_head(drafter.head_input(states))
        x = states


@torch.no_grad()
def agreement(drafter: Eagle3Drafter, batches: list[dict], steps: int) -> dict:
    """Top-1 agreement with the target's next token over its whole vocabulary, at each
    training-time-test step, over held-out feature batches (the first draft step's is the
    acceptance a 1/1 tree would see on these sequences)."""
    hits, counts = [0] * steps, [0] * steps
    for features in batches:
        n = features["tokens"].shape[1] - 1 - steps
        for k, rows_in, logits in _test_steps(drafter, features, steps):
            right = drafter.draft_ids[logits.argmax(-1)] == features["chosen"][:, 1 + k:1 + k + n].flatten()
            hits[k] += int((right & rows_in).sum())
            counts[k] += int(rows_in.sum())
    return {f"top1_step{k + 1}": round(hits[k] / max(counts[k], 1), 4) for k in range(steps)}


def one_sequence(row) -> dict:
    """A training row (tokens, hidden, candidates, tapped) as a batch of one for batch_loss."""
    tokens, hidden, candidates, tapped = row
    return {"tokens": tokens.long()[None], "lengths": torch.tensor([tokens.shape[0]], device=tokens.device),
            "hidden": hidden.float()[None], "tapped": tapped.float()[None], "chosen": candidates[None, :, 0].long()}


def sequence_loss(drafter: Eagle3Drafter, tokens, hidden, candidates, tapped, steps: int,
                  decay: float = 1.0, labels: str = "soft"):
    """batch_loss over one sequence, its accuracies as floats."""
    loss, info = batch_loss(drafter, one_sequence((tokens, hidden, candidates, tapped)), steps, decay, labels)
    return loss, {k: float(v) for k, v in info.items()}


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, heldout, steps: int, limit: int = 48) -> dict:
    """agreement over held-out rows, one sequence at a time."""
    device = drafter.draft_ids.device
    return agreement(drafter, [one_sequence(on_device(row, device)) for row in heldout[:limit]], steps)


def train(cfg, target: Backend, split: dict | None = None, log=print) -> Eagle3Drafter:
    return train_loop(cfg, target, split, Eagle3Training, log).drafter


class Eagle3Training:
    """EAGLE-3's part in train.train_loop (as train.EagleTraining is EAGLE-2's): the drafter,
    the training-time-test loss of a sequence on the drafter's device, the held-out agreement a
    checkpoint records, and snapshots after cfg.eagle3.snapshot_tokens tokens."""

    checkpoint, desc, ranker = "checkpoint-eagle3.pt", "training (EAGLE-3)", None

    def __init__(self, cfg, target: Backend, train_set, heldout):
        self.cfg, self.heldout = cfg, heldout
        self.drafter = _starting_drafter(cfg, target).train().requires_grad_(True)
        self.groups = [{"params": list(self.drafter.parameters())}]
        self.snapshots = parse_token_counts(cfg.eagle3.snapshot_tokens)

    def loss(self, row, generator=None) -> tuple:
        e3 = self.cfg.eagle3
        loss, info = sequence_loss(self.drafter, *on_device(row, self.drafter.draft_ids.device), e3.ttt_steps,
                                   e3.ttt_decay, e3.labels)
        return loss, info if loss is None else info | {"loss": float(loss.detach())}

    @staticmethod
    def postfix(mean: dict) -> dict:
        return {"loss": f"{mean['loss']:.3f}", "acc1": f"{mean['acc1']:.3f}"}

    def measured(self, mean: dict) -> dict:
        return evaluate(self.drafter, self.heldout, self.cfg.eagle3.ttt_steps)


def _starting_drafter(cfg, target: Backend) -> Eagle3Drafter:
    """--init's drafter, else a new one over cfg.eagle3.draft_vocab's vocabulary; ValueError where its
    taps are not the ones the features hold."""
    from ..speculation.config import bundled_drafter_dir

    ids = draft_vocabulary(cfg.eagle3.draft_vocab, target, bundled_drafter_dir(cfg.model))
    drafter = starting_drafter(target, ids, cfg.init, cfg.seed)
    if tuple(parse_taps(cfg.features.taps)) != drafter.taps:
        raise ValueError(f"the drafter fuses the target's taps {list(drafter.taps)}; the features hold "
                         f"{cfg.features.taps or 'none'}: run the features stage with --taps "
                         f"{','.join(map(str, drafter.taps))}")
    return drafter


def train_and_save(cfg, target: Backend, split: dict, report: dict, ship: bool, log) -> None:
    """EAGLE-3's trainer (train.train_eagle with --recipe eagle3): train, measure, save to
    `cfg.out`/drafter in speculators' layout."""
    if ship:
        raise ValueError("--ship copies a drafter in the bundled EAGLE-2 layout; an EAGLE-3 drafter is "
                         "saved to --out/drafter (speculators' layout) and read with --draft-path")
    started = time.perf_counter()
    trainee = train_loop(cfg, target, split, Eagle3Training, log)     # its held-out set loaded once
    drafter = trainee.drafter
    report["train_seconds"] = round(drafter.train_seconds or time.perf_counter() - started, 1)
    report.update(evaluate(drafter, trainee.heldout, max(2, cfg.eagle3.ttt_steps)))
    log(json.dumps({k: v for k, v in report.items() if k != "config"}))
    # In the form the engine drafts with and the shipped drafters take (Q8_0 groups), as the
    # device recipe writes its own: what is measured is what would be committed.
    drafter.save(Path(cfg.out) / "drafter", layout="speculators", q8_0=True, extra={"training": dict(report)})


# ---------------------------------------------------------------- many sequences a step

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


def train_batched(target: Backend, drafters: dict[str, tuple[Eagle3Drafter, str]],
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
