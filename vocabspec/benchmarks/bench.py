"""Spec-Bench style benchmark: every method on the same questions, side by side, in one run.

Methods are interleaved question by question (machine drift hits all alike) and share one
target model. Each speculative method's greedy output is compared token by token with
vanilla decoding's in the same run; mismatches are counted and reported.

Method names: vanilla, pld, eagle2 (full vocabulary), eagle2+fr:32k, eagle2+trim:32k,
eagle2+spec:2048 (any size after the colon); "+pld" after any eagle2 method grafts prompt
lookup's continuation onto its tree (eagle2+pld, eagle2+fr:32k+pld); medusa, medusa+fr:32k...
(Medusa's heads, medusa.py); model:NAME, model:NAME+trim:32k... (an independent draft model,
draft_model.py, in its default format: with a float32 target, the target's 8-bit copy); a suffix @DEPTHxTOKENS
fixes the tree (eagle2@6x60), otherwise the tree is the one chosen for this machine
(--total-tokens auto); a suffix /float32 or /bfloat16 before it sets the dtype the drafter
computes in (eagle2+fr:32k/float32; default: `draft_dtype("auto")`, bfloat16 drafting for a
float32 target on hardware with fast bfloat16).

Output directory: answers.jsonl (Spec-Bench's fields), summary.json, report.md (tables per
category), speedup.png and draft_breakdown.png, and run.json (the settings and the trees used).
answers.jsonl is written question by question with what the summary needs, so `--resume`
continues an interrupted run where it stopped (same settings, same trees).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..decoding.generate import GenerationConfig
from ..decoding.batch import Engine
from ..runtime.prompts import encode_conversation, stop_strings
from ..speculation.sampling import SamplingParams

CATEGORY_ORDER = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                  "humanities", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass
class BenchConfig:
    questions: str
    model: str = "smollm2"
    methods: tuple[str, ...] = ("vanilla", "pld", "eagle2")
    out: str = "runs/bench"
    max_new_tokens: int = 1024
    per_category: int | None = None
    temperature: float = 0.0
    seed: int = 0
    weights: str = "auto"             # the target's run-time format (loading.load_model)
    backend: str = "auto"
    device: str = "cpu"
    allow_inexact: bool = False       # draft where verification is not bit-exact (torch's kernels)
    depth: int = 6
    tree_top_k: int = 10
    total_tokens: int | str = "auto"
    warmup: bool = True
    draft_path: str | None = None     # EAGLE drafter for the eagle2 methods (default: bundled)
    resume: bool = False              # keep the finished questions of an interrupted run in `out`


# The project's own prompts, one per Spec-Bench category (two turns where Spec-Bench's MT-Bench
# categories have two), so the benchmark runs without a download. Spec-Bench's own 480 come
# from its repository (github.com/hemingkx/Spec-Bench, data/spec_bench/question.jsonl).
BUILTIN_QUESTIONS = Path(__file__).parents[1] / "data" / "prompts.jsonl"
# Code and chat prompts written for measuring, in no training set and not Spec-Bench's.
HELDOUT_QUESTIONS = Path(__file__).parents[1] / "data" / "heldout.jsonl"


def load_questions(path: str | Path, per_category: int | None) -> list[dict]:
    """Questions in Spec-Bench's format from a question.jsonl, "builtin" (the project's own, one
    per Spec-Bench category) or "heldout" (code and chat prompts in no training set)."""
    path = {"builtin": BUILTIN_QUESTIONS, "heldout": HELDOUT_QUESTIONS}.get(str(path), Path(path))
    if not path.is_file():
        raise FileNotFoundError(f"questions file {path} does not exist (Spec-Bench's question.jsonl "
                                "comes from github.com/hemingkx/Spec-Bench; --questions builtin or heldout "
                                "runs the project's own prompts)")
    questions, seen = [], defaultdict(int)
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            turns, category = q["turns"], q["category"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a Spec-Bench question ({exc})") from exc
        if per_category is not None and seen[category] >= per_category:
            continue
        seen[category] += 1
        questions.append({"question_id": q.get("question_id", number), "category": category,
                          "turns": [str(t) for t in turns]})
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


def copy_fraction(prompt: list[int], output: list[int], n: int = 4) -> float:
    """Share of output tokens that end an n-gram also found in the prompt (base models tend to
    repeat their prompt, which flatters every speculative method)."""
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    if len(output) < n:
        return 0.0
    hits = sum(tuple(output[i - n + 1:i + 1]) in grams for i in range(n - 1, len(output)))
    return hits / (len(output) - n + 1)


@dataclass
class MethodRun:
    name: str
    engine: Engine
    draft_vocab: str
    stats: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    breakdown: dict = field(default_factory=dict)     # drafting seconds per phase


def build_methods(cfg: BenchConfig, log=print, trees: dict | None = None):
    """The target and one engine per method; `trees` (method -> [depth, total tokens]) fixes
    trees that would otherwise be chosen again (a resumed run keeps its first run's)."""
    from dataclasses import replace

    from ..decoding.generate import require_exact
    from ..runtime.loading import load_model
    from ..speculation.config import DraftConfig
    from ..tuning.proposers import make_proposer
    from ..runtime.tokenizer import load_tokenizer

    configs = {name: DraftConfig.from_method(name, path=cfg.draft_path, depth=cfg.depth,
                                             top_k=cfg.tree_top_k, total_tokens=cfg.total_tokens)
               for name in cfg.methods}
    target, path = load_model(cfg.model, weights=cfg.weights, device=cfg.device, backend=cfg.backend)
    if any(config.method != "none" for config in configs.values()):
        require_exact(target, cfg.allow_inexact)     # before any drafter is built and timed
    tokenizer = load_tokenizer(path)
    runs = []
    for name, config in configs.items():
        if trees and trees.get(name):
            config = replace(config, depth=trees[name][0], total_tokens=trees[name][1])
        proposer = make_proposer(target, config, cfg.model, tokenizer=tokenizer, log=log)
        if proposer is not None:
            proposer.timing_sync = True      # an honest breakdown waits for the device
        if proposer is not None and proposer.tree_shape:
            log(f"{name}: depth={proposer.tree_shape[0]}, total_tokens={proposer.tree_shape[1]}")
        runs.append(MethodRun(name, Engine(target, tokenizer, proposer, allow_inexact=cfg.allow_inexact),
                              config.vocab))
    return target, tokenizer, runs


def run_bench(cfg: BenchConfig, log=print) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    questions = load_questions(cfg.questions, cfg.per_category)
    if "vanilla" not in cfg.methods:
        raise ValueError("the methods must include vanilla: speedups and losslessness are measured against it")
    settings = _run_settings(cfg)
    previous = _previous_run(out, settings, questions, cfg.methods) if cfg.resume else None
    if cfg.resume:
        log(f"resuming: {len(previous['records'])} of {len(questions)} questions already answered"
            if previous else f"nothing to resume in {out}: starting a new run")
    target, tokenizer, runs = build_methods(cfg, log, trees=previous["trees"] if previous else None)
    settings["trees"] = {run.name: _tree_of(run) for run in runs}
    (out / "run.json").write_text(json.dumps(settings, indent=2))
    sampling = SamplingParams(temperature=cfg.temperature, seed=cfg.seed)
    config = GenerationConfig(max_new_tokens=cfg.max_new_tokens, sampling=sampling,
                              stop=stop_strings(tokenizer))
    if cfg.warmup:
        warm = encode_conversation(tokenizer, [("user", "Say hello.")], answer_open=True)
        for run in runs:
            run.engine.generate(warm, GenerationConfig(max_new_tokens=16, sampling=sampling))
    for run in runs:
        if run.engine.proposer is not None:
            run.engine.proposer.reset_timings()
    mismatches = defaultdict(list)
    copy = []
    done = previous["records"] if previous else {}
    with open(out / "answers.jsonl", "w") as answers:
        for q in questions:                 # a resumed run keeps its finished questions
            for record in done.get(q["question_id"], []):
                answers.write(json.dumps(record) + "\n")
        todo = [q for q in questions if q["question_id"] not in done]
        total_turns = sum(len(q["turns"]) for q in questions) * len(runs)
        bar = tqdm(total=total_turns, initial=total_turns - sum(len(q["turns"]) for q in todo) * len(runs),
                   desc=f"bench {cfg.model}", unit="turn")
        for q in todo:
            records = [_answer(cfg, run, q, tokenizer, config, bar) for run in runs]
            for record in records:
                answers.write(json.dumps(record) + "\n")
            answers.flush()
            done[q["question_id"]] = records
            bar.set_postfix(mismatches=sum(map(len, _mismatches(cfg, records))))
        bar.close()
    for q in questions:
        records = done[q["question_id"]]
        for run, record in zip(runs, records):
            _fold(run, record)
        copy += records[cfg.methods.index("vanilla")]["copy"]
        for name in _mismatches(cfg, records):
            mismatches[name].append(q["question_id"])
    summary = summarise(cfg, runs, target, mismatches, copy)
    summary["questions"] = len(questions)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(report_markdown(summary))
    plot(summary, out)
    return summary


def _answer(cfg: BenchConfig, run: MethodRun, q: dict, tokenizer, config, bar) -> dict:
    """One method's answers to every turn of a question, as a Spec-Bench record; the record
    also keeps what the summary needs (timings, drafting breakdown), so a run can resume."""
    history, choice = [], {"index": 0, "turns": [], "new_tokens": [], "wall_time": [],
                           "decoding_steps": [], "accept_lengths": [], "token_ids": []}
    stats, copy = defaultdict(float), []
    before = _breakdown(run)
    for turn in q["turns"]:
        history.append(("user", turn))
        ids = encode_conversation(tokenizer, history, answer_open=True)
        ids = ids[-(run.engine.max_len - cfg.max_new_tokens - 80):]
        result = run.engine.generate(ids, config)
        history.append(("assistant", result.text))
        lengths = [s.accept_length for s in result.steps]
        choice["turns"].append(result.text)
        choice["new_tokens"].append(result.new_tokens)
        choice["wall_time"].append(round(result.seconds, 4))
        choice["decoding_steps"].append(len(lengths))
        choice["accept_lengths"].append(lengths)
        choice["token_ids"].append(result.tokens)
        stats["tokens"] += result.new_tokens
        stats["seconds"] += result.seconds
        stats["steps"] += len(lengths)
        stats["accepted"] += sum(lengths)
        for key in ("draft_seconds", "verify_seconds", "forward_seconds"):
            stats[key] += sum(getattr(s, key) for s in result.steps)
        stats["prefill_seconds"] += result.prefill_seconds
        copy.append((copy_fraction(ids, result.tokens), result.new_tokens))
        bar.update(1)
    after = _breakdown(run)
    return {"question_id": q["question_id"], "category": q["category"],
            "model_id": f"{cfg.model}-{run.name}", "method": run.name, "choices": [choice],
            "tstamp": time.time(), "stats": dict(stats), "copy": copy,
            "draft_breakdown_s": {k: v - before.get(k, 0.0) for k, v in after.items()}}


def _breakdown(run: MethodRun) -> dict:
    proposer = run.engine.proposer
    return proposer.time_breakdown() if proposer is not None else {}


def _fold(run: MethodRun, record: dict) -> None:
    for key, value in record["stats"].items():
        run.stats[record["category"]][key] += value
    for key, value in record["draft_breakdown_s"].items():
        run.breakdown[key] = run.breakdown.get(key, 0.0) + value


def _mismatches(cfg: BenchConfig, records: list[dict]) -> list[str]:
    """Methods whose greedy tokens differ from vanilla's on this question."""
    if cfg.temperature != 0:
        return []
    reference = records[cfg.methods.index("vanilla")]["choices"][0]["token_ids"]
    return [r["method"] for r in records if r["choices"][0]["token_ids"] != reference]


def _tree_of(run: MethodRun) -> list[int] | None:
    proposer = run.engine.proposer
    return list(proposer.tree_shape) if proposer is not None and proposer.tree_shape else None


# Settings that must match for a run to resume another: anything that changes the answers
# or their timings' meaning (not the output directory, threads or warm-up).
RESUME_KEYS = ("questions", "model", "methods", "max_new_tokens", "per_category", "temperature",
               "seed", "weights", "backend", "device", "depth", "tree_top_k", "total_tokens",
               "draft_path")


def _run_settings(cfg: BenchConfig) -> dict:
    settings = {k: getattr(cfg, k) for k in RESUME_KEYS}
    settings["methods"] = list(cfg.methods)
    settings["questions"] = str((BUILTIN_QUESTIONS if cfg.questions == "builtin" else Path(cfg.questions)).resolve())
    return settings


def _previous_run(out: Path, settings: dict, questions: list[dict], methods) -> dict | None:
    """Finished questions of an interrupted run in `out` (every method answered), and the trees
    its methods used, so the resumed run decodes with the same ones."""
    run_file, answers_file = out / "run.json", out / "answers.jsonl"
    if not run_file.exists() or not answers_file.exists():
        return None
    previous = json.loads(run_file.read_text())
    changed = [k for k in RESUME_KEYS if previous.get(k) != settings[k]]
    if changed:
        raise ValueError(f"cannot resume the run in {out}: it was made with other settings "
                         f"({', '.join(changed)}); use another --out, or drop --resume to start over")
    by_question = defaultdict(dict)
    for line in answers_file.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue                                # a line cut off by the interruption
        if "stats" in record:
            by_question[record["question_id"]][record["method"]] = record
    records = {}
    for q in questions:
        found = by_question.get(q["question_id"], {})
        if all(m in found for m in methods):
            records[q["question_id"]] = [found[m] for m in methods]
    return {"records": records, "trees": previous.get("trees", {})}


def summarise(cfg: BenchConfig, runs, target, mismatches, copy) -> dict:
    categories = [c for c in CATEGORY_ORDER if c in runs[0].stats] + \
        sorted(c for c in runs[0].stats if c not in CATEGORY_ORDER)
    target_params = target.args.matrix_parameters
    methods = {}
    for run in runs:
        per_cat = {}
        for cat in categories + ["overall"]:
            rows = [run.stats[c] for c in categories] if cat == "overall" else [run.stats[cat]]
            tokens = sum(r["tokens"] for r in rows)
            seconds = sum(r["seconds"] for r in rows)
            steps = sum(r["steps"] for r in rows)
            accepted = sum(r["accepted"] for r in rows)
            per_cat[cat] = {"tau": accepted / steps if steps else 0.0,
                            "tokens_per_s": tokens / seconds if seconds else 0.0,
                            "tokens": int(tokens), "seconds": seconds, "steps": int(steps),
                            "draft_seconds": sum(r["draft_seconds"] for r in rows),
                            "verify_seconds": sum(r["verify_seconds"] for r in rows),
                            "forward_seconds": sum(r.get("forward_seconds", 0.0) for r in rows),
                            "prefill_seconds": sum(r.get("prefill_seconds", 0.0) for r in rows)}
        entry = {"categories": per_cat}
        proposer = run.engine.proposer
        if proposer is not None:
            entry["draft_breakdown_s"] = run.breakdown
        if proposer is not None and proposer.tree_shape:
            entry["depth"], entry["total_tokens"] = proposer.tree_shape
            # VocabTrim's memory-bound speedup: tau / (c * gamma + 1), c = drafter/target
            # parameters read per draft step, gamma = draft forward steps per round.
            c = proposer.draft_parameters() / target_params
            gamma = proposer.draft_forwards or entry["depth"] + 1
            entry["mbsu"] = per_cat["overall"]["tau"] / (c * gamma + 1)
        if cfg.temperature == 0 and run.name != "vanilla":
            entry["mismatched_questions"] = mismatches.get(run.name, [])
        methods[run.name] = entry
    base = methods["vanilla"]["categories"]
    for entry in methods.values():
        for cat, row in entry["categories"].items():
            row["speedup"] = row["tokens_per_s"] / base[cat]["tokens_per_s"] if base[cat]["tokens_per_s"] else 0.0
    _add_step_costs(methods)
    weight = sum(n for _, n in copy)
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
        "target_weights": target.weights,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": _machine(),
        "categories": categories,
        "vanilla_prompt_copy_fraction": sum(f * n for f, n in copy) / weight if weight else 0.0,
        "methods": methods,
    }


