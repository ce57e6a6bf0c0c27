"""Does the LM head dominate drafting on a CPU at a real size? FR-Spec's Figure 6 (EAGLE-2 on
Llama-3-8B, a GPU: head 49%, softmax 13%, layer 33%) measured on this machine's native engine.

A target of Llama 3.1 8B's shape (a GGUF from scripts/gguf_shapes.py, random weights: time
does not depend on the values) with EAGLE-2 and EAGLE-3 drafters of its widths (random weights;
EAGLE-3 saved and read back in speculators' layout, as the published Llama-3.1-8B drafters are
laid out), drafting natively as `--draft eagle` does (Q8_0 drafter weights beside 8-bit
activations where the CPU has them). For each draft head, one tree level of `top_k` rows is
split into the drafter's layer, the head's matmul, and the softmax with top-k; then the whole
step (the tree drafted in one native call, plus the target's verification of its rows) and the
speedup it implies at the papers' acceptance lengths: a projection, labelled so.

    python scripts/drafting_breakdown.py --target /tmp/llama-3.1-8b-Q4_K_M.gguf --out docs/bench/drafting-8b
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from vocabspec.runtime import native
from vocabspec.runtime.kv_cache import ancestor_mask
from vocabspec.runtime.loading import load_model
from vocabspec.decoding.cost_curve import forward_seconds
from vocabspec.speculation.vocab.draft_vocab import FullVocab, SpecVocab, StaticSubset
from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
from vocabspec.speculation.families.eagle3 import Eagle3Config, Eagle3Drafter

CONTEXT = 256
# Mean acceptance lengths the papers report at EAGLE-2's Spec-Bench tree (depth 6, 60 tokens):
# FR-Spec's Table 1 (Llama-3-8B, SlimPajama frequencies); VocabTrim's 32k and SpecVocab's as
# FR-Spec's 32k and full (their papers report relative changes on other targets).
PAPER_TAU = {"full 128k": 3.89, "FR-Spec 32k": 3.63, "FR-Spec 16k": 3.40, "FR-Spec 8k": 3.13,
             "VocabTrim 32k": 3.63, "SpecVocab 2048": 3.89}


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls after one warm-up."""
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def level_split(stack, keys, values, head, rows: int, repeats: int, spec: SpecVocab | None = None) -> dict:
    """One tree level of `rows` drafter rows: its layer (rows over the drafter's cache after
    CONTEXT committed slots, each seeing the context and itself), the head's matmul and the
    softmax with top-k, in ms. SpecVocab: its ranking, once a tree at the root (`rank`), and
    a level's exact head over the root's candidates."""
    x = torch.randn(rows, stack.dim)
    parents = torch.tensor([-1] + [0] * (rows - 1))      # the root and its children
    positions, sees = CONTEXT + (parents >= 0).long(), ancestor_mask(parents)
    embeds = x if stack.reads_embeds else None
    layer = timed(lambda: stack.forward(x.clone(), positions, keys, values, CONTEXT, 0, sees, embeds=embeds),
                  repeats)
    if spec is not None:
        spec.timings = {}
        timed(lambda: spec.top_k(x[:1], 10, None, 0), repeats)           # the root: ranks every token
        rank = spec.timings.get("rank", 0.0) / (repeats + 1)
        spec.timings = {}
        total = timed(lambda: spec.top_k(x, 10, None, 1), repeats)       # a level below: the root's candidates
        topk = spec.timings.get("topk", 0.0) / (repeats + 1)
        return {"layer_ms": layer * 1e3, "head_ms": (total - topk) * 1e3, "topk_ms": topk * 1e3, "rank_ms": rank * 1e3}
    matmul = timed(lambda: head.matmul(x), repeats)
    fused = timed(lambda: head.topk(x, 10), repeats)
    return {"layer_ms": layer * 1e3, "head_ms": matmul * 1e3, "topk_ms": max(fused - matmul, 0.0) * 1e3}


