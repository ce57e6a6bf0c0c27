"""A batch job killed halfway and rerun, against the same job uninterrupted (issue 69's bar):

    python scripts/bench_batch_job.py --requests 64 --max-new-tokens 128 --max-batch 64 --out runs/batch-job

Writes N chat requests (the bundled prompts' turns, cycled with a varied lead-in) and runs
`vocabspec generate --input ... --output ...` three times, each a process of its own:
uninterrupted; again, killed with SIGKILL at half the first run's wall time; and that command
rerun. Reports when the first answer line reached the disk against the whole job's wall time,
and whether the resumed file holds exactly the uninterrupted run's answers (tokens, text, stop
reason), none twice, none lost.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "vocabspec" / "data"
LEAD_INS = ["", "Briefly: ", "In plain words: ", "Answer carefully: "]


def make_requests(count: int, max_new_tokens: int) -> list[dict]:
    turns = [turn for name in ("prompts.jsonl", "heldout.jsonl")
             for line in (DATA / name).read_text().splitlines() if line.strip()
             for turn in json.loads(line)["turns"]]
    texts = [LEAD_INS[i // len(turns) % len(LEAD_INS)] + turns[i % len(turns)] for i in range(count)]
    return [{"messages": [{"role": "user", "content": text}], "max_new_tokens": max_new_tokens}
            for text in texts]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def lines_on_disk(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def run(command: list[str], output: Path, kill_after: float | None = None) -> dict:
    """Run the job, polling its output: the time of its first line, its end (or the kill, once
    `kill_after` seconds have passed)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while process.poll() is None:
        count = lines_on_disk(output)
        if first is None and count:
            first = time.perf_counter() - started
        if kill_after is not None and time.perf_counter() - started >= kill_after:
            process.send_signal(signal.SIGKILL)
            process.wait()
            break
        time.sleep(0.02)
    stderr = process.stderr.read()
    return {"seconds": round(time.perf_counter() - started, 2),
            "first_line_seconds": None if first is None else round(first, 2),
            "returncode": process.returncode, "lines": lines_on_disk(output),
            "summary": [line for line in stderr.splitlines() if line.startswith("[")][-1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64, help="requests in the job (default 64)")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="tokens per answer at most (default 128)")
    parser.add_argument("--max-batch", type=int, default=64, help="requests decoding at once (default 64)")
    parser.add_argument("--draft", default="none", help="proposer (default none)")
    parser.add_argument("--out", default="runs/batch-job", help="work directory (default runs/batch-job)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = out / "requests.jsonl"
    requests = make_requests(args.requests, args.max_new_tokens)
    source.write_text("".join(json.dumps(request) + "\n" for request in requests))
    for name in ("whole.jsonl", "resumed.jsonl"):
        for path in (out / name, out / (name + ".job.json")):
            path.unlink(missing_ok=True)

    def command(output: Path) -> list[str]:
        return [sys.executable, "-m", "vocabspec.cli", "generate", "--model", "smollm2", "--input",
                str(source), "--output", str(output), "--max-batch", str(args.max_batch),
                "--draft", args.draft]

    whole, resumed = out / "whole.jsonl", out / "resumed.jsonl"
    report = {"machine": cpu_model(), "requests": args.requests,
              "max_new_tokens": args.max_new_tokens, "max_batch": args.max_batch, "draft": args.draft}
    report["uninterrupted"] = run(command(whole), whole)
    # Halfway by time: with a batch as large as the job, most answers reach max_new_tokens at
    # the same step, so the count of lines jumps from a few to all at the end.
    report["killed"] = run(command(resumed), resumed, kill_after=report["uninterrupted"]["seconds"] / 2)
    report["rerun"] = run(command(resumed), resumed)
    want = {line["index"]: line for line in map(json.loads, whole.read_text().splitlines())}
    got = [json.loads(line) for line in resumed.read_text().splitlines()]
    indices = [line["index"] for line in got]
    report["duplicates"] = len(indices) - len(set(indices))
    report["lost"] = len(set(want) - set(indices))
    report["differing"] = sorted(line["index"] for line in got if
                                 (line.get("tokens"), line.get("text"), line.get("stop_reason")) !=
                                 (want[line["index"]].get("tokens"), want[line["index"]].get("text"),
                                  want[line["index"]].get("stop_reason")))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
