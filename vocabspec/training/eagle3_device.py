"""EAGLE-3 from a GGUF on a GPU in one command: the target's answers, features and training,
each batched on the device, inside a time budget.

    python -m vocabspec.training.eagle3_device export --model smollm2 --out prompts.npz  # a CPU, once
    python -m vocabspec.training.eagle3_device run --model M.gguf --prompts prompts.npz \\
        --out OUT --budget-s 480                                                          # the GPU

`export` tokenizes the recipe's prompts (ShareGPT first turns, task prompts, later turns, the
training conversations and the held-out prompts: train.py's data stage) into one small file,
so the GPU machine needs neither the ShareGPT package nor a tokenizer. `run` then:
1. answers every prompt greedily, a thousand at a time (slots.greedy_answers), and keeps the
   answers in OUT (answers-K.npz), so a later run, on any machine, can train on them again;
   `--self-prompts N` first draws up to N prompts the target writes itself (self_prompts.py) on
   the device, answered with the rest or after `--answers`' ones: data past ShareGPT's supply;
2. trains one EAGLE-3 drafter per label kind asked for (soft: the target's distribution over
   the draft vocabulary; hard: its choice) on the same batches (eagle3_train.train_batched), each
   starting from `--init` (a committed drafter: the run continues it) or afresh;
3. writes each drafter in the form the engine drafts with (speculators' layout, Q8_0 groups)
   and report.json: the scaling points (held-out agreement after so many tokens), timings.
Every phase checks the clock: answers stop being admitted at a share of the budget, training
is cut to the steps that fit, so what was done comes back however fast the device is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ANSWER_FILE_BYTES = 15 * 2**20     # each answers file stays under a transfer's 16 MiB


def pack(lists: list[list[int]]) -> dict[str, np.ndarray]:
    """Token lists as one flat array (16-bit where every id fits) and their offsets."""
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in lists])
    flat = np.fromiter((t for x in lists for t in x), dtype=np.int64, count=int(offsets[-1]))
    small = flat.size == 0 or (flat.min() >= 0 and flat.max() < 2**16)
    return {"flat": flat.astype(np.uint16 if small else np.int32), "offsets": offsets}


def unpack(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def export_prompts(model: str, out: Path, recipe: dict) -> dict:
    """The recipe's prompts, tokenized, into `out` (.npz): prompts, conversations, heldout."""
    from ..runtime.loading import resolve_model_path
    from ..runtime.tokenizer import load_tokenizer
    from .train import TrainConfig, _distill_prompts, prepare_sequences

    cfg = TrainConfig.of(model=model, drafter="eagle3", out=str(out.parent / (out.stem + "-work")), **recipe)
    tokenizer = load_tokenizer(resolve_model_path(model))
    split = prepare_sequences(cfg, tokenizer)
    parts = {"prompts": _distill_prompts(cfg, tokenizer), "conversations": split["train"],
             "heldout": split["heldout_prompts"]}
    arrays = {f"{name}_{key}": value for name, lists in parts.items() for key, value in pack(lists).items()}
    np.savez_compressed(out, **arrays, recipe=json.dumps(recipe))
    return {name: len(lists) for name, lists in parts.items()}


def read_prompts(path: Path) -> dict[str, list[list[int]]]:
    data = np.load(path)
    return {name: unpack(data[f"{name}_flat"], data[f"{name}_offsets"])
            for name in ("prompts", "conversations", "heldout")}


