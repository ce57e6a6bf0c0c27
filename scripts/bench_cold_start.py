"""A model's first call and warm call as a user makes them: `vocabspec generate` in a fresh
process, from an empty cache (VOCABSPEC_CACHE a new directory: the engine compiled, the
tokenizer converted, the GGUF packed) and then warm; for each, the time to the first streamed
byte of the answer, the whole call's time and the process's peak resident memory (getrusage of
the child), beside llama.cpp's own llama-completion on the same file.

    python scripts/bench_cold_start.py --model /tmp/llama-3.1-8b-Q4_K_M.gguf --tokens 48
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

LLAMA_COMPLETION = Path(os.environ.get("LCPP_DIR", Path.home() / ".lcpp")) / "bin" / "llama-completion"
PROMPT = "The history of the printing press begins"


def timed_call(command: list[str], env: dict) -> dict:
    """Seconds to the first byte on stdout, seconds in all, and the child's own peak RSS (GiB,
    from wait4's rusage of that child alone)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = process.stdout.read(1)
    first_s = time.perf_counter() - start
    err = []
    reader = threading.Thread(target=lambda: err.append(process.stderr.read()))
    reader.start()
    process.stdout.read()
    reader.join()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    total_s = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])}: exit {process.returncode}\n{err[0].decode()[-2000:]}")
    return {"first_byte_s": round(first_s if first else total_s, 2), "total_s": round(total_s, 2),
            "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2), "stderr_tail": err[0].decode()[-300:]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="append the result as a JSON line")
    args = parser.parse_args()
    ours = [sys.executable, "-m", "vocabspec.cli", "generate", "--model", str(args.model), "--max-new-tokens",
            str(args.tokens), "--threads", str(args.threads), PROMPT]
    lcpp = [str(LLAMA_COMPLETION), "-m", str(args.model), "-n", str(args.tokens), "-t", str(args.threads),
            "-p", PROMPT, "--no-warmup", "-no-cnv", "--temp", "0", "-c", "4096"]   # our default context
    result = {"date": str(date.today()), "machine": platform.processor() or platform.machine(),
              "file": args.model.name, "file_gib": round(args.model.stat().st_size / 2**30, 2)}
    cache = Path(tempfile.mkdtemp(prefix="vocabspec-cold-"))
    try:
        env = dict(os.environ, VOCABSPEC_CACHE=str(cache))
        result["llamacpp"] = timed_call(lcpp, dict(os.environ))
        result["ours_first"] = timed_call(ours, env)
        result["ours_warm"] = timed_call(ours, env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
