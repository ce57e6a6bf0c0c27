"""Serving side by side: vocabspec's OpenAI server (continuous batching, with and without
speculation) and llama.cpp's llama-server with --parallel slots (its continuous batching), on
the same GGUF, driven by the same clients (the official openai package) with the same prompts:
aggregate tok/s and p50/p95 latency at each concurrency, and answers differing from the same
request answered alone (vocabspec.benchmarks.throughput). llama-server is built by
scripts/build_llamacpp.sh; LCPP_BIN names another build.

    python scripts/bench_serving.py --model smollm2 --concurrency 1,2,4,8,16 --out docs/bench/serving-smollm2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import httpx

from llamacpp import llama_cpp_bin
from vocabspec.benchmarks.bench import load_questions
from vocabspec.runtime.loading import resolve_model_path
from vocabspec.serving.server import free_port
from vocabspec.benchmarks.throughput import plot, prompts_for, report, run_throughput, sweep
from vocabspec.runtime.tokenizer import load_tokenizer


def llama_server(path: Path, slots: int, window: int, threads: int):
    """llama-server on a free port with `slots` parallel sequences of `window` tokens each."""
    port = free_port()
    cmd = [str(llama_cpp_bin() / "llama-server"), "-m", str(path), "-t", str(threads), "--port", str(port),
           "-np", str(slots), "-c", str(slots * window), "--cont-batching", "--no-warmup"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health").status_code == 200:
                return process, base + "/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not start")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="bundled model name")
    parser.add_argument("--methods", default="vanilla,pld,eagle", help="vocabspec's drafting methods")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="client counts")
    parser.add_argument("--questions", default="builtin", help="question.jsonl (first turns), or builtin")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling")
    parser.add_argument("--requests-per-client", type=int, default=4, help="answers per client per point")
    parser.add_argument("--threads", type=int, default=2, help="threads for llama-server")
    parser.add_argument("--no-llama-server", action="store_true", help="vocabspec's server only")
    parser.add_argument("--out", required=True, help="directory for throughput.json, report.md, the plot")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    result = run_throughput(args.model, args.methods.split(","), concurrencies, args.out, questions=args.questions,
                            max_tokens=args.max_tokens, temperature=args.temperature,
                            requests_per_client=args.requests_per_client)
    out = Path(args.out)
    if args.no_llama_server:
        print(report(result))
        return
    path = resolve_model_path(args.model)
    prompts, chat = prompts_for(load_tokenizer(path), load_questions(args.questions, 1))
    slots = max(concurrencies)
    process, base = llama_server(path, slots, 4096, args.threads)
    try:
        sampling = {"temperature": args.temperature}
        if args.temperature > 0:
            sampling["seed"] = 0
        result["methods"][f"llama-server -np {slots}"] = sweep(base, args.model, prompts, concurrencies,
                                                               args.requests_per_client, args.max_tokens,
                                                               sampling, chat, print)
    finally:
        process.terminate()
        process.wait(timeout=30)
    (out / "throughput.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(report(result))
    plot(result, out / "throughput.png")
    print(report(result))


if __name__ == "__main__":
    main()
