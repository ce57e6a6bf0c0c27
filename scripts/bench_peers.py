"""vocabspec against the engines a CPU user would pick instead, on the same GGUF file, side by
side in one run: llama.cpp's own C++ tools (llama-completion plain, llama-lookup prompt
lookup; built by scripts/build_llamacpp.sh), llama-cpp-python's generate loop where it is
installed (what Python users get), transformers' greedy `generate`, and vocabspec's plain
decoding in every weight format plus its speculative methods. One first-turn prompt per
Spec-Bench category (13), 128 new tokens, greedy, prefill included (llama.cpp's tools report
their prompt and generation times; their model loading is left out, as ours is); every engine
answers a prompt before the next prompt starts (machine drift hits all alike), and the whole
sweep repeats --runs times: the table gives each engine's median tokens/s over runs, with the
spread (lowest-highest). Every vocabspec method's tokens are compared with vocabspec's plain
decoding in the same format (0 mismatches is the promise). Decode alone: llama-bench tg128
after 0 and 256 tokens (`--decode-only`).

    bash scripts/build_llamacpp.sh
    python scripts/bench_peers.py --model smollm2 --runs 3 --out docs/bench/peers-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from datetime import date
from pathlib import Path

import torch

from llamacpp import LlamaCppTool, decode_only
from vocabspec.benchmarks.bench import BUILTIN_QUESTIONS
from vocabspec.runtime.formats import FORMATS
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.decoding.batch import Engine
from vocabspec.runtime.loading import load_model, resolve_model_path
from vocabspec.speculation.config import DraftConfig
from vocabspec.tuning.proposers import make_proposer
from vocabspec.runtime.tokenizer import load_tokenizer
from vocabspec.runtime.prompts import encode_conversation

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
QUESTIONS = QUESTIONS if QUESTIONS.exists() else BUILTIN_QUESTIONS   # the project's own prompts


def prompts(tokenizer, path: Path) -> list[list[int]]:
    seen = {}
    for line in path.read_text().splitlines():
        q = json.loads(line)
        seen.setdefault(q["category"], q["turns"][0])
    return [encode_conversation(tokenizer, [("user", text)], answer_open=True) for text in seen.values()]


class LlamaCppPython:
    """llama-cpp-python's generate loop (its Python loop is part of what it measures)."""

    def __init__(self, path, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)

    def generate(self, ids, new_tokens):
        out = []
        for token in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if token == self.llm.token_eos() or len(out) == new_tokens:
                break
            out.append(token)
        return out


class Transformers:
    def __init__(self, path, dtype):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=dtype).eval()

    def generate(self, ids, new_tokens, eos):
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                      eos_token_id=eos, pad_token_id=0)
        return [t for t in out[0, len(ids):].tolist() if t not in eos]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="bundled model name")
    parser.add_argument("--questions", default=str(QUESTIONS), help="Spec-Bench question.jsonl")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per answer")
    parser.add_argument("--runs", type=int, default=3, help="sweeps over every engine and prompt")
    parser.add_argument("--threads", type=int, default=2, help="threads for every engine")
    parser.add_argument("--weights", default=",".join(FORMATS), help="vocabspec formats")
    parser.add_argument("--methods", default="pld,eagle,eagle+pld",
                        help="vocabspec's speculative methods, in every format (draft[:vocab][@DxN])")
    parser.add_argument("--transformers", default="float32,bfloat16",
                        help="transformers' dtypes to run (empty: none)")
    parser.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp")
    parser.add_argument("--binding", action="store_true",
                        help="also llama-cpp-python's generate loop (needs it installed)")
    parser.add_argument("--decode-only", action="store_true",
                        help="also llama-bench's tg128 after 0 and 256 tokens")
    parser.add_argument("--out", default=None, help="write the result as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    engines, ours = {}, {}
    path = resolve_model_path(args.model)
    for weights in args.weights.split(","):
        # One target per format, shared by its methods (each engine keeps its own cache).
        target, _ = load_model(args.model, weights=weights)
        tokenizer = load_tokenizer(path)
        for method in ["none"] + [m for m in args.methods.split(",") if m]:
            draft, _, rest = method.partition(":")
            vocab, _, tree = rest.partition("@")
            depth, total = (int(v) for v in tree.split("x")) if tree else (6, "auto")
            config = DraftConfig(method=draft, vocab=vocab or "auto", depth=depth, total_tokens=total)
            engine = Engine(target, tokenizer, make_proposer(target, config, args.model, tokenizer))
            ours[f"vocabspec {weights} {method if draft != 'none' else 'plain'}"] = (engine, weights)
    eos = sorted(next(iter(ours.values()))[0].eos_ids)
    if not args.no_llamacpp:
        engines["llama.cpp plain"] = LlamaCppTool(path, tokenizer, args.threads, lookup=False)
        engines["llama.cpp prompt lookup"] = LlamaCppTool(path, tokenizer, args.threads, lookup=True)
    if args.binding:
        engines["llama-cpp-python plain"] = LlamaCppPython(path, args.threads)
    for dtype in filter(None, args.transformers.split(",")):
        engines[f"transformers {dtype}"] = Transformers(path, getattr(torch, dtype))
    ids_list = prompts(tokenizer, Path(args.questions))
    names = list(engines) + list(ours)
    speeds = {name: [] for name in names}
    mismatches = {name: 0 for name in ours}
    config = GenerationConfig(max_new_tokens=args.new_tokens)
    for name, (engine, _) in ours.items():    # warm-up outside the clock
        engine.generate(ids_list[0], GenerationConfig(max_new_tokens=8))
    for run in range(args.runs):
        tokens = {name: 0 for name in names}
        seconds = {name: 0.0 for name in names}
        for ids in ids_list:
            plain = {}
            for name in names:
                start = time.perf_counter()
                if isinstance(engines.get(name), LlamaCppTool):     # its own clock, no loading
                    count, spent = engines[name].generate(ids, args.new_tokens)
                    seconds[name] += spent
                    tokens[name] += count
                    continue
                if name in engines:
                    engine = engines[name]
                    out = engine.generate(ids, args.new_tokens, eos) if name.startswith("transformers") \
                        else engine.generate(ids, args.new_tokens)
                else:
                    engine, weights = ours[name]
                    out = engine.generate(ids, config).tokens
                    if name.endswith(" plain"):
                        plain[weights] = out
                    elif out != plain.get(weights):
                        mismatches[name] += 1
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(out)
        for name in names:
            speeds[name].append(tokens[name] / seconds[name])
        print(json.dumps({"run": run, "tokens_per_s": {n: round(s[-1], 1) for n, s in speeds.items()}}),
              flush=True)
    base = statistics.median(speeds["llama.cpp plain"]) if "llama.cpp plain" in speeds else None
    rows = {name: {"tokens_per_s": round(statistics.median(s), 1), "low": round(min(s), 1),
                   "high": round(max(s), 1),
                   "vs_llamacpp_plain": round(statistics.median(s) / base, 2) if base else None,
                   **({"mismatches": mismatches[name]} if name in mismatches else {})}
            for name, s in speeds.items()}
    result = {"model": args.model, "date": str(date.today()), "machine": machine(),
              "threads": args.threads, "prompts": len(ids_list), "new_tokens": args.new_tokens,
              "runs": args.runs, "commit": commit(), "engines": rows}
    if args.decode_only:
        result["llama_bench"] = decode_only(path, args.threads)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, torch {torch.__version__}"


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


if __name__ == "__main__":
    main()
