"""Training an EAGLE drafter for a target model, on a CPU, in three resumable stages.

1. data:     ShareGPT conversations -> token sequences in the target's prompt format
             (chat template, or the base-model frame of `prompts.py`); held-out ones kept apart.
             Optionally (self-distillation) the target's own greedy answers to further ShareGPT
             prompts, which is the text a drafter sees at run time.
2. features: target forward passes; each shard stores the tokens, the last-layer hidden
             states (before the final norm, bfloat16; the drafter's features are these after
             the norm), the target's top candidate ids per position and, for a drafter with
             `taps`, those layers' outputs.
3. train:    EAGLE's loss: smooth-L1 regression of the next feature + 0.1 x cross-entropy
             between the target's and the drafter's next-token distributions through the
             frozen LM head. With `unroll` > 1 the drafter is also trained on its own predicted
             features (step k reads the features step k-1 predicted), as deeper tree levels do
             at run time; each step's loss counts equally. With `ranker_weight` > 0 SpecVocab's
             low-rank ranker is trained with the drafter, as the SpecVocab paper does: its
             distillation loss, weighted against the token loss, also reaches the drafter,
             whose states then become easier to rank at low rank.

The cross-entropy over the whole vocabulary (262k rows for Gemma) would dominate a CPU
training step, so it runs over a candidate set per sequence: the union of the target's top
candidates at every position plus uniformly sampled negatives. The target's distribution is
concentrated on its top tokens, so restricting both softmaxes to that set keeps the gradient
that matters; the negatives keep the drafter from putting mass outside the set.

Each stage writes its output atomically and skips work already on disk, so an interrupted run
resumes where it stopped (training resumes from its last checkpoint).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..runtime.files import load_torch_file
from .answers import read_answers, target_fingerprint, write_answers
from ..speculation.families.eagle import EagleDrafter, checked_taps, draft_states, features_of
from ..runtime.backend import Backend
from ..runtime.prompts import encode_conversation
from ..speculation.vocab.draft_vocab import load_ranker, save_ranker
from .ranker import distillation_loss, starting_ranker, teacher
from .ranker import recall as ranker_recall
from .config import TrainConfig


def _atomic_save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


# ---------------------------------------------------------------------------- 1. data

def prepare_sequences(cfg: TrainConfig, tokenizer) -> dict:
    from .sharegpt import iter_conversations

    out = Path(cfg.out) / "sequences.pt"
    # A split made with other settings is made again (the feature stage then rebuilds only the
    # shards whose sequences changed); files without settings predate this check.
    settings = {"conversations": cfg.data.conversations, "heldout": cfg.data.heldout, "max_len": cfg.data.max_len,
                "seed": cfg.seed}
    if out.exists():
        split = torch.load(out)
        if split.get("settings") == settings:
            return split
    conversations = list(iter_conversations())
    random.Random(cfg.seed).shuffle(conversations)
    wanted = cfg.data.heldout + cfg.data.conversations
    if len(conversations) < wanted:
        raise ValueError(f"ShareGPT has {len(conversations)} usable conversations, {wanted} asked for")
    split = {"heldout": [], "train": [], "heldout_ids": [], "train_ids": [], "heldout_prompts": [],
             "settings": settings}
    for index, (conv_id, turns) in enumerate(tqdm(conversations[:wanted], desc="tokenizing",
                                                  unit="conv")):
        ids = encode_conversation(tokenizer, turns, answer_open=False, example=False)[:cfg.data.max_len]
        part = "heldout" if index < cfg.data.heldout else "train"
        split[part].append(ids)
        split[part + "_ids"].append(conv_id)
        if part == "heldout":
            split["heldout_prompts"].append(encode_conversation(tokenizer, turns[:1], answer_open=True))
    split["train_tokens"] = sum(map(len, split["train"]))
    _atomic_save(split, out)
    return split


def _distill_prompts(cfg: TrainConfig, tokenizer, model_path: Path | None = None) -> list[list[int]]:
    """First user turns of ShareGPT conversations that are not held-out ones (nor training
    ones, unless `cfg.data.distill_start` is below `cfg.data.conversations`), then `cfg.data.task_prompts`
    task-style prompts, then `cfg.data.later_turns` later turns of the same conversations, then up
    to `cfg.data.self_prompts` prompts the target at `model_path` writes (each kind after the ones
    before, so that asking for more of a later kind keeps the earlier answers and their
    feature shards)."""
    from .sharegpt import iter_conversations

    conversations = list(iter_conversations())
    random.Random(cfg.seed).shuffle(conversations)
    room = cfg.data.max_len - cfg.data.distill_new_tokens
    start = cfg.data.conversations if cfg.data.distill_start < 0 else cfg.data.distill_start
    prompts = []
    for _, turns in conversations[cfg.data.heldout + start:]:
        if len(prompts) == cfg.data.self_distill:
            break
        ids = encode_conversation(tokenizer, turns[:1], answer_open=True)
        if len(ids) <= room:          # a cut prompt would lose its chat template's frame
            prompts.append(ids)
    if len(prompts) < cfg.data.self_distill:
        raise ValueError(f"ShareGPT has only {len(prompts)} unused prompts of at most {room} "
                         f"tokens, {cfg.data.self_distill} asked for")
    return (prompts + _task_prompt_ids(cfg, tokenizer, conversations[cfg.data.heldout:], room)
            + _later_turn_ids(cfg, tokenizer, conversations[cfg.data.heldout + start:], room)
            + _self_prompt_ids(cfg, tokenizer, model_path, room))


def _self_prompt_ids(cfg: TrainConfig, tokenizer, model_path: Path | None, room: int) -> list[list[int]]:
    from .self_prompts import sample_user_prompts, self_prompt_ids

    if not cfg.data.self_prompts:
        return []
    if model_path is None:
        raise ValueError("prompts the target writes (self_prompts) are sampled from the target, "
                         "which this step does not load: use `vocabspec train`")
    texts = sample_user_prompts(model_path, cfg.data.self_prompts_start, cfg.data.self_prompts, device=cfg.device,
                                batch=cfg.data.distill_batch, cache=Path(cfg.out) / "self-prompts.json")
    return self_prompt_ids(tokenizer, texts, room)


def _later_turn_ids(cfg: TrainConfig, tokenizer, conversations: list, room: int) -> list[list[int]]:
    """Prompts that end at a conversation's second or a later user turn, the turns before it
    as the context, ShareGPT's answers included: the target answering in a conversation under
    way, as chat users' follow-up questions (and Spec-Bench's second turns) have it."""
    prompts, skipped = [], 0
    for _, turns in conversations:
        for end in range(2, len(turns)):
            if len(prompts) == cfg.data.later_turns:
                return prompts
            if turns[end][0] == "user" and turns[end - 1][0] == "assistant":
                ids = encode_conversation(tokenizer, turns[:end + 1], answer_open=True)
                if len(ids) > room:
                    break                       # the later turns are longer still
                if skipped < cfg.data.later_turns_start:
                    skipped += 1
                else:
                    prompts.append(ids)
    if len(prompts) < cfg.data.later_turns:
        raise ValueError(f"ShareGPT has only {skipped + len(prompts)} later turns whose conversation "
                         f"so far fits {room} tokens, {cfg.data.later_turns_start} + {cfg.data.later_turns} "
                         "asked for")
    return prompts


def _task_prompt_ids(cfg: TrainConfig, tokenizer, conversations: list, room: int) -> list[list[int]]:
    from .task_prompts import task_prompts

    if not cfg.data.task_prompts:
        return []
    # Twice as many candidates as needed, since some are too long once tokenized.
    texts = task_prompts(conversations, 2 * cfg.data.task_prompts)
    encoded = (encode_conversation(tokenizer, [("user", text)], answer_open=True) for text in texts)
    prompts = [ids for ids in encoded if len(ids) <= room][:cfg.data.task_prompts]
    if len(prompts) < cfg.data.task_prompts:
        raise ValueError(f"ShareGPT gave only {len(prompts)} task prompts of at most {room} "
                         f"tokens, {cfg.data.task_prompts} asked for")
    return prompts


def _fast_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """float32 / bfloat16 by name; "auto": bfloat16 where the device has fast bfloat16 matmuls
    (without them a CPU emulates bfloat16, several times slower than float32)."""
    from ..speculation.families.eagle import bf16_supported

    if name == "auto":
        return torch.bfloat16 if bf16_supported(torch.device(device)) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def training_precision(cfg: TrainConfig):
    """The context a training step's forward runs in on `cfg.device`: autocast to bfloat16 for
    `cfg.optim.train_dtype` bfloat16 (the weights, gradients and optimizer stay float32; on a CPU with
    AVX-512 bf16 the step takes about half the time), else nothing."""
    import contextlib

    if cfg.optim.train_dtype not in ("float32", "bfloat16", "auto"):
        raise ValueError(f"train_dtype is float32, bfloat16 or auto, not {cfg.optim.train_dtype!r}")
    if _fast_dtype(cfg.optim.train_dtype, cfg.device) == torch.bfloat16:
        return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _load_distilled(path: Path, prompts: list[list[int]]) -> dict:
    """Answers generated so far, as {"prompts": [...], "sequences": [...]} in generation order.

    Files of the first format kept only a count of prompts done; their prompts are recovered
    as the longest current prompt that prefixes each sequence (others are dropped)."""
    if not path.exists():
        return {"prompts": [], "sequences": []}
    done = torch.load(path)
    if isinstance(done["prompts"], list):
        return done
    by_length = sorted(prompts, key=len, reverse=True)
    migrated = {"prompts": [], "sequences": []}
    for sequence in done["sequences"]:
        prompt = next((p for p in by_length if sequence[:len(p)] == p), None)
        if prompt is not None:
            migrated["prompts"].append(prompt)
            migrated["sequences"].append(sequence)
    return migrated


def distill_sequences(cfg: TrainConfig, tokenizer, model_path: Path) -> list[list[int]]:
    """Prompt + the target's greedy answer, for each prompt of `_distill_prompts`.

    Generation runs on the batch engine (`_generate_answers`). Answers are kept per prompt and
    the file is rewritten as they come, so an interrupted run resumes where it stopped and a
    later run asking for more prompts generates only the new ones (they come after the old
    answers, so the old feature shards stay valid). With `cfg.data.answers`, the
    archive's answers (answers.py) come first, and whatever this work directory holds that the
    archive lacks is added to it.
    """
    out = Path(cfg.out) / "distilled.pt"
    prompts = _distill_prompts(cfg, tokenizer, model_path)
    done = _load_distilled(out, prompts)
    finished = {tuple(p) for p in done["prompts"]}
    archived = {}
    if cfg.data.answers:
        fingerprint = target_fingerprint(model_path)
        archived = read_answers(Path(cfg.data.answers), fingerprint, cfg.data.distill_new_tokens)
        taken = [p for p in prompts if tuple(p) not in finished and tuple(p) in archived]
        for prompt in taken:
            done["prompts"].append(prompt)
            done["sequences"].append(archived[tuple(prompt)])
            finished.add(tuple(prompt))
        if taken:
            _atomic_save(done, out)
    todo = sorted((p for p in prompts if tuple(p) not in finished), key=len)
    if cfg.data.answers:
        print(f"self-distillation: {len(prompts) - len(todo)} of {len(prompts)} answers from the "
              f"archive and this work directory, {len(todo)} to generate")
        if todo and not cfg.data.generate_answers:
            raise ValueError(f"{len(todo)} of {len(prompts)} answers are neither in the archive "
                             f"{cfg.data.answers} nor in {cfg.out}: generating them takes the target "
                             "hours on a CPU; pass --generate-answers to do it (they join the archive)")
    generator = "this work directory's earlier run"
    if todo:
        generator = _generate_answers(cfg, model_path, todo, done, out)
    if cfg.data.answers:
        new = [(p, s) for p, s in zip(done["prompts"], done["sequences"]) if tuple(p) not in archived]
        written = write_answers(Path(cfg.data.answers), [p for p, _ in new], [s for _, s in new],
                                fingerprint, cfg.data.distill_new_tokens, generator)
        if written:
            print(f"archived {written}")   # its name counts the answers, repeats stored once
    wanted = {tuple(p) for p in prompts}
    return [s for p, s in zip(done["prompts"], done["sequences"]) if tuple(p) in wanted]


def _generator_name(lm) -> str:
    from importlib.metadata import version

    model = lm.engine.model
    return f"vocabspec {version('vocabspec')} batch engine, greedy, {model.weights} weights on {model.runs_on}"


def _generate_answers(cfg: TrainConfig, model_path: Path, todo: list[list[int]], done: dict,
                      out: Path) -> str:
    """The target's greedy answers to `todo`, appended to `done` as they finish (saved to `out`
    every SAVE_SECONDS, so an interrupted run loses at most those minutes: the file holds every
    answer so far, and at millions of tokens writing it takes seconds). They come from the
    batch engine (batch.py) in the run-time format a user decodes with: `cfg.data.distill_batch`
    requests decode together, each exactly as it would alone, so an answer does not depend on
    the batch, and it is the text the drafter will meet. An answer keeps the end-of-sequence
    token that ended it; a base model's ends at its stop string. Returns the generator's name."""
    from ..serving.api import load
    from ..decoding.batch import BatchLimits
    from ..decoding.generate import GenerationConfig
    from ..runtime.prompts import stop_strings

    lm = load(str(model_path), device=cfg.device)
    config = GenerationConfig(max_new_tokens=cfg.data.distill_new_tokens, stop=stop_strings(lm.tokenizer))
    window = min(max(map(len, todo)) + cfg.data.distill_new_tokens + 1, lm.engine.model.args.max_seq_len)
    batch = lm.batch(BatchLimits(max_batch=cfg.data.distill_batch, max_waiting=2 * cfg.data.distill_batch, window=window))
    bar = tqdm(total=len(todo), desc="self-distillation", unit="answer")
    queue, running, unsaved, generated, started = list(reversed(todo)), [], 0, 0, time.perf_counter()
    saved = started
    while queue or running:
        while queue and len(running) < 2 * cfg.data.distill_batch:
            prompt = queue.pop()
            running.append((prompt, batch.submit(prompt, config)))
        batch.run_once()
        finished = [item for item in running if item[1].done.is_set()]   # steps run on this thread
        running = [item for item in running if not item[1].done.is_set()]
        for prompt, request in finished:
            result = request.wait()
            answer = result.tokens + ([result.eos_token] if result.stop_reason == "eos" else [])
            done["prompts"].append(prompt)
            done["sequences"].append(prompt + answer)
            generated += len(answer)
            unsaved += 1
            bar.update(1)
        if unsaved and (time.perf_counter() - saved >= SAVE_SECONDS or not (queue or running)):
            _atomic_save(done, out)
            unsaved, saved = 0, time.perf_counter()
            bar.set_postfix(answer_tok_s=f"{generated / (time.perf_counter() - started):.0f}")
    bar.close()
    batch.close()
    return _generator_name(lm)


SAVE_SECONDS = 120.0      # between saves of the self-distillation file


# ---------------------------------------------------------------------------- 2. features

def _shard_plan(sequences: list[list[int]], shard_tokens: int) -> list[tuple[int, int]]:
    plan, start, size = [], 0, 0
    for i, seq in enumerate(sequences):
        size += len(seq)
        if size >= shard_tokens:
            plan.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(sequences):
        plan.append((start, len(sequences)))
    return plan


@torch.inference_mode()
def _features(model: Backend, cache, ids: list[int], top: int, taps: tuple[int, ...] = ()):
    cache.reset()
    tokens = torch.tensor(ids, dtype=torch.long, device=model.device)
    positions = torch.arange(len(ids), device=model.device)
    hidden, tapped = model.tree_forward(tokens, positions, cache, taps=taps)
    cache.discard()
    candidates = torch.cat([torch.topk(model.lm_head(rows), top, dim=-1).indices
                            for rows in hidden.split(256)])
    tapped = tapped.to(torch.bfloat16).cpu() if taps else None
    return hidden.to(torch.bfloat16).cpu(), candidates.to(torch.int32).cpu(), tapped


def parse_token_counts(text: str) -> dict[str, int]:
    """{"1.9M": 1900000, ...} from "1.9M,5.7M" (k and M scale; plain counts too)."""
    counts = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        scale = {"k": 1e3, "M": 1e6}.get(item[-1], 1)
        try:
            counts[item] = int(float(item[:-1] if scale != 1 else item) * scale)
        except ValueError:
            raise ValueError(f"token counts are numbers with an optional k or M, not {item!r}") from None
        if counts[item] <= 0:
            raise ValueError(f"a token count must be positive, not {item!r}")
    return counts


def parse_taps(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted(int(t) for t in text.split(",") if t.strip()))
    except ValueError:
        raise ValueError(f"taps must be layer indices separated by commas, not {text!r}") from None


def _shard_matches(path: Path, sequences: list[list[int]], taps: tuple[int, ...] = ()) -> bool:
    """Whether an existing shard holds exactly these sequences (a sequence list that grew, as
    self-distillation asked for more answers, changes its last shard) with these taps (any taps
    serve a run without them: it reads the last layer's states only)."""
    if not path.exists():
        return False
    shard = load_torch_file(path, mmap=True)
    if taps and tuple(shard.get("taps", ())) != taps:
        return False
    tokens = shard["tokens"]
    return len(tokens) == len(sequences) and all(t.tolist() == s for t, s in zip(tokens, sequences))


def extract_features(cfg: TrainConfig, model: Backend, split: dict) -> list[Path]:
    """Write shards `features/{heldout,train,distill}-NNNNN.pt`; existing shards are kept."""
    directory = Path(cfg.out) / "features"
    directory.mkdir(parents=True, exist_ok=True)
    cache = model.new_cache(cfg.data.max_len)
    taps = checked_taps(parse_taps(cfg.features.taps), model)
    paths = []
    for part in ("heldout", "train", "distill"):
        sequences = split.get(part, [])
        plan = _shard_plan(sequences, cfg.features.shard_tokens)
        todo = [(n, a, b) for n, (a, b) in enumerate(plan)
                if not _shard_matches(directory / f"{part}-{n:05d}.pt", sequences[a:b], taps)]
        for stale in sorted(directory.glob(f"{part}-*.pt"))[len(plan):]:
            stale.unlink()          # left by a longer sequence list than this run's
        paths += [directory / f"{part}-{n:05d}.pt" for n in range(len(plan))]
        total = sum(len(s) for _, a, b in todo for s in sequences[a:b])
        with tqdm(total=total, desc=f"features ({part})", unit="tok", unit_scale=True) as bar:
            for n, a, b in todo:
                shard = {"tokens": [], "hidden": [], "candidates": [], "taps": list(taps), "tapped": []}
                for ids in sequences[a:b]:
                    hidden, candidates, tapped = _features(model, cache, ids, cfg.features.top_candidates, taps)
                    shard["tokens"].append(torch.tensor(ids, dtype=torch.int32))
                    shard["hidden"].append(hidden)
                    shard["candidates"].append(candidates)
                    shard["tapped"].append(tapped)
                    bar.update(len(ids))
                _atomic_save(shard, directory / f"{part}-{n:05d}.pt")
    return paths


MIN_TOKENS = 3            # a sequence shorter than this trains nothing (shards and online alike)


def load_shards(cfg: TrainConfig, part: str) -> list[tuple]:
    """(tokens, hidden, candidates, tapped) per sequence; tapped is None in shards without taps
    and in a run without them."""
    sequences = []
    taps = parse_taps(cfg.features.taps)
    for path in sorted((Path(cfg.out) / "features").glob(f"{part}-*.pt")):
        shard = load_torch_file(path)
        if taps and tuple(shard.get("taps", ())) != taps:
            raise ValueError(f"{path} holds taps {shard.get('taps', [])}, the run asks for "
                             f"{list(taps)}: run the features stage again")
        tapped = (shard.get("tapped") if taps else None) or [None] * len(shard["tokens"])
        sequences += list(zip(shard["tokens"], shard["hidden"], shard["candidates"], tapped))
    return [s for s in sequences if s[0].numel() >= MIN_TOKENS]


# ---------------------------------------------------------------------------- 3. train

def feature_std(target: Backend, sequences, limit: int = 64) -> torch.Tensor:
    """Per-dimension std of the features. A few dimensions are far larger than the rest;
    regressing and adding noise in units of each dimension's std keeps them from drowning
    the others."""
    rows = torch.cat([features_of(target, hidden) for _, hidden, *_ in sequences[:limit]])
    return rows.std(0).clamp_min(1e-4)


def sequence_loss(drafter: EagleDrafter, tokens, hidden, candidates, cfg: TrainConfig,
                  std: torch.Tensor, generator: torch.Generator | None = None,
                  ranker: tuple[torch.Tensor, torch.Tensor] | None = None,
                  tapped: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The loss of one sequence; `ranker` (down, vocab) adds the ranker's distillation loss on
    `cfg.ranker.positions` positions of each step; `tapped`: the target's tapped layer outputs,
    for a drafter with taps."""
    target = drafter.target
    tokens = tokens.long()
    features = features_of(target, hidden)
    inputs = features
    if cfg.eagle.noise > 0 and generator is not None:
        inputs = features + (torch.rand(features.shape, generator=generator) * 2 - 1) * (cfg.eagle.noise * std)
    inputs = drafter.input_features(inputs, tapped)
    wanted = features[1:]
    head = target.head_weight
    if cfg.eagle.full_vocab_loss:
        rows = head
    else:
        pool = [candidates[1:].reshape(-1).long()]
        if cfg.eagle.negatives:
            pool.append(torch.randint(head.shape[0], (cfg.eagle.negatives,), generator=generator))
        rows = head[torch.unique(torch.cat(pool))]
    with torch.no_grad(), torch.autocast("cpu", enabled=False):     # the teacher in float32
        target_probs = F.softmax(F.linear(wanted, rows).float(), dim=-1)
        if ranker is not None:
            ranker_ids, ranker_probs = teacher(target, wanted, candidates[1:].long())
    regression = classification = ranking = 0.0
    info = {}
    steps = min(cfg.eagle.unroll, tokens.shape[0] - 2)
    for step in range(steps):
        predicted = draft_states(drafter, tokens, inputs)    # row i predicts features[i + 1]
        # Row i of step k has read k predicted features in a chain; the first k rows have not.
        mine = predicted[step:]
        step_regression = F.smooth_l1_loss(mine / std, wanted[step:] / std)
        draft_log_probs = F.log_softmax(F.linear(mine, rows).float(), dim=-1)
        step_classification = -(target_probs[step:] * draft_log_probs).sum(-1).mean()
        regression = regression + step_regression / steps
        classification = classification + step_classification / steps
        if ranker is not None:
            picked = torch.randperm(mine.shape[0], generator=generator)[:cfg.ranker.positions]
            ranking = ranking + distillation_loss(mine[picked], *ranker, ranker_ids[step:][picked],
                                                  ranker_probs[step:][picked]) / steps
        with torch.no_grad():
            accuracy = (draft_log_probs.argmax(-1) == target_probs[step:].argmax(-1)).float().mean()
        info["accuracy" if step == 0 else f"accuracy_step{step + 1}"] = float(accuracy)
        inputs = torch.cat([inputs[:1], predicted])
    loss = regression + cfg.eagle.cls_weight * (classification + cfg.ranker.weight * ranking)
    if ranker is not None:
        info["ranker"] = float(ranking.detach())
    return loss, {"regression": float(regression.detach()),
                  "classification": float(classification.detach()),
                  **info, "candidates": rows.shape[0]}


@torch.no_grad()
def evaluate(drafter: EagleDrafter, heldout, limit: int = 48, steps: int = 2) -> dict:
    """Next-token top-1 agreement with the target over the full vocabulary, held-out data.

    top1_step1: from the target's own features (the first draft token of each step);
    top1_stepK: from a chain of K - 1 features the drafter predicted itself, as tree level K
    reads them (the same chain as the unrolled loss's step K).
    """
    target = drafter.target
    head = target.head_weight
    hits, counts = [0] * steps, [0] * steps
    for tokens, hidden, candidates, tapped in heldout[:limit]:
        tokens, features = tokens.long(), features_of(target, hidden)
        wanted = candidates[:, 0].long()          # target argmax at each position
        inputs = drafter.input_features(features, tapped)
        for step in range(min(steps, tokens.shape[0] - 2)):
            predicted = draft_states(drafter, tokens, inputs)
            mine = predicted[step:]               # rows that have read `step` predictions
            hits[step] += int((F.linear(mine, head).argmax(-1) == wanted[step + 1:]).sum())
            counts[step] += mine.shape[0]
            inputs = torch.cat([inputs[:1], predicted])
    return {f"top1_step{k + 1}": hits[k] / max(counts[k], 1) for k in range(steps)}


def _scale_fc_to_inputs(drafter: EagleDrafter, feature_std: torch.Tensor) -> None:
    """Data-dependent start: divide fc's input columns by each input dimension's std.

    Token embeddings are much smaller than the features (SmolLM2: std 0.14 vs 2.0), so with a
    plain random start the new token barely reaches the layer and takes many steps to be heard.
    Rescaling the weights (not the inputs) keeps EAGLE's architecture and checkpoint layout."""
    target = drafter.target
    with torch.no_grad():
        ids = torch.arange(0, target.args.vocab_size, max(1, target.args.vocab_size // 8192),
                           device=target.device)
        embed_std = target.embed_tokens(ids).float().std(0).clamp_min(1e-4)
        scale = torch.cat([1 / embed_std, 1 / feature_std]).to(drafter.fc.weight)
        drafter.fc.weight.mul_(scale[None, :])


def _run_identity(config: dict) -> dict:
    """The settings that make two training runs the same run (resumable from each other)."""
    return {k: v for k, v in TrainConfig.settings_of(config).items()
            if k not in ("max_steps", "checkpoint_every", "out", "answers", "generate_answers",
                         "online_features", "snapshot_tokens", "device")}


def resumable(checkpoint: Path, cfg: TrainConfig, log=print) -> dict | None:
    """The state saved at `checkpoint` by this same run (`_run_identity`), to resume from; a
    checkpoint of another run (say, the one --init starts from) is moved aside, kept."""
    if not checkpoint.exists():
        return None
    state = torch.load(checkpoint, map_location="cpu")
    if _run_identity(state["config"]) == _run_identity(cfg.record()):
        return state
    kept = checkpoint.with_name(f"{checkpoint.stem}-{time.strftime('%Y%m%d-%H%M%S')}.pt")
    checkpoint.replace(kept)
    log(f"{checkpoint} belongs to a run with other settings: moved to {kept.name}")
    return None


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then a cosine down to a tenth of the peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class OnlineFeatures:
    """The features stage's rows for `sequences`, computed by the extractor when training draws
    a sequence instead of read from a shard: (tokens, hidden, candidates, tapped), as
    `load_shards` gives them, bit for bit.

    One epoch costs the same target forwards as extracting shards once, and nothing is stored.
    That is what large data needs: with EAGLE-3's taps a shard holds about 4.7 kB a token, so
    twenty million tokens would take about 90 GB of disk, and `load_shards` holds every shard
    in memory."""

    def __init__(self, extractor: Backend, sequences: list[list[int]], cfg: TrainConfig):
        self.extractor = extractor
        self.sequences = [s for s in sequences if len(s) >= MIN_TOKENS]
        self.top = cfg.features.top_candidates
        self.taps = checked_taps(parse_taps(cfg.features.taps), extractor)
        self.cache = extractor.new_cache(max(map(len, self.sequences), default=1))

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        ids = self.sequences[index]
        with torch.no_grad():
            hidden, candidates, tapped = _features(self.extractor, self.cache, ids, self.top, self.taps)
        return torch.tensor(ids, dtype=torch.int32), hidden, candidates, tapped


def online_sets(cfg: TrainConfig, extractor: Backend, split: dict) -> tuple:
    """`training_sets`' pair for `split` with online features: the training and distilled
    sequences as drawn, the held-out ones computed now (every evaluation reads them)."""
    return (OnlineFeatures(extractor, split["train"] + split.get("distill", []), cfg),
            OnlineFeatures(extractor, split["heldout"], cfg)[:])


def training_sets(cfg: TrainConfig, split: dict | None) -> tuple:
    """(training sequences' features, held-out ones): `split["features"]` where `run` put
    online ones (`OnlineFeatures`, the held-out ones computed once), else the feature
    shards; ValueError if there are none."""
    if split and "features" in split:
        return split["features"]
    train_set = load_shards(cfg, "train") + load_shards(cfg, "distill")
    if not train_set:
        raise ValueError(f"no training features under {Path(cfg.out) / 'features'}: run the features "
                         "stage, or train with --online-features")
    return train_set, load_shards(cfg, "heldout")


def train_loop(cfg: TrainConfig, target: Backend, split: dict | None, kind, log=print):
    """The training loop of every EAGLE drafter kind; returns `kind(cfg, target, train_set,
    heldout)`, the kind's part (EagleTraining's), its drafter trained.

    Each optimizer step reads its share of the epoch's shuffle (`epoch_batch`) at the
    scheduled learning rate (`learning_rate`, times a parameter group's "lr_scale"), its
    gradients accumulated over those sequences' losses, each group's clipped. Every
    checkpoint_every steps the drafter is measured on the held-out data and the run is saved
    to OUT/`kind.checkpoint`, where a later run of the same settings resumes (`resumable`)."""
    train_set, heldout = training_sets(cfg, split)
    torch.manual_seed(cfg.seed)
    trainee = kind(cfg, target, train_set, heldout)
    drafter, run = trainee.drafter, _Run(cfg, trainee)
    optimizer = run.optimizer
    steps_per_epoch = math.ceil(len(train_set) / cfg.optim.accumulate)
    total = steps_per_epoch * cfg.optim.epochs
    if cfg.optim.max_steps:
        total = min(total, cfg.optim.max_steps)
    run.resume(total, log)
    generator = torch.Generator().manual_seed(cfg.seed + run.step)     # the losses' random draws
    resumed_tokens, mean = run.trained, {}
    bar = tqdm(total=total, initial=run.step, desc=trainee.desc, unit="step")
    while run.step < total:
        batch = epoch_batch(cfg, run.step, steps_per_epoch, len(train_set))
        rate = learning_rate(run.step, total, cfg.optim.lr, cfg.optim.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = rate * group.get("lr_scale", 1.0)
        optimizer.zero_grad(set_to_none=True)
        stats = []
        for i in batch:
            row = train_set[i]
            with training_precision(cfg):
                loss, info = trainee.loss(row, generator)
            if loss is None:            # a sequence without a position to train adds none
                continue
            (loss / len(batch)).backward()
            stats.append(info)
            run.trained += row[0].numel()
        for group in optimizer.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], cfg.optim.grad_clip)
        optimizer.step()
        run.step += 1
        run.keep_snapshots(log)
        if stats:
            mean = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
            bar.set_postfix(**trainee.postfix(mean),
                            tok_s=f"{(run.trained - resumed_tokens) / (time.perf_counter() - run.started):.0f}")
        bar.update(1)
        if run.step % cfg.optim.checkpoint_every == 0 or run.step == total:
            drafter.eval()
            run.history.append({"step": run.step, **trainee.measured(mean)})
            drafter.train()
            log(json.dumps(run.history[-1]))
            _atomic_save(run.state(), run.checkpoint)
    bar.close()
    drafter.eval().requires_grad_(False)
    # Training time over every part of this run (resumed runs included).
    drafter.train_seconds = torch.load(run.checkpoint, map_location="cpu").get("seconds") \
        if run.checkpoint.exists() else None
    drafter.trained_ranker = tuple(t.detach() for t in trainee.ranker) if trainee.ranker is not None else None
    return trainee


class _Run:
    """Where a training run stands, as its checkpoint (OUT/`trainee.checkpoint`) records it:
    the drafter, its optimizer (AdamW over the trainee's parameter groups) and the ranker where
    one trains with it, the step, the held-out history, the training seconds and tokens over
    every part of the run (resumed ones included)."""

    def __init__(self, cfg: TrainConfig, trainee):
        self.cfg, self.trainee, self.checkpoint = cfg, trainee, Path(cfg.out) / trainee.checkpoint
        self.optimizer = torch.optim.AdamW(trainee.groups, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                           betas=(0.9, 0.95))
        self.step, self.history, self.seconds_before, self.trained = 0, [], 0.0, 0

    def resume(self, total: int, log) -> None:
        """Continue from the checkpoint where it is this run's (`resumable`), else start afresh;
        this part's clock starts."""
        state = resumable(self.checkpoint, self.cfg, log)
        if state is not None:
            self.trainee.drafter.load_state_dict(state["drafter"])
            if self.trainee.ranker is not None:
                with torch.no_grad():
                    for param, saved in zip(self.trainee.ranker, state["ranker"]):
                        param.copy_(saved)
            self.optimizer.load_state_dict(state["optimizer"])
            self.step, self.history = state["step"], state["history"]
            self.seconds_before, self.trained = state.get("seconds", 0.0), state.get("tokens", 0)
            log(f"resuming from step {self.step}/{total}")
        self.started = time.perf_counter()

    def state(self, with_optimizer=True) -> dict:
        ranker = self.trainee.ranker
        return {"drafter": self.trainee.drafter.state_dict(), "step": self.step, "history": self.history,
                "ranker": [t.detach() for t in ranker] if ranker is not None else None, "config": self.cfg.record(),
                "seconds": self.seconds_before + time.perf_counter() - self.started, "tokens": self.trained,
                **({"optimizer": self.optimizer.state_dict()} if with_optimizer else {})}

    def keep_snapshots(self, log) -> None:
        """The run as it stood after each of the kind's snapshot token counts, once it has
        passed it (CHECKPOINT-at-COUNT.pt, without the optimizer)."""
        for label, count in self.trainee.snapshots.items():
            kept = self.checkpoint.with_name(f"{self.checkpoint.stem}-at-{label}.pt")
            if self.trained >= count and not kept.exists():
                _atomic_save(self.state(with_optimizer=False), kept)
                log(f"kept the drafter after {self.trained} tokens (step {self.step}) in {kept.name}")


class EagleTraining:
    """EAGLE-2's part in `train_loop`: the drafter and SpecVocab's ranker where one trains with
    it (None: none; its own parameter group), the loss of a sequence, the figures a checkpoint
    records. Other kinds (eagle3_train.Eagle3Training) provide the same."""

    checkpoint, desc, snapshots = "checkpoint.pt", "training", {}

    def __init__(self, cfg: TrainConfig, target: Backend, train_set, heldout):
        self.cfg, self.heldout = cfg, heldout
        self.std = feature_std(target, train_set)
        self.drafter = _starting_drafter(cfg, target, self.std).float().train().requires_grad_(True)
        self.ranker = _start_ranker(cfg, target) if cfg.ranker.weight > 0 else None
        self.groups = [{"params": list(self.drafter.parameters()), "lr_scale": 1.0}]
        if self.ranker is not None:
            self.groups.append({"params": list(self.ranker), "lr_scale": cfg.ranker.lr / cfg.optim.lr,
                                "weight_decay": 0.0})

    def loss(self, row, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        tokens, hidden, candidates, tapped = row
        return sequence_loss(self.drafter, tokens, hidden, candidates, self.cfg, self.std, generator,
                             self.ranker, tapped)

    @staticmethod
    def postfix(mean: dict) -> dict:
        return {"acc": f"{mean['accuracy']:.3f}", "cls": f"{mean['classification']:.2f}",
                "reg": f"{mean['regression']:.3f}"}

    def measured(self, mean: dict) -> dict:
        """A checkpoint's figures: the training batch's means and the held-out ones (the
        ranker's recall too where one trains)."""
        metrics = {"train": mean, **evaluate(self.drafter, self.heldout, steps=max(2, self.cfg.eagle.unroll))}
        if self.ranker is not None:
            metrics["ranker"] = ranker_recall(self.drafter, *(t.detach() for t in self.ranker), self.heldout[:16])
        return metrics


def train_drafter(cfg: TrainConfig, target: Backend, split: dict | None = None, log=print) -> EagleDrafter:
    return train_loop(cfg, target, split, EagleTraining, log).drafter


def epoch_batch(cfg: TrainConfig, step: int, steps_per_epoch: int, size: int) -> list[int]:
    """The indices of the training sequences optimizer step `step` reads: the step's share
    (cfg.optim.accumulate of them) of its epoch's seeded shuffle of `size` sequences."""
    epoch, index = divmod(step, steps_per_epoch)
    order = list(range(size))
    random.Random(cfg.seed + epoch).shuffle(order)
    return order[index * cfg.optim.accumulate:(index + 1) * cfg.optim.accumulate]


def _starting_drafter(cfg: TrainConfig, target: Backend, std: torch.Tensor) -> EagleDrafter:
    """The drafter training starts from: --init's, grown to cfg.eagle.layers and given the taps it
    lacks (ValueError where it has other taps or more layers), else a random one whose fc is
    scaled to the features' std."""
    taps = parse_taps(cfg.features.taps)
    if cfg.init:
        drafter = EagleDrafter.load(cfg.init, target)
        if drafter.taps != taps:
            if drafter.taps:
                raise ValueError(f"--init {cfg.init} fuses layers {list(drafter.taps)}, this run "
                                 f"asks for {list(taps)}")
            drafter.add_taps(taps)
        if len(drafter.layers) > cfg.eagle.layers:
            raise ValueError(f"--init {cfg.init} has {len(drafter.layers)} layers, this run "
                             f"asks for {cfg.eagle.layers}")
        while len(drafter.layers) < cfg.eagle.layers:
            drafter.add_layer()
    else:
        drafter = EagleDrafter.random(target, seed=cfg.seed, n_layers=cfg.eagle.layers)
        _scale_fc_to_inputs(drafter, std)
        if taps:                # fc's start is scaled to the last-layer feature it first sees
            drafter.add_taps(taps)
    return drafter


def _start_ranker(cfg: TrainConfig, target: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecVocab's ranker (down, vocab) in float32, as trainable tensors."""
    head = target.head_weight
    init = load_ranker(cfg.ranker.init, head) if cfg.ranker.init else None
    rank = cfg.ranker.rank or (init[0].shape[0] if init else max(1, target.args.dim // 16))
    return tuple(t.requires_grad_(True) for t in starting_ranker(head, rank, init))


# ---------------------------------------------------------------------------- the pipeline

def measure_tau(drafter: EagleDrafter, target: Backend, prompts: list[list[int]],
                max_new_tokens: int = 64) -> float:
    """Mean accepted length (bonus token counted) of greedy EAGLE-2 decoding on a few prompts."""
    from ..speculation.families.eagle import EagleProposer
    from ..decoding.generate import GenerationConfig
    from ..decoding.batch import Engine

    # The trainer's target runs on torch's kernels, where drafting is refused as inexact; tau only
    # counts accepted tokens, and rounding differences barely move it.
    engine = Engine(target, None, EagleProposer(drafter), allow_inexact=True)
    lengths = []
    for ids in prompts:
        result = engine.generate(ids, GenerationConfig(max_new_tokens=max_new_tokens))
        lengths += [s.accept_length for s in result.steps]
    return sum(lengths) / max(len(lengths), 1)


def ship_dir(model_name: str) -> Path:
    return Path(__file__).parents[1] / "drafters" / model_name


def trainer_of(name: str):
    """The trainer that the drafting family `name` registers (config.Family.trainer)."""
    import importlib

    from ..speculation.config import FAMILIES

    family = FAMILIES.get(name)
    if family is None or not family.trainable:
        trainable = ", ".join(f.name for f in FAMILIES.values() if f.trainable)
        raise ValueError(f"no trainer for drafter {name!r} (trainable: {trainable})")
    module, _, function = family.trainer.partition(":")
    return getattr(importlib.import_module(module), function)


def run(cfg: TrainConfig, stages=("data", "features", "train"), ship: bool = False,
        log=print) -> dict:
    from ..runtime.loading import load_model, resolve_model_path
    from ..runtime.tokenizer import load_tokenizer

    train_family = trainer_of(cfg.drafter)
    check_device(cfg, stages)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.record(), indent=2))
    report: dict = {"config": cfg.record()}
    model_path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(model_path)
    t0 = time.perf_counter()
    split = prepare_sequences(cfg, tokenizer)
    report["train_sequences"] = len(split["train"])
    report["train_tokens"] = split["train_tokens"]
    if cfg.data.self_distill or cfg.data.task_prompts or cfg.data.later_turns or cfg.data.self_prompts:
        split["distill"] = distill_sequences(cfg, tokenizer, model_path)
        report["distill_sequences"] = len(split["distill"])
        report["distill_tokens"] = sum(map(len, split["distill"]))
        report["distill_seconds"] = round(time.perf_counter() - t0, 1)
    if cfg.data.archive_sequences:
        split["distill"] = split.get("distill", []) + archive_sequences(cfg, model_path)
        report["archive_sequences"] = cfg.data.archive_sequences
    if "features" in stages or "train" in stages:
        if cfg.features.feature_dtype == "runtime":   # the states drafting reads (kept in bfloat16)
            extractor, _ = load_model(cfg.model, max_seq_len=cfg.data.max_len + 8, device=cfg.device)
        else:
            fast = {torch.float32: "f32", torch.bfloat16: "bf16"}[_fast_dtype(cfg.features.feature_dtype, cfg.device)]
            extractor, _ = load_model(cfg.model, weights=fast, backend="torch", max_seq_len=cfg.data.max_len + 8,
                                      device=cfg.device)
        if cfg.drafter == "eagle3" and not cfg.features.taps:     # EAGLE-3's fused layers, unless named
            cfg.features.taps = ",".join(map(str, default_eagle3_taps(extractor.args.n_layers)))
            (out / "config.json").write_text(json.dumps(cfg.record(), indent=2))
            report["config"] = cfg.record()
        if cfg.features.online_features:     # computed as training draws them: kept for the train stage
            split["features"] = online_sets(cfg, extractor, split)
        else:
            t1 = time.perf_counter()
            extract_features(cfg, extractor, split)
            report["features_seconds"] = round(time.perf_counter() - t1, 1)
        del extractor
    if "train" in stages:
        target, _ = load_model(cfg.model, max_seq_len=4096, backend="torch", device=cfg.device)
        train_family(cfg, target, split, report, ship, log)
        report["total_seconds"] = round(time.perf_counter() - t0, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def check_device(cfg: TrainConfig, stages) -> None:
    """ValueError, before any work, for a device that is not here or a family that trains only
    on the CPU (EAGLE-3, the large-data recipe, trains anywhere; every stage's data does)."""
    try:
        device = torch.device(cfg.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device is cpu, cuda or cuda:N, not {cfg.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {cfg.device}: this torch sees no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {cfg.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type != "cpu" and "train" in stages and cfg.drafter != "eagle3":
        raise ValueError(f"--device {cfg.device} trains --drafter eagle3; {cfg.drafter} trains on the "
                         "CPU (its data and features stages run on any device)")


def default_eagle3_taps(n_layers: int) -> tuple[int, ...]:
    """The taps (outputs of layers) holding EAGLE-3's default fused hidden states 2, N/2, N - 3."""
    from ..speculation.families.eagle3 import default_aux_layers

    return tuple(sorted({i - 1 for i in default_aux_layers(n_layers) if i < n_layers}))


def train_eagle(cfg: TrainConfig, target: Backend, split: dict, report: dict, ship: bool, log) -> None:
    """The EAGLE family's trainer (config.Family.trainer): train the drafter on the feature
    shards, measure it, save it to `cfg.out`/drafter, and with `ship` into the package."""
    out = Path(cfg.out)
    started = time.perf_counter()
    trainee = train_loop(cfg, target, split, EagleTraining, log)      # its held-out set loaded once
    drafter, heldout, seconds = trainee.drafter, trainee.heldout, trainee.drafter.train_seconds
    report["train_seconds"] = round(time.perf_counter() - started if seconds is None else seconds, 1)
    report.update(evaluate(drafter, heldout, steps=max(2, cfg.eagle.unroll)))
    report["tau_heldout_prompts"] = round(measure_tau(drafter, target,
                                                      split["heldout_prompts"][:4]), 3)
    log(json.dumps({k: v for k, v in report.items() if k != "config"}))
    if drafter.trained_ranker is not None:
        report["ranker"] = ranker_recall(drafter, *drafter.trained_ranker, heldout)
    # The drafter describes itself in data: its training configuration and figures.
    extra = {"training": dict(report)}
    drafter.save(out / "drafter", extra=extra)
    if drafter.trained_ranker is not None:
        save_ranker(*(t.to(torch.bfloat16) for t in drafter.trained_ranker),
                    out / "drafter" / "ranker.safetensors", meta={"joint_training": report["ranker"]})
    if ship:
        from ..speculation.config import default_vocab

        shipped = EagleDrafter.load(out / "drafter", target).to(torch.bfloat16)
        # The shipped drafter's default draft vocabulary is a measured choice: keep it.
        keep = {"draft_vocab": default_vocab(ship_dir(cfg.model))} if ship_dir(cfg.model).exists() else {}
        shipped.save(ship_dir(cfg.model), extra={**keep, **extra}, q8_0=True)
        if drafter.trained_ranker is not None:
            shutil.copy(out / "drafter" / "ranker.safetensors", ship_dir(cfg.model))
        log(f"shipped to {ship_dir(cfg.model)}")


def archive_sequences(cfg: TrainConfig, model_path: Path) -> list[list[int]]:
    """The first `cfg.data.archive_sequences` prompt + answer sequences of the answer archive, in
    its files' order, cut at max_len."""
    if not cfg.data.answers:
        raise ValueError("--archive-sequences reads the answer archive: pass --answers DIR")
    archived = list(read_answers(Path(cfg.data.answers), target_fingerprint(model_path),
                                 cfg.data.distill_new_tokens).values())
    if len(archived) < cfg.data.archive_sequences:
        raise ValueError(f"the archive {cfg.data.answers} holds {len(archived)} answers, "
                         f"{cfg.data.archive_sequences} asked for")
    return [s[:cfg.data.max_len] for s in archived[:cfg.data.archive_sequences]]
