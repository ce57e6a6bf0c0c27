"""The native engine against llama.cpp's own build on GGUFs of real models' shapes (random weights,
scripts/gguf_shapes.py): decode (llama-bench's tg), prompt processing (pp512), the rows a tree
costs (llama-bench's pp at 1-64 against our forward of as many rows), and memory.

Both engines read the same file with the same threads, in rounds that alternate between them so
that the machine's drift falls on both (medians over rounds). Ours: plain greedy decoding through
the engine's loop (`Engine.generate` from a one-token prompt, as llama-bench's tg starts from an
empty context), a 512-token prefill, and `forward_seconds`' tree-masked forwards after a
256-token context. llama.cpp: `llama-bench -r 1` per round.

    python scripts/bench_real_sizes.py --model /tmp/llama-3.1-8b-Q4_K_M.gguf --rounds 3 --rows 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from datetime import date
from pathlib import Path

import torch

from vocabspec.engine import native
from vocabspec.engine.loading import load_model
from vocabspec.speculation.batch import Engine
from vocabspec.speculation.cost_curve import forward_seconds
from vocabspec.speculation.generate import GenerationConfig

LLAMA_BENCH = Path(os.environ.get("LCPP_DIR", Path.home() / ".lcpp")) / "bin" / "llama-bench"


def llama_bench(path: Path, threads: int, prompt: int = 0, tokens: int = 0) -> float:
    """llama-bench's tokens per second for one test (-p prompt, or -n tokens), one repetition."""
    command = [str(LLAMA_BENCH), "-m", str(path), "-t", str(threads), "-r", "1", "-o", "json",
               "-p", str(prompt), "-n", str(tokens)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr[-1000:]}")
    return json.loads(done.stdout)[0]["avg_ts"]


def ours_decode(model, tokens: int) -> float:
    bos = model.args.bos_token_id if model.args.bos_token_id is not None else 1
    result = Engine(model).generate([bos], GenerationConfig(max_new_tokens=tokens, stop_on_eos=False))
    return result.new_tokens / result.seconds


def ours_prefill(model, tokens: int) -> float:
    ids = torch.randint(100, model.args.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(tokens + 8)
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, torch.arange(tokens), cache)
        return tokens / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="decode test length (tg)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt processing test length (pp)")
    parser.add_argument("--rows", default="", help="rows of the cost curve, comma-separated (none: skip)")
    parser.add_argument("--out", type=Path, default=None, help="append the result as a JSON line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native.set_threads(args.threads)
    started = time.perf_counter()
    model, _ = load_model(str(args.model), max_seq_len=max(1024, args.prompt + 16))
    load_s = time.perf_counter() - started
    ours_decode(model, 8)                                   # touch every page once
    runs = {"ours_tg": [], "lcpp_tg": [], "ours_pp": [], "lcpp_pp": []}
    rows = [int(r) for r in args.rows.split(",") if r]
    curve = {"ours_ms": {n: [] for n in rows}, "lcpp_ms": {n: [] for n in rows}}
    for round_ in range(args.rounds):
        runs["lcpp_tg"].append(llama_bench(args.model, args.threads, tokens=args.tokens))
        runs["ours_tg"].append(ours_decode(model, args.tokens))
        runs["ours_pp"].append(ours_prefill(model, args.prompt))
        runs["lcpp_pp"].append(llama_bench(args.model, args.threads, prompt=args.prompt))
        if rows:
            timed = forward_seconds(model, [n - 1 for n in rows], context=256, repeats=1)
            for n in rows:
                curve["ours_ms"][n].append(timed[n - 1] * 1e3)
                curve["lcpp_ms"][n].append(n / llama_bench(args.model, args.threads, prompt=n) * 1e3)
        print(json.dumps({k: round(v[-1], 2) for k, v in runs.items()}), flush=True)
    med = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    result = {"date": str(date.today()), "machine": platform.processor() or platform.machine(),
              "file": args.model.name, "file_gib": round(args.model.stat().st_size / 2**30, 2),
              "threads": args.threads, "rounds": args.rounds, "load_s": round(load_s, 2), **med,
              "tg_ratio": round(med["ours_tg"] / med["lcpp_tg"], 3), "pp_ratio": round(med["ours_pp"] / med["lcpp_pp"], 3),
              "weights_gib": round(model.memory.weights / 2**30, 2)}
    if rows:
        for side in ("ours_ms", "lcpp_ms"):
            result[side] = {n: round(statistics.median(v), 1) for n, v in curve[side].items()}
            one = result[side][rows[0]]
            result[side.replace("_ms", "_x_one_row")] = {n: round(v / one, 2) for n, v in result[side].items()}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
