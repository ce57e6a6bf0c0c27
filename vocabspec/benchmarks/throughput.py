"""The serving benchmark: concurrent clients against an OpenAI-compatible server, ours or a peer's.

At each concurrency c, c clients (the official `openai` package, one thread each, in a process
of their own) ask for answers to the same prompts in turn, every client taking the next prompt
as soon as its last answer is complete, until `requests` answers are in. Reported per concurrency: the aggregate
completion tokens per second over the run's wall time, each request's latency (sent to last
token) at the median and the 95th percentile, and how many answers differ from the same
request answered alone (the first concurrency's, 1 by default): 0 is the promise.

`serve_while` serves vocabspec on a free port while the clients run, so one process can
benchmark it with and without speculation; a peer (llama.cpp's llama-server) is any base URL.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Point:
    concurrency: int
    requests: int
    seconds: float
    tokens: int
    latencies: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def latency(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else 0.0

    def as_dict(self) -> dict:
        return {"concurrency": self.concurrency, "requests": self.requests, "seconds": round(self.seconds, 3),
                "tokens": self.tokens, "tokens_per_s": round(self.tokens_per_s, 2),
                "latency_p50_s": round(self.latency(0.5), 3), "latency_p95_s": round(self.latency(0.95), 3)}


def run_clients(base_url: str, model: str, prompts: list[dict], concurrency: int, requests: int,
                max_tokens: int, sampling: dict, chat: bool = True) -> Point:
    """`requests` answers with `concurrency` clients in a closed loop; request i asks for
    prompts[i % len(prompts)] (a chat message list, or text for /v1/completions)."""
    from openai import OpenAI

    clients = [OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600) for _ in range(concurrency)]
    answers: list[str | None] = [None] * requests
    latencies: list[float] = [0.0] * requests
    tokens = [0] * requests
    taken = iter(range(requests))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(index: int) -> None:
        api = clients[index]
        while True:
            with lock:
                i = next(taken, None)
            if i is None:
                return
            item = prompts[i % len(prompts)]
            start = time.perf_counter()
            try:
                if chat:
                    reply = api.chat.completions.create(model=model, messages=item, max_tokens=max_tokens,
                                                        **sampling)
                    answers[i] = reply.choices[0].message.content
                else:
                    reply = api.completions.create(model=model, prompt=item, max_tokens=max_tokens, **sampling)
                    answers[i] = reply.choices[0].text
            except BaseException as exc:       # noqa: BLE001 - reported below
                errors.append(exc)
                return
            latencies[i] = time.perf_counter() - start
            tokens[i] = reply.usage.completion_tokens

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, the first: {errors[0]!r}")
    return Point(concurrency, requests, seconds, sum(tokens), latencies, [a or "" for a in answers])


def run_clients_apart(base_url: str, model: str, prompts: list, concurrency: int, requests: int,
                      max_tokens: int, sampling: dict, chat: bool = True) -> Point:
    """`run_clients` in a process of its own, as real clients are: the clients' Python does not
    share the server's interpreter (nor its lock) when the server runs in this process."""
    import json
    import subprocess
    import sys

    job = json.dumps({"base_url": base_url, "model": model, "prompts": prompts, "concurrency": concurrency,
                      "requests": requests, "max_tokens": max_tokens, "sampling": sampling, "chat": chat})
    done = subprocess.run([sys.executable, "-m", "vocabspec.benchmarks.throughput"], input=job, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the clients failed:\n{done.stderr[-2000:]}")
    data = json.loads(done.stdout)
    return Point(concurrency, requests, data["seconds"], data["tokens"], data["latencies"], data["answers"])


def sweep(base_url: str, model: str, prompts: list, concurrencies: list[int], requests_per_client: int,
          max_tokens: int, sampling: dict, chat: bool = True, log: Callable[[str], None] | None = None,
          stats: Callable[[], dict] | None = None) -> dict:
    """Every concurrency in turn; answers compared with the first concurrency's (alone, at 1).
    `stats()`: the server's step counters (BatchEngine.stats), read around each point for the
    rows per step, the share of requests' steps that drafted and the stepping thread's time."""
    points, reference = [], None
    for c in concurrencies:
        before = stats() if stats else None
        point = run_clients_apart(base_url, model, prompts, c, max(c * requests_per_client, len(prompts)),
                                  max_tokens, sampling, chat)
        if reference is None:
            reference = {i % len(prompts): a for i, a in enumerate(point.answers)}
        differing = sum(a != reference[i % len(prompts)] for i, a in enumerate(point.answers))
        row = {**point.as_dict(), "answers_differing_from_alone": differing}
        if stats:       # the server is this process: its memory and step counters
            row["rss_mb"] = round(rss_mb(), 1)
            after = stats()
            steps = after["steps"] - before["steps"]
            row["rows_per_step"] = round((after["rows"] - before["rows"]) / max(steps, 1), 2)
            row["drafted_per_step"] = round((after["drafted"] - before["drafted"]) / max(steps, 1), 2)
            # The stepping thread's time in steps and in joining requests' prefill, over the
            # point's wall time: what is left is waiting on requests (or on the machine).
            for part in ("steps", "prefill"):
                spent = after[f"{part}_seconds"] - before[f"{part}_seconds"]
                row[f"{part}_share"] = round(spent / point.seconds, 3) if point.seconds else 0.0
        points.append(row)
        if log:
            log(f"{c} clients: {row['tokens_per_s']} tok/s, p50 {row['latency_p50_s']} s, "
                f"p95 {row['latency_p95_s']} s, {differing} answers differ from alone")
    one = points[0]["tokens_per_s"]
    for row in points:
        row["x_one_client"] = round(row["tokens_per_s"] / one, 2) if one else 0.0
        row["p50_x_one_client"] = round(row["latency_p50_s"] / points[0]["latency_p50_s"], 2) \
            if points[0]["latency_p50_s"] else 0.0
    return {"points": points}


def rss_mb() -> float:
    """This process's resident memory (the in-process server's), MB; 0 where /proc is absent."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def serve_while(lm, model_name: str, limits, work: Callable[..., dict]) -> dict:
    """vocabspec's server for `lm` on a free local port while `work(base_url, batch)` runs
    (batch: the server's BatchEngine): HTTP on a thread, `work` on another, the batch's steps on
    this one (the main thread's, as `serve` runs them: batch.py says why). Returns what `work`
    returns."""
    from ..serving.server import HTTPThread, create_app

    app = create_app(lm, model_name, limits, batch_thread=False)
    batch = app.state.server.batch
    http = HTTPThread(app)
    base = http.wait_ready()
    outcome: dict = {}

    def run_work() -> None:
        try:
            outcome["result"] = work(base + "/v1", batch)
        except BaseException as exc:      # noqa: BLE001 - raised below, on this thread
            outcome["error"] = exc

    worker = threading.Thread(target=run_work, daemon=True)
    worker.start()
    try:
        batch.run(until=lambda: not worker.is_alive())
    finally:
        http.stop()
        batch.close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def prompts_for(tokenizer, questions: list[dict]) -> tuple[list, bool]:
    """Each question's first turn as the server takes it: chat messages for a chat model, the
    project's Question/Answer frame as text for a base model (then /v1/completions)."""
    from ..runtime.prompts import conversation_text, is_chat

    if is_chat(tokenizer):
        return [[{"role": "user", "content": q["turns"][0]}] for q in questions], True
    return [conversation_text(tokenizer, [("user", q["turns"][0])], answer_open=True) for q in questions], False


def run_throughput(model: str, methods: list[str], concurrencies: list[int], out: str, questions: str = "builtin",
                   per_category: int | None = 1, max_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
                   requests_per_client: int = 4, weights: str = "auto", max_batch: int | None = None,
                   log: Callable[[str], None] = print) -> dict:
    """The serving benchmark for vocabspec's server with each drafting method (vanilla: none),
    one in-process server per method, `max_batch` slots (default: the largest concurrency).
    Writes throughput.json, report.md and throughput.png to `out`."""
    import gc
    import json
    from pathlib import Path

    from ..serving.api import load
    from .bench import load_questions
    from ..speculation.config import DraftConfig
    from ..serving.server import ServerLimits

    asked = load_questions(questions, per_category)
    sampling = {"temperature": temperature}
    if temperature > 0:
        sampling["seed"] = seed
    result = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "prompts": len(asked),
              "date": time.strftime("%Y-%m-%d %H:%M"), "methods": {}}
    slots = max_batch or max(concurrencies)
    for method in methods:
        lm = None
        gc.collect()            # the last method's model and caches, before the next loads
        lm = load(model, draft=DraftConfig.from_method(method), weights=weights, log=log)
        prompts, chat = prompts_for(lm.tokenizer, asked)
        if "curve_ms" not in result:     # the target's forward at as many rows as clients, this run
            result["curve_ms"] = curve_ms(lm.engine.model, concurrencies)
        limits = ServerLimits(max_tokens_cap=max(max_tokens, 256), max_seconds=600, max_queue=4 * slots,
                              max_batch=slots, window=min(4096, lm.engine.model.args.max_seq_len))
        log(f"{method}: {slots} slots")
        result["methods"][method] = serve_while(
            lm, model, limits, lambda base, batch: sweep(base, model, prompts, concurrencies, requests_per_client,
                                                         max_tokens, sampling, chat, log, batch.stats))
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "throughput.json").write_text(json.dumps(result, indent=1))
    (directory / "report.md").write_text(report(result))
    plot(result, directory / "throughput.png")
    return result


def curve_ms(model, concurrencies: list[int]) -> dict[str, float]:
    """The cost curve at each concurrency's rows (one sequence, a 256-token context), ms: what
    c clients could get at most is c x forward(1) / forward(c) of one client's tokens per
    second, steps at the curve with nothing else (no prefill, no second sequence's cache)."""
    from ..decoding.cost_curve import forward_seconds

    seconds = forward_seconds(model, sorted({c - 1 for c in concurrencies} | {0}), repeats=5)
    return {str(n + 1): round(s * 1e3, 3) for n, s in seconds.items()}


def report(result: dict) -> str:
    curve = result.get("curve_ms")
    allows = "" if not curve else "; the curve allows c clients " + ", ".join(
        f"{c}: {int(c) * curve['1'] / ms:.2f}x" for c, ms in curve.items() if c != "1") + " one client's tok/s"
    lines = [f"# Serving: {result['model']} ({result['prompts']} prompts, {result['max_tokens']} tokens, "
             f"temperature {result['temperature']}), {result['date']}{allows}", "",
             "| method | clients | tok/s | x one client | p50 s | p95 s | p50 x one client | answers differing "
             "from alone | rows per step | drafted trees per step | server RSS MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method, data in result["methods"].items():
        for row in data["points"]:
            lines.append(f"| {method} | {row['concurrency']} | {row['tokens_per_s']} | {row['x_one_client']}x | "
                         f"{row['latency_p50_s']} | {row['latency_p95_s']} | {row['p50_x_one_client']}x | "
                         f"{row['answers_differing_from_alone']} | {row.get('rows_per_step', '-')} | "
                         f"{row.get('drafted_per_step', '-')} | {row.get('rss_mb', '-')} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method, data in result["methods"].items():
        xs = [row["concurrency"] for row in data["points"]]
        left.plot(xs, [row["tokens_per_s"] for row in data["points"]], marker="o", label=method)
        right.plot(xs, [row["latency_p50_s"] for row in data["points"]], marker="o", label=method)
    left.set(xlabel="concurrent clients", ylabel="aggregate tokens/s", xscale="log", title="Throughput")
    right.set(xlabel="concurrent clients", ylabel="p50 latency (s)", xscale="log", title="Latency")
    for axis in (left, right):
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.legend()
    fig.suptitle(f"{result['model']}: continuous batching")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":      # run_clients_apart's client process: a job on stdin, the point on stdout
    import json
    import sys

    job = json.loads(sys.stdin.read())
    point = run_clients(**job)
    print(json.dumps({"seconds": point.seconds, "tokens": point.tokens, "latencies": point.latencies,
                      "answers": point.answers}))
