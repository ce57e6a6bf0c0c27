"""The native engine against llama.cpp's own build on GGUFs of real models' shapes (random weights,
scripts/gguf_shapes.py): decode (llama-bench's tg), prompt processing (pp512), the rows a tree
costs (llama-bench's pp at 1-64 against our forward of as many rows), and memory. Each figure is
set against this machine's ceilings (scripts/machine_peaks.py, measured in the same run): decode
as the bytes a token reads over its time against the read bandwidth, and the rows past the first
as their int8 arithmetic over their extra time against the int8 dot-product peak.

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

import machine_peaks
from vocabspec.runtime import native
from vocabspec.runtime.gguf_file import GGUFFile
from vocabspec.runtime.loading import load_model
from vocabspec.decoding.batch import Engine
from vocabspec.decoding.cost_curve import forward_seconds
from vocabspec.decoding.generate import GenerationConfig

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
        model.tree_forward(ids, torch.arange(tokens), cache)
        return tokens / (time.perf_counter() - start)


def per_token(path: Path) -> dict:
    """What one token's forward reads and computes: every tensor's bytes but the embedding
    table's (a token reads one of its rows; tied, it is also the head and read whole), and two
    operations per weight of the matrices a row multiplies (the head included)."""
    tensors = GGUFFile(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    read = [t for t in tensors if tied or t.name != "token_embd.weight"]
    matrices = [t for t in read if len(t.shape) == 2]
    return {"bytes": sum(t.n_bytes for t in read), "ops": 2 * sum(t.n_elements for t in matrices)}


def roofline(result: dict, work: dict, peaks: dict) -> dict:
    """Decode's bytes a second against the bandwidth, and the extra rows' int8 rate against the peak."""
    out = {"bytes_per_token_gib": round(work["bytes"] / 2**30, 2), **peaks}
    gbs = work["bytes"] * result["ours_tg"] / 1e9
    out["decode_gbs"], out["decode_of_bandwidth"] = round(gbs, 1), round(gbs / peaks["bandwidth_gbs"], 2)
    if "ours_ms" in result:
        rows = sorted(result["ours_ms"])
        one, last = rows[0], rows[-1]
        extra_s = (result["ours_ms"][last] - result["ours_ms"][one]) / 1e3
        if extra_s > 0:
            gops = (last - one) * work["ops"] / extra_s / 1e9
            out["extra_rows_gops"], out["extra_rows_of_int8_peak"] = round(gops), round(gops / peaks["int8_gops"], 2)
    return out


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
    peaks = machine_peaks.measure(args.threads)
    print(json.dumps(peaks), flush=True)
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
    result["roofline"] = roofline(result, per_token(args.model), peaks)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
