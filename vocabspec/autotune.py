"""Choosing the draft tree's size for this machine, model and drafter: `total_tokens` and `depth`.

On a GPU verifying 60 tokens costs about as much as verifying one; on a CPU the target's
forward grows with the tree, and each drafting level costs a drafter layer plus an LM head, so
the best tree is much smaller and machine-dependent. We measure both sides once and maximise
expected tokens per second over depth d (up to the one asked for) and size m:

    speed(d, m) = tau(d, m) / (draft_seconds(d) + forward_seconds(m + 1))

tau(m) comes from one calibration run with a large tree: the tree of the best m nodes is
exactly the nodes of value rank < m, and greedy verification follows the same path through
it, so the accepted length at size m is the accepted path cut at the first node ranked >= m.
forward_seconds is the target's tree-masked forward (with the LM head over the rows that
verification scores at first, `verify.TreeLogits`), timed at each candidate size once per
model and machine and shared by every drafter and draft vocabulary, so that their choices
differ by their drafting, not by timing noise; it is made non-decreasing in m (a larger
forward is never really cheaper). Among the candidates within TOLERANCE of the best predicted
speed the smallest tree wins: a difference that small is noise on a shared machine, and the
smaller tree costs less where the estimate is wrong. Results are cached per machine, model,
dtype and drafter (VOCABSPEC_CACHE/autotune.json).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from .linear import packing_enabled
from .verify import HEAD_ROWS

CANDIDATE_SIZES = (2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
CANDIDATE_DEPTHS = (1, 2, 3, 4, 6)
TOLERANCE = 0.03
CALIBRATION_NEW_TOKENS = 40
# Open answers and answers that lean on their prompt (a summary, a calculation) accept at
# different rates, and the tree size that pays depends on the mix: with open answers alone the
# calibration saw tau grow faster with the tree than it does on Spec-Bench (BENCHMARKS.md,
# session 15).
CALIBRATION_QUESTIONS = (
    "Write a short paragraph about why people enjoy walking in the mountains.",
    "Explain how a bicycle's gears make it easier to ride uphill.",
    "Summarize in two sentences: The town library moved into the old railway station last "
    "spring. The waiting hall now holds the reading room, the ticket office lends laptops, and "
    "the platform has become a garden where children's stories are read aloud on Saturdays. "
    "Visits have doubled since the move, and the council plans to keep the station clock running.",
    "A baker makes 48 rolls and packs them in bags of 6. She sells each bag for 3 dollars. "
    "How much money does she make if she sells every bag? Explain each step.",
)


def accept_length_at(path_ranks: tuple[int, ...], size: int) -> int:
    kept = 0
    for rank in path_ranks:
        if rank >= size:
            break
        kept += 1
    return kept + 1


def forward_seconds(model, sizes, context: int = 256, repeats: int = 3) -> dict[int, float]:
    cache = model.new_cache(context + max(sizes) + 1)
    device = model.device
    with torch.inference_mode():
        ids = torch.randint(model.args.vocab_size, (context,), device=device)
        model(ids, torch.arange(context, device=device), cache)
        cache.commit()
        timings = {}
        for n in sizes:
            tokens = torch.randint(model.args.vocab_size, (n + 1,), device=device)
            positions = torch.arange(context, context + n + 1, device=device)
            mask = torch.ones(n + 1, n + 1, dtype=torch.bool, device=device).tril()
            runs = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                hidden, _ = model(tokens, positions, cache, tree_mask=mask, logits_rows=[])
                model.lm_head(hidden[:HEAD_ROWS])      # what verification scores at first
                if device.type == "cuda":
                    torch.cuda.synchronize()
                runs.append(time.perf_counter() - start)
                cache.discard()
            timings[n] = statistics.median(runs[1:])
    return timings


def monotone(timings: dict[int, float]) -> dict[int, float]:
    """Each size's time raised to the largest time of any smaller size."""
    result, highest = {}, 0.0
    for n in sorted(timings):
        highest = max(highest, timings[n])
        result[n] = highest
    return result