def _add_step_costs(methods: dict) -> None:
    """What a step costs, in units of one vanilla forward (vanilla's own time per step spent in
    the target): the verification forward, the drafting, and the rest, spread over the steps:
    the prompt's prefill, then the other (the drafter's pass over the prompt, bookkeeping). The
    prefill is the same for every method, so a method with fewer steps pays more of it per step.
    Speedup is then (tokens per step / whole step) over the same for vanilla, so the table says
    whether a method needs a better drafter (more tokens per step) or a cheaper step."""
    vanilla = methods["vanilla"]["categories"]["overall"]
    forward = vanilla["verify_seconds"] / vanilla["steps"] if vanilla["steps"] else 0.0
    if not forward:
        return
    for entry in methods.values():
        row = entry["categories"]["overall"]
        if not row["steps"]:
            continue
        verify = row["verify_seconds"] / row["steps"] / forward
        target = row.get("forward_seconds", 0.0) / row["steps"] / forward
        draft = row["draft_seconds"] / row["steps"] / forward
        whole = row["seconds"] / row["steps"] / forward
        prefill = row.get("prefill_seconds", 0.0) / row["steps"] / forward
        entry["step_cost"] = {"verify": verify, "verify_forward": target, "draft": draft,
                              "rest": whole - verify - draft, "prefill": prefill,
                              "other": whole - verify - draft - prefill,
                              "whole": whole, "tokens_per_step": row["tokens"] / row["steps"]}


