"""Per-call costs behind the decoding speed, packed oneDNN weights vs plain F.linear, interleaved:
the target's forward over n new tokens after a 300-token context (n = 1 is plain decoding,
n > 1 a verification tree), its LM head alone, and SpecVocab's ranking with float32 vs
bfloat16 ranker weights. Then one draft-head call per strategy (top 10 tokens for 1 row, the
root, and for 8 rows, a tree level): the full head, a 32k static subset (FR-Spec / VocabTrim;
which 32k rows does not change the cost) and SpecVocab with 2048 candidates, beside SpecVocab
as it was before its two-pass top-k and index_select gather ("spec_plain_topk").

    python scripts/bench_forward.py --models smollm2,gemma3 --repeats 10

With --verification, only the verification forward, packed: every row through the LM head (as
verification scored trees until session 13) against what `verify.TreeLogits` scores at first
(the head over at most HEAD_ROWS rows), the two interleaved call by call.

    python scripts/bench_forward.py --models smollm2,gemma3 --verification --sizes 1,5,13,25,41,61
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from vocabspec.linear import linear
from vocabspec.loading import load_model
from vocabspec.verify import HEAD_ROWS

CONTEXT = 300


def median_ms(fn, repeats: int, modes: dict) -> dict:
    """Median milliseconds of fn() under each mode, modes interleaved call by call."""
    times = {name: [] for name in modes}
    for _ in range(repeats + 1):            # the first round warms up (and builds the packs)
        for name, packed in modes.items():
            os.environ["VOCABSPEC_PACKED_LINEAR"] = "1" if packed else "0"
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    os.environ.pop("VOCABSPEC_PACKED_LINEAR", None)
    return {name: round(statistics.median(t[1:]) * 1e3, 2) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sizes", default="1,4,12,24,64")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--verification", action="store_true",
                        help="only the verification forward: every row's logits vs TreeLogits' first batch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes = {"packed": True, "plain": False}
    for name in args.models.split(","):
        model, _ = load_model(name, dtype=getattr(torch, args.dtype))
        cache = model.new_cache(CONTEXT + 128)
        if args.verification:
            print(json.dumps({"model": name, "dtype": args.dtype, "verification_ms":
                              verification_costs(model, cache, args.sizes, args.repeats)}), flush=True)
            continue
        head = model.embed.weight
        rank = max(1, model.args.dim // 16)
        down = torch.randn(rank, model.args.dim)
        vocab = torch.randn(head.shape[0], rank)
        row = {"model": name, "dtype": args.dtype, "forward_ms": {}, "head_ms": {}}
        with torch.inference_mode():
            model(torch.randint(0, 1000, (CONTEXT,)), torch.arange(CONTEXT), cache)
            cache.commit()
            for n in (int(s) for s in args.sizes.split(",")):
                tokens, positions = torch.randint(0, 1000, (n,)), torch.arange(CONTEXT, CONTEXT + n)
                mask = torch.ones(n, n, dtype=torch.bool).tril()

                def forward():
                    model(tokens, positions, cache, tree_mask=mask, all_logits=True)
                    cache.discard()

                row["forward_ms"][n] = median_ms(forward, args.repeats, modes)
            for rows in (1, 12):
                states = torch.randn(rows, model.args.dim, dtype=head.dtype)
                row["head_ms"][rows] = median_ms(lambda: linear(states, head), args.repeats, modes)
            states = torch.randn(1, model.args.dim)
            ranking = {}
            for label, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                d, v, x = down.to(dtype), vocab.to(dtype), states.to(dtype)
                ranking[label] = median_ms(lambda: torch.topk(linear(linear(x, d), v), 2048),
                                           args.repeats, {"packed": True})["packed"]
            row["specvocab_ranking_ms_one_row"] = ranking
            row["draft_head_ms"] = draft_head_costs(head, down, vocab, args.repeats)
        print(json.dumps(row), flush=True)


def interleaved_ms(calls: dict, repeats: int) -> dict:
    """Median milliseconds of each call, the calls interleaved one after another."""
    times = {name: [] for name in calls}
    for _ in range(repeats + 1):            # the first round warms up
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(t[1:]) * 1e3, 2) for name, t in times.items()}


def verification_costs(model, cache, sizes: str, repeats: int) -> dict:
    out = {}
    with torch.inference_mode():
        model(torch.randint(0, 1000, (CONTEXT,)), torch.arange(CONTEXT), cache)
        cache.commit()
        for n in (int(s) for s in sizes.split(",")):
            tokens, positions = torch.randint(0, 1000, (n,)), torch.arange(CONTEXT, CONTEXT + n)
            mask = torch.ones(n, n, dtype=torch.bool).tril()

            def every_row():
                model(tokens, positions, cache, tree_mask=mask, all_logits=True)
                cache.discard()

            def first_batch():
                hidden, _ = model(tokens, positions, cache, tree_mask=mask, logits_rows=[])
                model.lm_head(hidden[:HEAD_ROWS])
                cache.discard()

            out[n] = interleaved_ms({"every_row": every_row, "first_batch": first_batch}, repeats)
    return out


def draft_head_costs(head, down, vocab, repeats) -> dict:
    import torch.nn.functional as F

    from vocabspec.draft_vocab import FullVocab, SpecVocab, StaticSubset

    strategies = {"full": FullVocab(head), "fr:32k": StaticSubset(head, torch.arange(32768)),
                  "spec:2048": SpecVocab(head, down, vocab, candidates=2048)}
    spec = strategies["spec:2048"]

    def plain_topk(states, k):      # SpecVocab before the two-pass top-k and index_select
        scores = spec.scores(states)
        per_row = max(1, spec.candidates // scores.shape[0])
        ids = torch.topk(scores, per_row, dim=-1).indices
        ids = ids[0] if ids.shape[0] == 1 else torch.unique(ids)
        logits = F.linear(states, head[ids]).float()
        return torch.topk(logits, k, dim=-1)

    out = {}
    for rows in (1, 8):
        states = torch.randn(rows, head.shape[1], dtype=head.dtype)
        calls = {name: (lambda s=strategy: s.top_k(states, 10)) for name, strategy in strategies.items()}
        calls["spec_plain_topk"] = lambda: plain_topk(states, 10)
        out[rows] = interleaved_ms(calls, 3 * repeats)
    return out


if __name__ == "__main__":
    main()