def pick(table: dict[str, dict], tolerance: float = TOLERANCE) -> dict:
    """The cheapest row (fewest tokens verified, then shallowest) whose predicted speed is
    within `tolerance` of the best."""
    fastest = max(row["tokens_per_s"] for row in table.values())
    close = [row for row in table.values() if row["tokens_per_s"] >= (1 - tolerance) * fastest]
    return min(close, key=lambda row: (row["total_tokens"], row["depth"]))


def calibrate(model, tokenizer, drafter, head, depth: int, top_k: int,
              forwards: dict[int, float]) -> dict:
    from .drafter import EagleProposer
    from .generate import Engine, GenerationConfig
    from .prompts import encode_conversation

    largest = max(CANDIDATE_SIZES)
    prompts = [encode_conversation(tokenizer, [("user", q)], answer_open=True)
               for q in CALIBRATION_QUESTIONS]
    table = {}
    for d in sorted({c for c in CANDIDATE_DEPTHS if c <= depth} | {depth}):
        proposer = EagleProposer(drafter, head=head, depth=d, top_k=top_k, total_tokens=largest)
        engine = Engine(model, tokenizer, proposer)
        engine.generate(prompts[0], GenerationConfig(max_new_tokens=4))   # warm-up
        steps = []
        for ids in prompts:
            steps += engine.generate(ids, GenerationConfig(max_new_tokens=CALIBRATION_NEW_TOKENS)).steps
        draft = statistics.median(s.draft_seconds for s in steps)
        for m in CANDIDATE_SIZES:
            tau = sum(accept_length_at(s.path_ranks, m) for s in steps) / len(steps)
            table[f"{d}/{m}"] = {"depth": d, "total_tokens": m, "tau": round(tau, 3),
                                 "draft_s": round(draft, 5), "forward_s": round(forwards[m], 5),
                                 "tokens_per_s": round(tau / (draft + forwards[m]), 2)}
    best = pick(table)
    return {"depth": best["depth"], "total_tokens": best["total_tokens"], "table": table}


def _cache_key(model, key: str) -> str:
    # The matmul path changes every timing, so it is part of what the choice depends on.
    return "|".join([key, str(model.dtype), str(model.device), str(torch.get_num_threads()),
                     "packed" if packing_enabled() else "plain",
                     torch.__version__, platform.processor() or platform.machine(),
                     str(os.cpu_count())])


def _load(path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def _store(path, known: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=1))
    tmp.replace(path)


def choose_tree(model, drafter, head, tokenizer, depth: int, top_k: int, key: str,
                log=None) -> tuple[int, int]:
    """(depth, total_tokens) for this machine; depth at most the one given."""
    from .loading import cache_dir

    path = cache_dir() / "autotune.json"
    known = _load(path)
    full_key = _cache_key(model, f"{key}|{depth}|{top_k}|v6")
    if full_key not in known:
        if log:
            log("choosing the draft tree size for this machine (once; cached)...")
        # The forward's time depends on the model's shapes, not on its weights or drafter.
        args = model.args
        shape = f"{args.arch}-{args.dim}-{args.n_layers}-{args.n_heads}-{args.n_kv_heads}-" \
                f"{args.head_dim}-{args.intermediate_size}-{args.vocab_size}"
        forward_key = _cache_key(model, f"forward|{shape}|v5")
        if forward_key not in known:
            known[forward_key] = {str(n): t for n, t in forward_seconds(model, CANDIDATE_SIZES).items()}
        forwards = monotone({int(n): t for n, t in known[forward_key].items()})
        known[full_key] = calibrate(model, tokenizer, drafter, head, depth, top_k, forwards)
        _store(path, known)
    chosen = known[full_key]
    return int(chosen["depth"]), int(chosen["total_tokens"])
