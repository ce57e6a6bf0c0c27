"""Serving memory over many requests: is the in-process server's resident memory flat?

vocabspec's server (continuous batching, `--max-batch` slots) answers `--requests` requests from
8 concurrent OpenAI clients in rounds of `--round`; after each round one more client starts a
streamed answer and disconnects after its first piece. Recorded after every round: the
server process's RSS, and whether every slot is free again once the disconnected request has
been dropped (a cancelled request frees its slot within a step). Writes memory.json and
memory.png to --out.

    python scripts/serving_memory.py --model smollm2 --requests 500 --out docs/bench/serving-memory
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vocabspec.serving.api import load  # noqa: E402
from vocabspec.benchmarks.bench import load_questions  # noqa: E402
from vocabspec.speculation.config import DraftConfig  # noqa: E402
from vocabspec.serving.server import ServerLimits  # noqa: E402
from vocabspec.benchmarks.throughput import prompts_for, rss_mb, run_clients_apart, serve_while  # noqa: E402


def disconnect_once(base_url: str, model: str, prompt, chat: bool) -> None:
    """A streamed request dropped after its first piece."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
    if chat:
        stream = client.chat.completions.create(model=model, messages=prompt, max_tokens=256, stream=True)
    else:
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=256, stream=True)
    next(iter(stream))
    stream.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--draft", default="vanilla", help="a benchmark method name (vanilla, pld, eagle...)")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--round", type=int, default=50, help="requests between measurements")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    lm = load(args.model, draft=DraftConfig.from_method(args.draft), log=print)
    prompts, chat = prompts_for(lm.tokenizer, load_questions("builtin", None))
    limits = ServerLimits(max_tokens_cap=256, max_seconds=600, max_queue=4 * args.clients,
                          max_batch=args.clients, window=min(4096, lm.engine.model.args.max_seq_len))

    def work(base_url: str, batch) -> dict:
        rows, served = [{"requests": 0, "rss_mb": round(rss_mb(), 1), "busy_slots": 0}], 0
        while served < args.requests:
            point = run_clients_apart(base_url, args.model, prompts, args.clients, args.round,
                                      args.max_tokens, {"temperature": 0.0}, chat)
            served += point.requests
            disconnect_once(base_url, args.model, prompts[served % len(prompts)], chat)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(s.generation is not None for s in batch.slots):
                time.sleep(0.05)
            busy = sum(s.generation is not None for s in batch.slots)
            rows.append({"requests": served, "rss_mb": round(rss_mb(), 1), "busy_slots": busy,
                         "tokens_per_s": round(point.tokens_per_s, 1)})
            print(json.dumps(rows[-1]), flush=True)
        return {"rounds": rows}

    result = serve_while(lm, args.model, limits, work)
    rss = [row["rss_mb"] for row in result["rounds"][1:]]
    result.update(model=args.model, draft=args.draft, clients=args.clients, max_tokens=args.max_tokens,
                  date=time.strftime("%Y-%m-%d %H:%M"),
                  rss_first_round_mb=rss[0], rss_last_round_mb=rss[-1],
                  rss_growth_after_first_round_mb=round(rss[-1] - rss[0], 1),
                  slots_busy_after_disconnects=sum(row["busy_slots"] for row in result["rounds"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["requests"] for r in result["rounds"]], [r["rss_mb"] for r in result["rounds"]], marker="o")
        ax.set_xlabel("requests served")
        ax.set_ylabel("server RSS (MB)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"Serving memory, {args.model} ({args.draft}), {args.clients} clients")
        fig.tight_layout()
        fig.savefig(out / "memory.png", dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
