"""Many requests in one captured GPU step, measured in one run within a time budget:
`vocabspec generate --input` over a thousand prompts, transformers' `model.generate` on the
same model at several batch sizes, and the server at many concurrent clients against one.

1. The batch job: --prompts requests (the package's prompts, cycled, as chat) of up to
   --new-tokens greedy tokens each, in --weights on torch's kernels with inexact answers allowed
   (runtime/torch_backend.py: one CUDA graph a step for every request's row), run as
   `generate --input` runs them (serving/batch_job.run_job); answer tokens a second over the
   job's time, every prefill and graph capture included, and how many of a sample of answers
   served alone again differ; then the same job on the row-invariant kernels (--backend triton,
   exact: no --allow-inexact), 8 of its answers compared with the requests served alone; then
   --drafted-prompts of the requests drafted (--draft, each request's tree rows of the shared
   step) against the same requests plain, both on torch's kernels.
2. The peer: transformers' greedy `generate` on the same model (the GGUF read by transformers'
   gguf support), same dtype, prompts and token budget: one left-padded batch of each of
   --peer-batches prompts.
3. The server: vocabspec's server (the same engine) at each of --clients concurrent clients
   (OpenAI clients in a process of their own: benchmarks/throughput.py), tokens a second,
   latency, and answers that differ from the first point's (one client).

Each section starts only while the budget lasts (a peer's batch size, a client count, only
with time left for it) and one that fails is reported while the next runs. Writes run.json and
report.md to --out.

    python scripts/bench_gpu_batch.py --out OUT                  # a GPU: the check, within 8 minutes
    python scripts/bench_gpu_batch.py --out OUT --device cpu --weights f32 --prompts 4 \\
        --new-tokens 4 --peer-batches 2,4 --clients 1,2 --server-prompts 2 --budget-s 300   # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generation import load_transformers, transformers_speed  # noqa: E402
from vocabspec.runtime.loading import resolve_model_path  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "vocabspec" / "data"


@dataclass(frozen=True)
class BenchOptions:
    out: Path
    model: str = "smollm2"
    device: str = "cuda"
    weights: str = "bf16"
    prompts: int = 1024
    new_tokens: int = 256
    peer_batches: tuple[int, ...] = (64, 256, 512, 1024)
    clients: tuple[int, ...] = (1, 64)
    requests_per_client: int = 2
    server_prompts: int = 0          # of the package's prompts, those the clients ask (0: all)
    exact: bool = True               # also the batch job on the row-invariant kernels (--backend triton)
    draft: str = "eagle"             # the drafted batch job's proposer
    drafted_prompts: int = 64        # its requests (0: no drafted job)
    budget_s: float = 480.0


def questions() -> list[dict]:
    """The package's prompts (Spec-Bench's categories, and the held-out ones), first turns."""
    items = []
    for name in ("prompts.jsonl", "heldout.jsonl"):
        items += [json.loads(line) for line in (PROMPTS / name).read_text().splitlines() if line.strip()]
    return items


def cycled(items: list, count: int) -> list:
    return [items[i % len(items)] for i in range(count)]


def batch_job(lm, texts: list[str], options: BenchOptions, alone: int = 0) -> dict:
    """Section 1: the prompts as `generate --input` answers them; `alone` of the answers (spread
    over the job) are compared with the same requests served one at a time, the rest thrown away."""
    from vocabspec.serving.batch_job import Progress, StreamAnswers, run_job

    requests = [{"prompt": text} for text in texts]
    defaults = dict(max_new_tokens=options.new_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=())
    checked = set(range(0, len(requests), max(1, len(requests) // alone))) if alone else set()
    kept = {}

    class Keep(StreamAnswers):
        def write(self, line: dict) -> None:
            if line["index"] in checked:
                kept[line["index"]] = line
            super().write(line)

    with open(os.devnull, "w") as sink:
        result = run_job(lm, requests, list(range(len(requests))), defaults, True, Keep(sink),
                         options.prompts, False, Progress(sys.stderr, len(requests), 0, every=30.0))
    batch = lm._batch
    stats = batch.stats()
    lm._batch = None                   # its slot caches go before the next section's
    batch.close()
    return {"requests": len(requests), "answers": result.answers, "failed": result.failed,
            "failures": result.failures[:3], "answer_tokens": result.tokens,
            "seconds": round(result.seconds, 2), "answer_tok_s": round(result.tokens / result.seconds, 1),
            "slots": len(batch.slots), "batched_rows": batch.together, "engine": stats,
            "alone_checked": result.alone_checked, "alone_differ": result.alone_differ,
            **(compared_alone(lm, texts, kept, options) if alone else {})}


def compared_alone(lm, texts: list[str], kept: dict, options: BenchOptions) -> dict:
    """The kept answers against the same requests served alone, token for token."""
    differ = [index for index, line in sorted(kept.items())
              if lm.generate(texts[index], chat=True, max_new_tokens=options.new_tokens).text != line.get("text")]
    return {"alone_checked": len(kept), "alone_differ": len(differ), "alone_differing": differ[:8]}


def peer(lm, texts: list[str], options: BenchOptions, deadline: float) -> dict:
    """Section 2: transformers' generate at each batch size while time is left (a size is
    skipped where the last one's time, scaled by rows, would pass the deadline)."""
    ids = [lm.encode_prompt(text, chat=True) for text in texts]
    dtype = lm.engine.model.dtype
    hf = load_transformers(resolve_model_path(options.model), dtype, options.device)
    eos = lm.tokenizer.eos_token_id or 0
    transformers_speed(hf, ids[:2], 2, 4, eos, progress=False)          # warm-up
    rows, per_row = {}, 0.0
    for size in options.peer_batches:
        left = deadline - time.perf_counter()
        if per_row * size > left:
            rows[size] = {"skipped": f"about {per_row * size:.0f} s needed, {left:.0f} s left"}
            continue
        rows[size] = transformers_speed(hf, cycled(ids, size), size, options.new_tokens, eos, progress=False)
        per_row = rows[size]["seconds"] / size
        print(f"[transformers at {size} rows: {rows[size]['answer_tok_s']} tok/s]", file=sys.stderr, flush=True)
    return {"dtype": str(dtype), "batches": rows}