def write_answers(out: Path, prompts: list[list[int]], answers: list, most_files: int = 3) -> list[Path]:
    """Answered prompts and their answers, in at most `most_files` files of at most
    ANSWER_FILE_BYTES each (a chunk that compresses too little is split in two, and what no
    longer fits is left out): what one transfer off a lent machine can carry. Returns the files."""
    done = [(p, a) for p, a in zip(prompts, answers) if a is not None]
    chunks = [done[i::most_files] for i in range(most_files)] if done else []
    files = []
    while chunks and len(files) < most_files:
        chunk = chunks.pop(0)
        path = out / f"answers-{len(files)}.npz"
        np.savez_compressed(path, **{f"prompts_{k}": v for k, v in pack([p for p, _ in chunk]).items()},
                            **{f"answers_{k}": v for k, v in pack([a for _, a in chunk]).items()})
        if path.stat().st_size > ANSWER_FILE_BYTES and len(chunk) > 1:
            path.unlink()
            chunks[:0] = [chunk[:len(chunk) // 2], chunk[len(chunk) // 2:]]
            continue
        files.append(path)
    return files


def read_answers(paths: list[Path]) -> tuple[list[list[int]], list[list[int]]]:
    prompts, answers = [], []
    for path in paths:
        data = np.load(path)
        prompts += unpack(data["prompts_flat"], data["prompts_offsets"])
        answers += unpack(data["answers_flat"], data["answers_offsets"])
    return prompts, answers


def run(args) -> dict:
    from ..runtime.loading import load_model
    from ..speculation.config import bundled_drafter_dir
    from .eagle3_train import draft_vocabulary, train_batched

    started = time.perf_counter()
    deadline = started + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": vars(args), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", flush=True)

    torch.backends.cuda.matmul.allow_tf32 = True
    target, _ = load_model(args.model, weights="bf16" if args.device == "cuda" else "f32", backend="torch",
                           device=args.device, max_seq_len=args.max_len + args.max_new_tokens + 8)
    log(f"target loaded on {target.device}: {target.runs_on}")
    data = read_prompts(Path(args.prompts))
    if args.limit:
        data = {k: v[:args.limit] for k, v in data.items()}
    room = args.max_len - args.max_new_tokens       # a prompt leaves its answer room in max_len
    fitting_prompts(data, room, log)
    fresh = drawn_prompts(args, out, started + args.self_prompt_share * args.budget_s, room, report, log) \
        if args.self_prompts else []
    if args.answers:
        prompts, answers = read_answers(sorted(Path(args.answers).glob("answers-*.npz")))
        report["answers_read"] = len(answers)
        todo = fresh
    else:
        prompts, answers = [], []
        todo = data["prompts"] + data["heldout"] + fresh
    if todo:
        new = answer_prompts(target, todo, args, started, report, log)
        prompts, answers = prompts + todo, answers + new
        kept = write_answers(out, prompts, answers)
        report["answers"]["files"] = [path.name for path in kept]
    sequences, heldout = training_sequences(data, prompts, answers, args.max_len)
    report["train_sequences"], report["train_tokens"] = len(sequences), sum(map(len, sequences))
    log(f"training on {len(sequences)} sequences, {report['train_tokens']} tokens; "
        f"{len(heldout)} held out")
    ids = draft_vocabulary(args.draft_vocab, target, bundled_drafter_dir(args.recipe_model))
    drafters = starting_drafters(args, target, ids)
    points = train_batched(target, drafters, sequences, heldout, tokens_per_batch=args.tokens_per_batch,
                           lr=args.lr, seed=args.seed, deadline=deadline - args.save_s,
                           snapshot_tokens=tuple(int(float(x) * 1e6) for x in args.snapshot_m.split(",") if x),
                           log=log)
    report["points"] = points
    report["seconds"] = round(time.perf_counter() - started, 1)
    save_drafters(args, out, drafters, points, report["device"])
    (out / "report.json").write_text(json.dumps(report, indent=2))
    log(f"done in {report['seconds']} s")
    return report


def fitting_prompts(data: dict, room: int, log) -> None:
    """Leave out of `data` the prompts and held-out prompts that do not fit `room` tokens (or
    are empty), saying how many."""
    for kind in ("prompts", "heldout"):
        fits = [p for p in data[kind] if 0 < len(p) <= room]
        if len(fits) < len(data[kind]):
            log(f"{len(data[kind]) - len(fits)} {kind} longer than {room} tokens left out")
        data[kind] = fits


def answer_prompts(target, todo: list[list[int]], args, started: float, report: dict, log) -> list:
    """The target's greedy answers to `todo` (None for those the answer share of the budget
    left unanswered), with their figures in report["answers"] and a progress line every 15 s."""
    from ..runtime.slots import greedy_answers

    t = time.perf_counter()
    tick = {"last": t}

    def progress(done: int, tokens: int) -> None:
        if time.perf_counter() - tick["last"] > 15:
            tick["last"] = time.perf_counter()
            log(f"answers {done}/{len(todo)}, {tokens} new tokens, "
                f"{tokens / (time.perf_counter() - t):.0f} tok/s")
    new = greedy_answers(target, todo, args.max_new_tokens, target.args.eos_token_ids,
                         slots=args.slots, deadline=started + args.answer_share * args.budget_s,
                         progress=progress)
    seconds = time.perf_counter() - t
    made = sum(len(a) for a in new if a is not None)
    report["answers"] = {"prompts": len(todo), "answered": sum(a is not None for a in new),
                         "new_tokens": made, "seconds": round(seconds, 1),
                         "tok_s": round(made / seconds)}
    log(json.dumps(report["answers"]))
    return new


def training_sequences(data: dict, prompts: list[list[int]], answers: list, max_len: int) -> tuple:
    """(training sequences, held-out ones), each cut to `max_len`: each answered prompt with its
    answer (held out where the prompt is one of data["heldout"]), then the conversations."""
    heldout_set = {tuple(p) for p in data["heldout"]}
    pairs = [(p, a) for p, a in zip(prompts, answers) if a is not None]
    heldout = [(p + a)[:max_len] for p, a in pairs if tuple(p) in heldout_set]
    sequences = [(p + a)[:max_len] for p, a in pairs if tuple(p) not in heldout_set]
    sequences += [c[:max_len] for c in data["conversations"]]
    return sequences, heldout


def starting_drafters(args, target, ids) -> dict:
    """{labels: (drafter, labels)} for each label kind of --labels: --init's drafter, or a new
    one over the draft vocabulary `ids` (eagle3_train.starting_drafter), on the target's device."""
    from .eagle3_train import starting_drafter

    ids = ids.to(target.device)
    return {labels: (starting_drafter(target, ids, args.init, args.seed).to(target.device, torch.float32), labels)
            for labels in args.labels.split(",")}


def save_drafters(args, out: Path, drafters: dict, points: list[dict], device: str) -> None:
    """Each drafter as OUT/drafter-LABELS, in the engine's form (speculators' layout, Q8_0),
    its training lineage (--init's runs, then this one) in its config."""
    earlier = lineage(Path(args.init)) if args.init else []
    for labels, (drafter, _) in drafters.items():
        final = [p for p in points if p["drafter"] == labels][-1]
        this = {"labels": labels, "tokens": final["tokens"], "lr": args.lr, "device": device,
                **{k: v for k, v in final.items() if k.startswith("top1")}}
        drafter.save(out / f"drafter-{labels}", layout="speculators", q8_0=True,
                     extra={"training": {"tokens_total": sum(r["tokens"] for r in earlier + [this]),
                                         "runs": earlier + [this]}})


def drawn_prompts(args, out: Path, deadline: float, room: int, report: dict, log) -> list[list[int]]:
    """Fresh prompts past the exported ones: user messages the target writes itself
    (self_prompts.py), seeds from --self-prompts-start on, drawn with the batch engine on the
    device until `deadline` (the rest are left for a later run), in the recipe's format and
    batched there (inexact, as its answers), framed and tokenized with the GGUF's own tokenizer."""
    from ..runtime.loading import resolve_model_path
    from ..runtime.tokenizer import load_tokenizer
    from .self_prompts import sample_user_prompts, self_prompt_ids

    t = time.perf_counter()
    path = resolve_model_path(args.model)
    texts = sample_user_prompts(path, args.self_prompts_start, args.self_prompts, device=args.device,
                                batch=min(args.slots, args.self_prompts), cache=out / "self-prompts.json",
                                deadline=deadline, weights="bf16" if args.device == "cuda" else "f32",
                                backend="torch", allow_inexact=True)
    fresh = self_prompt_ids(load_tokenizer(path), texts, room)
    report["self_prompts"] = {"seeds": [args.self_prompts_start, args.self_prompts_start + args.self_prompts],
                              "kept": len(fresh), "seconds": round(time.perf_counter() - t, 1)}
    log(json.dumps({"self_prompts": report["self_prompts"]}))
    return fresh


def lineage(drafter_dir: Path) -> list[dict]:
    """The runs that trained a drafter this recipe wrote, oldest first (its config's record)."""
    config = json.loads((drafter_dir / "config.json").read_text())
    return config.get("vocabspec", {}).get("training", {}).get("runs", [])


RECIPES = {     # train.py's settings for each bundled model's prompts (recipes/eagle3-10x.sh)
    "smollm2": {"conversations": 64, "self_distill": 9900, "task_prompts": 20954, "later_turns": 11000,
                "distill_start": 0},
    "gemma3": {"conversations": 100, "self_distill": 10000, "task_prompts": 21174, "later_turns": 13000,
               "distill_start": 0, "distill_new_tokens": 128},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vocabspec.training.eagle3_device", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="tokenize a bundled model's recipe prompts into one file")
    export.add_argument("--model", choices=sorted(RECIPES), required=True)
    export.add_argument("--out", required=True, help="the .npz to write")
    go = sub.add_parser("run", help="answers, features and EAGLE-3 training on the device")
    go.add_argument("--model", required=True, help="the target: a GGUF file or bundled name")
    go.add_argument("--recipe-model", choices=sorted(RECIPES), default="smollm2",
                    help="whose bundled token map gives the draft vocabulary")
    go.add_argument("--prompts", required=True, help="the file `export` wrote")
    go.add_argument("--out", required=True)
    go.add_argument("--device", default="cuda")
    go.add_argument("--budget-s", type=float, default=480.0, help="wall time for the whole run")
    go.add_argument("--answer-share", type=float, default=0.5, help="share of the budget answers may take")
    go.add_argument("--save-s", type=float, default=25.0, help="time kept for measuring and saving")
    go.add_argument("--answers", default="", help="a directory of answers-K.npz to train on instead")
    go.add_argument("--init", default="", help="a drafter directory to continue from")
    go.add_argument("--self-prompts", type=int, default=0,
                    help="also draw up to this many user prompts the target writes itself, answered "
                         "with the rest (after --answers' ones where given): fresh data past ShareGPT")
    go.add_argument("--self-prompts-start", type=int, default=0,
                    help="their first seed: a later run takes the seeds after an earlier one's")
    go.add_argument("--self-prompt-share", type=float, default=0.2,
                    help="share of the budget by which the draw stops starting seeds")
    go.add_argument("--labels", default="soft,hard", help="comma-separated: soft, hard")
    go.add_argument("--draft-vocab", default="trim:8k")
    go.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens per answer at most (default: the recipe model's, 256 or 128)")
    go.add_argument("--max-len", type=int, default=1024)
    go.add_argument("--slots", type=int, default=1024, help="sequences answered at once, at most")
    go.add_argument("--tokens-per-batch", type=int, default=32768)
    go.add_argument("--lr", type=float, default=2e-3)
    go.add_argument("--seed", type=int, default=0)
    go.add_argument("--snapshot-m", default="2,5,10,20", help="scaling points, millions of tokens")
    go.add_argument("--limit", type=int, default=0, help="at most this many prompts of each kind (checks)")
    args = parser.parse_args(argv)
    if args.command == "run" and args.max_new_tokens is None:
        args.max_new_tokens = RECIPES[args.recipe_model].get("distill_new_tokens", 256)
    if args.command == "export":
        counts = export_prompts(args.model, Path(args.out), RECIPES[args.model])
        print(json.dumps(counts))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