def drafters(model, tmp: Path):
    """(name, drafter) pairs: EAGLE-2 and EAGLE-3 (speculators' layout) of the target's widths."""
    a = model.args
    kind = "q8i" if native.has_int8() else "bf16"
    eagle2 = EagleDrafter.random(model, seed=1, dtype=torch.bfloat16)
    eagle2.pack(kind)
    config = Eagle3Config(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                          intermediate_size=a.intermediate_size, n_layers=1, norm_eps=a.norm_eps,
                          rope_base=a.rope_base, draft_vocab_size=32000,
                          aux_layers=(2, a.n_layers // 2, a.n_layers - 3), target_dim=a.dim)
    Eagle3Drafter.random(model, config, seed=2, dtype=torch.bfloat16).save(tmp / "eagle3", layout="speculators")
    eagle3 = Eagle3Drafter.load(tmp / "eagle3", model, dtype=torch.bfloat16)
    eagle3.pack(kind)
    return eagle2, eagle3


def heads(model, eagle3) -> dict:
    """Every draft head, by the name the table gives it."""
    packed = model.packed_head
    g = torch.Generator().manual_seed(0)
    ranked = torch.randperm(model.args.vocab_size, generator=g)       # which rows: time does not care
    out = {"EAGLE-2": {"full 128k": FullVocab(packed)}, "EAGLE-3": {}}
    for size in (32768, 16384, 8192):
        out["EAGLE-2"][f"FR-Spec {size // 1024}k"] = StaticSubset(packed, ranked[:size], name=f"fr:{size}")
    out["EAGLE-2"]["VocabTrim 32k"] = StaticSubset(packed, ranked[-32768:], name="trim:32768")
    # SpecVocab: a d/16 ranker over every token, the exact head over 2048 candidates (a bfloat16
    # copy of the head's rows: 1 GB for 128k x 4096).
    rank = model.args.dim // 16
    down, vocab = torch.randn(rank, model.args.dim, generator=g), torch.randn(model.args.vocab_size, rank, generator=g)
    out["EAGLE-2"]["SpecVocab 2048"] = SpecVocab(model.head_weight.to(torch.bfloat16), down, vocab, candidates=2048,
                                                 context_tokens=0)
    own = eagle3.draft_vocab("full")
    out["EAGLE-3"]["own 32k"] = own
    for size in (16384, 8192):
        out["EAGLE-3"][f"own, FR {size // 1024}k"] = StaticSubset.of_rows(
            eagle3.runtime.pack_rows(eagle3.lm_head.weight[:size]), eagle3.draft_ids[:size], f"fr:{size}")
    return out


def step_seconds(model, proposer, repeats: int) -> float:
    """A whole drafting step: the tree grown in one call over the drafter's cache."""
    width = (len(proposer.taps) + 1) * model.args.dim
    context = torch.randint(0, model.args.vocab_size, (CONTEXT,)).tolist()
    proposer.reset(context, torch.randn(CONTEXT, width), context[-1])
    return timed(lambda: proposer.propose(context[-1]), repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="a GGUF of Llama 3.1 8B's shape (scripts/gguf_shapes.py)")
    parser.add_argument("--top-k", type=int, default=10, help="rows of a tree level (EAGLE-2's top_k)")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--total-tokens", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="a directory for the JSON and the table")
    args = parser.parse_args()
    model, _ = load_model(args.target, max_seq_len=CONTEXT + 256)
    with tempfile.TemporaryDirectory() as tmp:
        eagle2, eagle3 = drafters(model, Path(tmp))
    table, rows = heads(model, eagle3), []
    keys = {"EAGLE-2": eagle2, "EAGLE-3": eagle3}
    n = args.total_tokens
    plain = forward_seconds(model, [0], context=CONTEXT, repeats=args.repeats)[0]
    verify = forward_seconds(model, [n], context=CONTEXT, repeats=args.repeats)[n]
    for family, by_name in table.items():
        drafter = keys[family]
        stack = drafter.runtime.stack
        cache = drafter.new_cache(CONTEXT + 128)
        for name, head in by_name.items():
            spec = head if isinstance(head, SpecVocab) else None
            split = level_split(stack, cache.keys, cache.values, head.weight if spec is None else None,
                                args.top_k, args.repeats, spec)
            total = split["layer_ms"] + split["head_ms"] + split["topk_ms"]     # a level (ranking: once a tree)
            proposer = EagleProposer(drafter, draft_vocab=head, depth=args.depth, top_k=args.top_k, total_tokens=n)
            draft = step_seconds(model, proposer, args.repeats)
            tau = PAPER_TAU.get(name) if family == "EAGLE-2" else None
            row = {"drafter": family, "head": name, **{k: round(v, 2) for k, v in split.items()},
                   "level_ms": round(total, 2),
                   "head_share": round(split["head_ms"] / total, 3),
                   "topk_share": round(split["topk_ms"] / total, 3), "layer_share": round(split["layer_ms"] / total, 3),
                   "tree_ms": round(draft * 1e3, 1), "verify_ms": round(verify * 1e3, 1),
                   "plain_ms": round(plain * 1e3, 1), "paper_tau": tau,
                   "projected_speedup": round(tau * plain / (draft + verify), 2) if tau else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"date": str(date.today()), "machine": platform.processor() or platform.machine(),
              "threads": native.threads(), "target": Path(args.target).name, "top_k": args.top_k,
              "depth": args.depth, "total_tokens": n, "context": CONTEXT, "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "breakdown.json").write_text(json.dumps(result, indent=1))
        (args.out / "breakdown.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    lines = [f"| drafter | head | layer ms | head ms | top-k/softmax ms | head share | softmax share | "
             f"layer share | tree ({result['depth']}/{result['total_tokens']}) ms | verify ms | "
             f"projected speedup (paper tau) |", "|" + " --- |" * 11]
    for r in result["rows"]:
        head = r["head"] + (f" (+{r['rank_ms']} ms ranking, once a tree)" if "rank_ms" in r else "")
        projected = f"{r['projected_speedup']}x ({r['paper_tau']})" if r["projected_speedup"] else "-"
        lines.append(f"| {r['drafter']} | {head} | {r['layer_ms']} | {r['head_ms']} | {r['topk_ms']} | {r['head_share']:.0%} | "
                     f"{r['topk_share']:.0%} | {r['layer_share']:.0%} | {r['tree_ms']} | {r['verify_ms']} | {projected} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
