"""The GPU check: exactness, read-backs and speed on one CUDA device, in a few minutes.

1. Exactness: on the Spec-Bench category prompts, greedy EAGLE-2 (static steps) and prompt
   lookup against plain decoding, in float32 (TF32 off; must be 0 mismatches) and bfloat16
   (torch's kernels are not row-count invariant there: mismatches are counted and reported).
2. Read-backs: every way a tensor reaches the host is counted over a generation (static
   steps): at most one a step.
3. Speed: tokens/s of plain decoding and the main methods, float32 and bfloat16, SmolLM2.
4. Drafting cost on a random model shaped like Llama-3-8B (128k vocabulary): drafting time a
   step with FR-Spec's 32k head against the full head.

Writes report.md and run.json to the folder given.

    python scripts/gpu_check.py --gguf /tmp/smollm2.gguf --prompts prompts.json --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vocabspec.drafter import EagleDrafter, EagleProposer  # noqa: E402
from vocabspec.draft_vocab import FullVocab, StaticSubset  # noqa: E402
from vocabspec.generate import Engine, GenerationConfig  # noqa: E402
from vocabspec.loading import load_model  # noqa: E402
from vocabspec.model import ModelArgs, Transformer  # noqa: E402
from vocabspec.pld import PromptLookupProposer  # noqa: E402
from vocabspec.prompts import encode_conversation  # noqa: E402
from vocabspec.static_step import count_read_backs  # noqa: E402
from vocabspec.token_map import load_token_map  # noqa: E402
from vocabspec.tokenizer import load_tokenizer  # noqa: E402

DRAFTER = Path(__file__).resolve().parents[1] / "vocabspec" / "drafters" / "smollm2"


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def methods(model):
    drafter = EagleDrafter.load(DRAFTER, model)
    full = FullVocab(model.embed.weight.to(drafter.fc.weight.dtype))
    fr = StaticSubset(model.embed.weight, load_token_map(DRAFTER / "token_map_fr.pt")[:32768],
                      name="fr:32k", dtype=drafter.fc.weight.dtype)
    return {"plain": None, "pld": PromptLookupProposer(device=model.device),
            "eagle2 5x48": EagleProposer(drafter, head=full, depth=5, top_k=8, total_tokens=48),
            "eagle2+fr:32k 5x48": EagleProposer(drafter, head=fr, depth=5, top_k=8, total_tokens=48)}


def check_model(path: Path, prompts: list[str], weights: str, new_tokens: int) -> dict:
    model, _ = load_model(str(path), weights=weights, device=DEVICE, backend="torch")
    tokenizer = load_tokenizer(path)
    ids = [encode_conversation(tokenizer, [("user", p)], answer_open=True) for p in prompts]
    config = GenerationConfig(max_new_tokens=new_tokens)
    engines = {name: Engine(model, tokenizer, proposer, allow_inexact=True, static=True)
               for name, proposer in methods(model).items()}
    for engine in engines.values():                      # warm-up
        engine.generate(ids[0], GenerationConfig(max_new_tokens=8))
    rows = {name: {"tokens": 0, "seconds": 0.0, "steps": 0, "mismatches": 0} for name in engines}
    for prompt in ids:
        reference = None
        for name, engine in engines.items():
            sync()
            start = time.perf_counter()
            out = engine.generate(prompt, config)
            sync()
            row = rows[name]
            row["seconds"] += time.perf_counter() - start
            row["tokens"] += out.new_tokens
            row["steps"] += len(out.steps)
            if reference is None:
                reference = out.tokens
            elif out.tokens != reference:
                row["mismatches"] += 1
    plain = rows["plain"]["tokens"] / rows["plain"]["seconds"]
    for row in rows.values():
        row["tokens_per_s"] = round(row["tokens"] / row["seconds"], 1)
        row["speedup"] = round(row["tokens_per_s"] / plain, 2)
        row["tau"] = round(row["tokens"] / max(row["steps"], 1), 2)
    return rows


def read_backs(path: Path, prompt: str) -> dict:
    model, _ = load_model(str(path), weights="f32", device=DEVICE, backend="torch")
    tokenizer = load_tokenizer(path)
    ids = encode_conversation(tokenizer, [("user", prompt)], answer_open=True)
    out = {}
    for name, proposer in methods(model).items():
        engine = Engine(model, tokenizer, proposer, static=True)
        config = GenerationConfig(max_new_tokens=32, stop_on_eos=False)
        engine.generate(ids, config)
        with count_read_backs() as counts:
            result = engine.generate(ids, config)
        out[name] = {"read_backs": counts["n"], "steps": len(result.steps)}
    return out


def drafting_cost(layers: int, steps: int = 20) -> dict:
    """Drafting seconds per step on a random Llama-3-8B-shaped model, bfloat16, 5x48 trees."""
    args = ModelArgs(arch="llama", vocab_size=128256, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8,
                     head_dim=128, intermediate_size=14336, norm_eps=1e-5, rope_base=500000.0,
                     max_seq_len=1024)
    with torch.device(DEVICE):
        model = Transformer(args).to(torch.bfloat16).eval().requires_grad_(False)
    drafter = EagleDrafter.random(model, dtype=torch.bfloat16)
    heads = {"full": FullVocab(model.embed.weight),
             "fr:32k": StaticSubset(model.embed.weight, torch.arange(32768), name="fr:32k")}
    result = {}
    for name, head in heads.items():
        proposer = EagleProposer(drafter, head=head, depth=5, top_k=8, total_tokens=48)
        with torch.inference_mode():
            cache = model.new_cache(512)
            hidden, _ = model(torch.arange(100, device=DEVICE), torch.arange(100, device=DEVICE), cache)
            proposer.reset(list(range(100)), hidden, 7)
            root = torch.tensor(7, device=DEVICE)
            for _ in range(3):
                proposer.propose_static(root)
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                proposer.propose_static(root)
            sync()
        result[name] = round((time.perf_counter() - start) / steps * 1e3, 2)
    result["fr_over_full"] = round(result["fr:32k"] / result["full"], 2)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="SmolLM2's GGUF file")
    parser.add_argument("--prompts", required=True, help="JSON list of prompts (one per category)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per answer")
    parser.add_argument("--out", required=True, help="folder for report.md and run.json")
    parser.add_argument("--device", default="cuda", help="cuda (the check), or cpu to try the script")
    parser.add_argument("--target-layers", type=int, default=32,
                        help="layers of the Llama-3-8B-shaped model (drafting reads none of them)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(args.prompts).read_text())
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    run = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    started = time.perf_counter()
    run["read_backs"] = read_backs(Path(args.gguf), prompts[0])
    print(json.dumps(run["read_backs"]), flush=True)
    for weights in ("f32", "bf16"):
        run[weights] = check_model(Path(args.gguf), prompts, weights, args.new_tokens)
        print(weights, json.dumps(run[weights]), flush=True)
    run["drafting_ms_llama3_8b_shape"] = drafting_cost(args.target_layers)
    print(json.dumps(run["drafting_ms_llama3_8b_shape"]), flush=True)
    run["seconds"] = round(time.perf_counter() - started, 1)
    (out / "run.json").write_text(json.dumps(run, indent=1))
    lines = [f"# GPU check: {run['device']}, torch {run['torch']}, {run['date']}", "",
             f"SmolLM2-135M-Instruct, {len(prompts)} Spec-Bench prompts, {args.new_tokens} new tokens, greedy, "
             "static steps (one read-back each); mismatches against plain decoding in the same dtype.", "",
             "| dtype | method | tok/s | speedup | tau | mismatches |", "| --- | --- | --- | --- | --- | --- |"]
    for weights in ("f32", "bf16"):
        for name, row in run[weights].items():
            lines.append(f"| {weights} | {name} | {row['tokens_per_s']} | {row['speedup']}x | {row['tau']} | "
                         f"{row['mismatches'] if name != 'plain' else '-'} |")
    lines += ["", "Read-backs over a 32-token generation (float32): " +
              ", ".join(f"{n} {r['read_backs']} in {r['steps']} steps" for n, r in run["read_backs"].items()),
              "", "Drafting per step, random Llama-3-8B-shaped model (bfloat16, tree 5x48): "
              + json.dumps(run["drafting_ms_llama3_8b_shape"]) + " ms", "",
              f"Whole check: {run['seconds']} s."]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