def _machine() -> str:
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def report_markdown(summary: dict) -> str:
    cfg = summary["config"]
    lines = [f"# Spec-Bench: {cfg['model']} (weights {summary['target_weights']}, "
             f"{'greedy' if cfg['temperature'] == 0 else 'temperature ' + str(cfg['temperature'])}, "
             f"max {cfg['max_new_tokens']} new tokens)", "",
             f"{summary['date']} on {summary['machine']}. Vanilla output copies its prompt "
             f"(4-gram overlap) for {summary['vanilla_prompt_copy_fraction']:.1%} of its tokens.", ""]
    methods = summary["methods"]
    names = list(methods)
    lines += ["## Overall", "", "| method | tau | tokens/s | speedup | tree depth/size | MBSU | greedy mismatches |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        entry = methods[name]
        row = entry["categories"]["overall"]
        mism = entry.get("mismatched_questions")
        mbsu = f"{entry['mbsu']:.2f}" if "mbsu" in entry else "-"
        tree = f"{entry['depth']}/{entry['total_tokens']}" if "depth" in entry else "-"
        mism_text = "-" if mism is None else f"{len(mism)}" + (f" (questions {mism})" if mism else "")
        lines.append(f"| {name} | {row['tau']:.2f} | {row['tokens_per_s']:.2f} | {row['speedup']:.2f}x | "
                     f"{tree} | {mbsu} | {mism_text} |")
    for metric, label in (("speedup", "speedup over vanilla"), ("tau", "tau (mean accepted length)"),
                          ("tokens_per_s", "tokens/s")):
        lines += ["", f"## {label} per category", "",
                  "| category | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for cat in summary["categories"] + ["overall"]:
            cells = [methods[n]["categories"][cat][metric] for n in names]
            lines.append(f"| {cat} | " + " | ".join(f"{v:.2f}" for v in cells) + " |")
    costs = {n: m["step_cost"] for n, m in methods.items() if "step_cost" in m}
    if costs:
        lines += ["", "## Cost of a step, in vanilla forwards", "",
                  "1 = the target's forward in one vanilla decoding step (with its verification and "
                  "commit); of verification, the target's forward over the tree alone. Rest: the prompt's prefill "
                  "(the same for every method, so more per step with fewer steps), then the other: "
                  "the drafter's pass over the prompt and bookkeeping, spread over the steps. "
                  "speedup = (tokens per step / whole step) / the same for vanilla.", "",
                  "| method | verification | of which forward | drafting | rest: prefill | rest: other | "
                  "whole step | tokens per step | speedup |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, cost in costs.items():
            lines.append(f"| {name} | {cost['verify']:.2f} | {cost.get('verify_forward', 0.0):.2f} | "
                         f"{cost['draft']:.2f} | "
                         f"{cost.get('prefill', 0.0):.2f} | {cost.get('other', cost['rest']):.2f} | "
                         f"{cost['whole']:.2f} | {cost['tokens_per_step']:.2f} | "
                         f"{methods[name]['categories']['overall']['speedup']:.2f}x |")
    breakdown = {n: m["draft_breakdown_s"] for n, m in methods.items() if "draft_breakdown_s" in m}
    if breakdown:
        parts = sorted({p for b in breakdown.values() for p in b})
        lines += ["", "## Drafting time breakdown (seconds, whole run)", "",
                  "| method | " + " | ".join(parts) + " | verify |", "| --- |" + " --- |" * (len(parts) + 1)]
        for name, b in breakdown.items():
            verify = methods[name]["categories"]["overall"]["verify_seconds"]
            lines.append(f"| {name} | " + " | ".join(f"{b.get(p, 0.0):.2f}" for p in parts)
                         + f" | {verify:.2f} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    methods = summary["methods"]
    names = [n for n in methods if n != "vanilla"]
    cats = summary["categories"] + ["overall"]
    fig, ax = plt.subplots(figsize=(max(8, len(cats) * 0.9), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        values = [methods[name]["categories"][c]["speedup"] for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(cats))])
    ax.set_xticklabels(cats, rotation=40, ha="right")
    ax.set_ylabel("speedup over vanilla")
    ax.set_title(f"Spec-Bench speedup, {summary['config']['model']} ({summary['target_weights']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)
    breakdown = {n: m["draft_breakdown_s"] for n, m in methods.items() if "draft_breakdown_s" in m}
    if breakdown:
        # Every phase any method reports (EAGLE's layer, Medusa's blocks, a draft model's
        # forwards, prompt lookup's lookup; the heads' matmuls, ranker and top-k; the tree).
        parts = list(dict.fromkeys(part for parts_of in breakdown.values() for part in parts_of))
        fig, ax = plt.subplots(figsize=(7, 4))
        bottoms = [0.0] * len(breakdown)
        for part in parts:
            values = []
            for name in breakdown:
                steps = methods[name]["categories"]["overall"]["steps"]
                values.append(1000 * breakdown[name].get(part, 0.0) / max(steps, 1))
            ax.bar(list(breakdown), values, bottom=bottoms, label=part)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.set_ylabel("drafting ms per step")
        ax.set_title("Drafting time breakdown per method")
        ax.legend(fontsize=8)
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
        fig.tight_layout()
        fig.savefig(out / "draft_breakdown.png", dpi=110)
        plt.close(fig)
