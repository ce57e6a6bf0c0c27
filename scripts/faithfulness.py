"""How far each run-time weight format moves the model from the float32-dequantized one (the
`f32` format: gguf-py's float32 values of the file's weights, float32 arithmetic): the largest
|logit difference| over every position of the 13 Spec-Bench category prompts (one per
category), and greedy agreement: how many of the 13 answers (64 new tokens) are identical, and
the mean share of tokens before the first difference. With --llama-cpp, llama.cpp's own greedy
answers on the same GGUF join the agreement columns (its text re-encoded by our tokenizer).

    python scripts/faithfulness.py --models smollm2,gemma3 --out docs/bench/faithfulness.json
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch

from vocabspec.benchmarks.bench import BUILTIN_QUESTIONS
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.decoding.batch import Engine
from vocabspec.runtime.loading import load_model
from vocabspec.runtime.prompts import encode_conversation
from vocabspec.runtime.tokenizer import load_tokenizer

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
QUESTIONS = QUESTIONS if QUESTIONS.exists() else BUILTIN_QUESTIONS   # the project's own prompts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3", help="comma-separated model names")
    parser.add_argument("--weights", default="gguf,gguf-a8,bf16", help="formats compared with f32")
    parser.add_argument("--questions", default=str(QUESTIONS), help="Spec-Bench question.jsonl")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per answer")
    parser.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also llama.cpp's own greedy answers (llama-completion, the same GGUF; "
                             "scripts/build_llamacpp.sh), re-encoded by our tokenizer")
    parser.add_argument("--out", default=None, help="write the result as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seen = {}
    for line in Path(args.questions).read_text().splitlines():
        q = json.loads(line)
        seen.setdefault(q["category"], q["turns"][0])
    result = {"date": str(date.today()), "prompts": len(seen), "new_tokens": args.new_tokens, "models": {}}
    config = GenerationConfig(max_new_tokens=args.new_tokens, stop_on_eos=False)
    for name in args.models.split(","):
        reference, path = load_model(name, weights="f32")
        tokenizer = load_tokenizer(path)
        prompts = [encode_conversation(tokenizer, [("user", t)], answer_open=True) for t in seen.values()]
        want = [logits_of(reference, ids) for ids in prompts]
        want_tokens = [Engine(reference, tokenizer).generate(ids, config).tokens for ids in prompts]
        del reference
        rows = {}
        for weights in args.weights.split(","):
            model, _ = load_model(name, weights=weights)
            diff = max(float((logits_of(model, ids) - w).abs().max()) for ids, w in zip(prompts, want))
            engine = Engine(model, tokenizer)
            same, shares = 0, []
            for ids, ref in zip(prompts, want_tokens):
                out = engine.generate(ids, config).tokens
                same += out == ref
                first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref))
                shares.append(first / len(ref))
            rows[weights] = {"max_abs_logit_diff": round(diff, 4), "identical_answers": same,
                             "mean_share_before_first_difference": round(sum(shares) / len(shares), 3)}
            print(json.dumps({"model": name, "weights": weights, **rows[weights]}), flush=True)
            del model, engine
        if args.llama_cpp:
            from llamacpp import LlamaCppTool

            tool = LlamaCppTool(path, tokenizer, args.threads, lookup=False)
            same, shares = 0, []
            for ids, ref in zip(prompts, want_tokens):
                out = tokenizer.encode(tool.answer(ids, args.new_tokens), add_bos=False)[:len(ref)]
                same += out == ref
                first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
                shares.append(first / len(ref))
            rows["llama.cpp"] = {"max_abs_logit_diff": None, "identical_answers": same,
                                 "mean_share_before_first_difference": round(sum(shares) / len(shares), 3)}
            print(json.dumps({"model": name, "weights": "llama.cpp", **rows["llama.cpp"]}), flush=True)
        result["models"][name] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def logits_of(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden, _ = model.tree_forward(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids) + 8))
    return model.lm_head(hidden)


if __name__ == "__main__":
    main()
