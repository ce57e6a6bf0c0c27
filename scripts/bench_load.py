"""Decoding on a busy machine: tokens per second alone, beside busy processes, and beside a
second vocabspec decoding at the same time, with the answers checked against the quiet ones.

Laptops and shared servers always run something else. A fair share of 2 cores beside one
other CPU-bound process is half of them; this measures how much of its quiet speed decoding
keeps there, per method, on the held-out prompts (`--questions heldout`):

    python scripts/bench_load.py --model smollm2 --methods none,eagle+pld --out docs/bench/load-smollm2

Each condition answers every prompt once after a warm-up; tok/s is new tokens over decoding
seconds summed over the prompts. `busy`: N processes spinning in a Python loop; `neighbour`:
another process generating with the same model and method over and over (its own tok/s is
reported too). `--threads 2` fixes both processes' native thread teams (no governor), for the
comparison. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

import vocabspec
from vocabspec.runtime import native
from vocabspec.benchmarks.bench import load_questions
from vocabspec.runtime.prompts import encode_conversation, stop_strings

NEIGHBOUR = """
import sys, time, vocabspec
from vocabspec.runtime import native
from vocabspec.runtime.prompts import encode_conversation, stop_strings
native.set_threads(int(sys.argv[5]))
lm = vocabspec.load(sys.argv[1], draft=sys.argv[2])
ids = encode_conversation(lm.tokenizer, [("user", sys.argv[3])], answer_open=True)
config = lm._config(max_new_tokens=int(sys.argv[4]), stop=stop_strings(lm.tokenizer))
lm.engine.generate(ids, config)
print("ready", flush=True)
while True:
    started = time.perf_counter()
    result = lm.engine.generate(ids, config)
    print(len(result.tokens) / (time.perf_counter() - started), flush=True)
"""


def machine() -> str:
    """The CPU's model name (lscpu's), and whether it has AVX-512."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor() or platform.machine())
    return f"{name} ({'AVX-512' if ' avx512f' in info else 'AVX2'})"


def answer_all(lm, prompts: list[list[int]], config) -> tuple[float, list[list[int]]]:
    tokens, seconds, answers = 0, 0.0, []
    for ids in prompts:
        started = time.perf_counter()
        result = lm.engine.generate(ids, config)
        seconds += time.perf_counter() - started
        tokens += len(result.tokens)
        answers.append(list(result.tokens))
    return tokens / seconds, answers


def spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def neighbour(model: str, method: str, prompt: str, max_new_tokens: int, threads: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, model, method, prompt, str(max_new_tokens),
                                str(threads)],
                               stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError("the neighbour process failed to start")
    return process


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--methods", default="none,eagle+pld", help="comma-separated --draft values")
    parser.add_argument("--questions", default="heldout", help="question file, or builtin / heldout")
    parser.add_argument("--prompts", type=int, default=4, help="prompts answered per condition")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes in the busy condition")
    parser.add_argument("--threads", type=int, default=0,
                        help="native threads, both processes: 0 (default) the governor's, N fixed")
    parser.add_argument("--out", default=None, help="directory for load.json and load.md")
    args = parser.parse_args()
    native.set_threads(args.threads)
    questions = load_questions(args.questions, None)[:args.prompts]
    rows = []
    for method in args.methods.split(","):
        lm = vocabspec.load(args.model, draft=method)
        prompts = [encode_conversation(lm.tokenizer, [("user", q["turns"][0])], answer_open=True)
                   for q in questions]
        config = lm._config(max_new_tokens=args.max_new_tokens, stop=stop_strings(lm.tokenizer))
        answer_all(lm, prompts[:1], config)                    # warm-up (and the tree's tuning)
        quiet, reference = answer_all(lm, prompts, config)
        results = {"quiet": (quiet, 0)}
        load = spinners(args.busy)
        try:
            time.sleep(0.5)
            speed, answers = answer_all(lm, prompts, config)
        finally:
            stop(load)
        results[f"beside {args.busy} busy processes"] = (speed, sum(a != b for a, b in zip(answers, reference)))
        other = neighbour(args.model, method, questions[0]["turns"][0], args.max_new_tokens, args.threads)
        try:
            speed, answers = answer_all(lm, prompts, config)
        finally:
            stop([other])
        neighbour_speeds = [float(line) for line in other.stdout.read().split()]
        results["beside a second vocabspec"] = (speed, sum(a != b for a, b in zip(answers, reference)))
        for condition, (speed, differing) in results.items():
            row = {"method": method, "condition": condition, "tok_s": round(speed, 1),
                   "x_quiet": round(speed / quiet, 2), "answers_differing": differing}
            if condition == "beside a second vocabspec":
                row["neighbour_tok_s"] = round(sorted(neighbour_speeds)[len(neighbour_speeds) // 2], 1) \
                    if neighbour_speeds else None
            rows.append(row)
            print(json.dumps(row), flush=True)
        del lm
    header = (f"{args.model}: {len(questions)} prompts ({args.questions}), {args.max_new_tokens} new tokens, "
              f"greedy; {date.today()}, {machine()}, "
              f"{os.cpu_count()} CPUs, torch {torch.__version__}, native threads: "
              f"{args.threads or 'the governor'}.")
    table = ["| method | condition | tok/s | x quiet | answers differing | neighbour tok/s |",
             "| --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['method']} | {r['condition']} | {r['tok_s']} | {r['x_quiet']} | {r['answers_differing']} | "
              f"{r.get('neighbour_tok_s', '') or ''} |" for r in rows]
    print(header)
    print("\n".join(table))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "load.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
        (out / "load.md").write_text(header + "\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
