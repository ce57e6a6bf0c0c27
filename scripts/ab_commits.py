"""A pinned A/B: this checkout's decoding speed against a named earlier commit, on this machine,
interleaved prompt by prompt so that the machine's drift falls on both alike.

Each commit runs from a worktree of its own (`git worktree add`, under the cache directory),
through its own `vocabspec generate --json` in a fresh process per call, with the same venv; the
call's own `seconds` (decoding, the model already loaded) gives its tokens per second. A round
runs every prompt on both commits, the order swapped each round. Printed: per model and
method, the ratio HEAD / BASE of tokens per second (the geometric mean over the calls) and each
call's ratio. 4 held-out code prompts x 2 rounds x 128 tokens by default: what BENCHMARKS pins.
With --llamacpp, llama.cpp's own llama-completion (scripts/llamacpp.py) answers every prompt in
the same interleaving, and each commit's speed is given against it too (geometric means of the
per-prompt ratios): the ratio to llama.cpp before and after, in one run.

    python scripts/ab_commits.py --base a0623c9 --models smollm2,gemma3 --methods none,eagle --llamacpp
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "vocabspec" / "data" / "heldout.jsonl"


def worktree(commit: str, home: Path) -> Path:
    """A checkout of `commit` (this repository's), made once."""
    sha = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    path = home / f"ab-{sha[:12]}"
    if not (path / "vocabspec").is_dir():
        subprocess.run(["git", "worktree", "add", "--force", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def prompts(category: str, count: int) -> list[str]:
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows if r["category"] == category][:count]


def run(checkout: Path, model: str, method: str, prompt: str, tokens: int, threads: int | None) -> dict:
    """One `vocabspec generate --json` call of `checkout`'s code: its JSON result."""
    chat = model == "smollm2"
    text = prompt if chat else f"Question: {prompt}\n\nAnswer:"
    command = [sys.executable, "-m", "vocabspec.cli", "generate", "--model", model, "--json",
               "--max-new-tokens", str(tokens), "--draft", method, *(["--chat"] if chat else []),
               *(["--threads", str(threads)] if threads else []), text]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout.name}: {' '.join(command[3:8])} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llamacpp_peer(model: str, threads: int | None):
    """A callable prompt -> (tokens, seconds) running llama.cpp's llama-completion on the text
    `run` sends (the model's chat template for SmolLM2), the same GGUF file."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from llamacpp import LlamaCppTool
    from vocabspec.runtime.loading import resolve_model_path
    from vocabspec.runtime.tokenizer import load_tokenizer

    path = resolve_model_path(model)
    tokenizer = load_tokenizer(path)
    tool = LlamaCppTool(path, tokenizer, threads or os.cpu_count(), lookup=False)

    def generate(prompt: str, tokens: int) -> tuple[int, float]:
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if model == "smollm2" else \
            tokenizer.encode(f"Question: {prompt}\n\nAnswer:")
        return tool.generate(ids, tokens)
    return generate


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="a0623c9", help="the earlier commit")
    parser.add_argument("--head", default="HEAD", help="the commit measured against it")
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--methods", default="none", help="--draft values, comma-separated")
    parser.add_argument("--category", default="code")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--llamacpp", action="store_true", help="llama.cpp's llama-completion in the same run")
    parser.add_argument("--out", type=Path, default=None, help="write the calls and ratios as JSON")
    args = parser.parse_args()
    home = Path(os.environ.get("VOCABSPEC_CACHE", Path.home() / ".cache" / "vocabspec"))
    home.mkdir(parents=True, exist_ok=True)
    checkouts = {"base": worktree(args.base, home), "head": worktree(args.head, home) if args.head != "HEAD" else ROOT}
    texts = prompts(args.category, args.prompts)
    calls, summary = [], {}
    for model in args.models.split(","):
        peer = llamacpp_peer(model, args.threads) if args.llamacpp else None
        for method in args.methods.split(","):
            for name in checkouts:                  # warm-up: build, pack and tune outside the timing
                run(checkouts[name], model, method, texts[0], 8, args.threads)
            ratios, against = [], {"base": [], "head": []}
            for round_ in range(args.rounds):
                for index, prompt in enumerate(texts):
                    order = ["base", "head"] if (round_ + index) % 2 == 0 else ["head", "base"]
                    speed = {}
                    if peer is not None:
                        tokens, seconds = peer(prompt, args.max_new_tokens)
                        speed["llama.cpp"] = tokens / seconds
                    for name in order:
                        out = run(checkouts[name], model, method, prompt, args.max_new_tokens, args.threads)
                        speed[name] = out["new_tokens"] / out["seconds"]
                        calls.append({"model": model, "method": method, "round": round_, "prompt": index,
                                      "commit": name, "tokens": out["new_tokens"], "seconds": out["seconds"],
                                      "mean_accept_len": out.get("mean_accept_len")})
                    ratios.append(speed["head"] / speed["base"])
                    for name in against if peer is not None else ():
                        against[name].append(speed[name] / speed["llama.cpp"])
                    print(f"{model} {method} round {round_} prompt {index}: head {speed['head']:.1f}, "
                          f"base {speed['base']:.1f}" + (f", llama.cpp {speed['llama.cpp']:.1f}" if peer else "") +
                          f" tok/s ({ratios[-1]:.3f})", flush=True)
            mean = geometric_mean(ratios)
            summary[f"{model} {method}"] = round(mean, 3)
            print(f"== {model} {method}: HEAD / {args.base} = {mean:.3f} "
                  f"(calls {min(ratios):.3f} .. {max(ratios):.3f})", flush=True)
            if peer is not None:
                for name in against:
                    summary[f"{model} {method} {name} / llama.cpp"] = round(geometric_mean(against[name]), 3)
                print(f"== {model} {method} against llama.cpp: base {geometric_mean(against['base']):.3f}x, "
                      f"head {geometric_mean(against['head']):.3f}x", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"base": args.base, "head": args.head, "ratios": summary, "calls": calls},
                                       indent=1))
    print(json.dumps(summary))


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


if __name__ == "__main__":
    main()