def server(lm, options: BenchOptions, deadline: float) -> dict:
    """Section 3: the server at each client count, answers compared with the first count's."""
    from vocabspec.benchmarks.throughput import prompts_for, serve_while, sweep
    from vocabspec.serving.server import ServerLimits

    prompts, chat = prompts_for(lm.tokenizer, questions()[:options.server_prompts or None])
    most = max(options.clients)
    window = min(lm.engine.model.args.max_seq_len, 1024)
    limits = ServerLimits(max_batch=most, max_queue=2 * most, window=window,
                          max_tokens_cap=max(options.new_tokens, 1))

    def work(base_url, batch):
        if time.perf_counter() > deadline:
            return {"skipped": "the budget is spent"}
        return {"slots": len(batch.slots), "batched_rows": batch.together,
                **sweep(base_url, options.model, prompts, list(options.clients), options.requests_per_client,
                        options.new_tokens, {"temperature": 0.0}, chat, stats=batch.stats,
                        log=lambda line: print(f"[server: {line}]", file=sys.stderr, flush=True))}

    return serve_while(lm, options.model, limits, work)


def section(run: dict, name: str, work, deadline: float) -> None:
    started = time.perf_counter()
    if started > deadline:
        run[name] = {"skipped": "the budget is spent"}
        return
    try:
        run[name] = work()
    except Exception as exc:                       # noqa: BLE001 - reported, and the next runs
        run[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    run[name]["section_seconds"] = round(time.perf_counter() - started, 1)
    print(f"[{name}: {json.dumps(run[name])[:400]}]", file=sys.stderr, flush=True)


def report(run: dict) -> str:
    options = run["options"]
    lines = [f"# Many requests in one step: {options['model']}, {options['weights']} on {run['device']}", "",
             f"{options['prompts']} prompts x up to {options['new_tokens']} new tokens, greedy; "
             f"tokens a second over each run's time, prefill included.", "",
             "| generator | rows | answer tok/s | seconds | note |", "|---|---:|---:|---:|---|"]
    job = run.get("batch_job", {})
    if "answer_tok_s" in job:
        if job.get("alone_checked") is not None:
            note = f"{job['alone_differ']} of {job['alone_checked']} sampled answers differ from alone"
        else:
            note = "rows batched, exact" if job.get("batched_rows") else "rows not batched"
        lines.append(f"| vocabspec generate --input | {job['slots']} | {job['answer_tok_s']} | "
                     f"{job['seconds']} | {note} |")
    else:
        lines.append(f"| vocabspec generate --input | | | | {job.get('error') or job.get('skipped')} |")
    exact = run.get("batch_job_exact", {})
    if "answer_tok_s" in exact:
        share = f", {exact['answer_tok_s'] / job['answer_tok_s']:.2f}x the inexact job" if "answer_tok_s" in job else ""
        lines.append(f"| vocabspec generate --input --backend triton | {exact['slots']} | {exact['answer_tok_s']} | "
                     f"{exact['seconds']} | exact; {exact['alone_differ']} of {exact['alone_checked']} answers "
                     f"differ from alone{share} |")
    elif exact:
        lines.append(f"| vocabspec generate --input --backend triton | | | | {exact.get('error') or exact.get('skipped')} |")
    for name, label in (("batch_job_small", "plain"), ("batch_job_drafted", f"--draft {options['draft']}")):
        row = run.get(name, {})
        if "answer_tok_s" in row:
            lines.append(f"| vocabspec generate --input, {label} | {row['slots']} | {row['answer_tok_s']} | "
                         f"{row['seconds']} | {row['requests']} requests; {row['alone_differ']} of "
                         f"{row['alone_checked']} answers differ from alone |")
        elif row:
            lines.append(f"| vocabspec generate --input, {label} | | | | {row.get('error') or row.get('skipped')} |")
    peers = run.get("transformers", {})
    for size, row in peers.get("batches", {}).items():
        if "answer_tok_s" in row:
            lines.append(f"| transformers generate | {size} | {row['answer_tok_s']} | {row['seconds']} | |")
        else:
            lines.append(f"| transformers generate | {size} | | | {row.get('skipped')} |")
    if "error" in peers or "skipped" in peers:
        lines.append(f"| transformers generate | | | | {peers.get('error') or peers.get('skipped')} |")
    lines += ["", "| server clients | tok/s | x one client | p50 latency s | answers differing from one client's |",
              "|---:|---:|---:|---:|---:|"]
    served = run.get("server", {})
    for point in served.get("points", []):
        lines.append(f"| {point['concurrency']} | {point['tokens_per_s']} | {point['x_one_client']} | "
                     f"{point['latency_p50_s']} | {point['answers_differing_from_alone']} |")
    if "points" not in served:
        lines.append(f"| | | | | {served.get('error') or served.get('skipped')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for run.json and report.md")
    parser.add_argument("--model", default="smollm2", help="bundled name or GGUF file")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--weights", default="bf16", choices=("bf16", "f32"))
    parser.add_argument("--prompts", type=int, default=1024, help="requests of the batch job (and its rows)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--peer-batches", default="64,256,512,1024", help="transformers' batch sizes")
    parser.add_argument("--clients", default="1,64", help="server client counts, the first the reference")
    parser.add_argument("--requests-per-client", type=int, default=2,
                        help="answers per client at each count (at least one per prompt asked)")
    parser.add_argument("--server-prompts", type=int, default=0,
                        help="of the package's prompts, those the server's clients ask (0: all)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for every section together")
    parser.add_argument("--no-exact", action="store_true",
                        help="skip the batch job on the row-invariant kernels (--backend triton)")
    parser.add_argument("--draft", default="eagle", help="the drafted batch job's proposer")
    parser.add_argument("--drafted-prompts", type=int, default=64,
                        help="requests of the drafted batch job and its plain twin (0: none)")
    args = parser.parse_args(argv)
    options = BenchOptions(out=Path(args.out), model=args.model, device=args.device, weights=args.weights,
                           prompts=args.prompts, new_tokens=args.new_tokens,
                           peer_batches=tuple(int(b) for b in args.peer_batches.split(",")),
                           clients=tuple(int(c) for c in args.clients.split(",")),
                           requests_per_client=args.requests_per_client, server_prompts=args.server_prompts,
                           budget_s=args.budget_s, exact=not args.no_exact, draft=args.draft,
                           drafted_prompts=args.drafted_prompts)
    started = time.perf_counter()
    deadline = started + options.budget_s
    import vocabspec

    lm = vocabspec.load(options.model, weights=options.weights, device=options.device, backend="torch",
                        allow_inexact=True)
    device = torch.cuda.get_device_name() if options.device == "cuda" else options.device
    run = {"options": {**asdict(options), "out": str(options.out)}, "device": device,
           "runs_on": lm.engine.model.runs_on, "load_seconds": round(time.perf_counter() - started, 1)}
    texts = cycled([q["turns"][0] for q in questions()], options.prompts)
    section(run, "batch_job", lambda: batch_job(lm, texts, options), deadline)
    if options.exact:      # the row-invariant kernels: no --allow-inexact, answers compared with alone
        exact = vocabspec.load(options.model, weights=options.weights, device=options.device, backend="triton")
        section(run, "batch_job_exact", lambda: batch_job(exact, texts, options, alone=8), deadline)
        del exact
    if options.drafted_prompts:     # trees in the shared step against the same requests plain
        few = replace(options, prompts=options.drafted_prompts)
        section(run, "batch_job_small", lambda: batch_job(lm, texts[:few.prompts], few, alone=4), deadline)
        drafted = vocabspec.load(options.model, weights=options.weights, device=options.device, backend="torch",
                                 allow_inexact=True, draft=options.draft)
        section(run, "batch_job_drafted", lambda: batch_job(drafted, texts[:few.prompts], few, alone=4), deadline)
        del drafted
    section(run, "transformers", lambda: peer(lm, texts, options, deadline), deadline)
    section(run, "server", lambda: server(lm, options, deadline), deadline)
    run["seconds"] = round(time.perf_counter() - started, 1)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    (options.out / "report.md").write_text(report(run))
    print(report(run))
    failed = [name for name in ("batch_job", "batch_job_exact", "batch_job_small", "batch_job_drafted",
                                "transformers", "server")
              if "error" in run.get(name, {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
