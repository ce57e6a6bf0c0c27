"""Choosing the draft tree's size for this machine, model and drafter: `total_tokens` and `depth`.

On a GPU verifying 60 tokens costs about as much as verifying one; on a CPU the target's
forward grows with the tree, and each drafting level costs a drafter layer plus an LM head, so
the best tree is much smaller and machine-dependent. We measure both sides once and maximise
expected tokens per second over depth d (up to the one asked for) and size m:

    speed(d, m) = tau(d, m) / (draft_seconds(d, m) + forward_seconds(m + 1))

tau(m) comes from one calibration run with a large tree: the tree of the best m nodes is
exactly the nodes of value rank < m, and greedy verification follows the same path through
it, so the accepted length at size m is the accepted path cut at the first node ranked >= m.
draft_seconds(d, m) is timed in that run too: every few steps the proposer also grows the
tree at each candidate size from the same state (a smaller tree expands fewer nodes per level,
so it drafts fewer rows), plus the drafter's pass over the accepted tokens.
forward_seconds is the target's tree-masked forward (with the LM head over the rows that
verification scores at first, `verify.TreeLogits`), timed at each candidate size once per
model and machine and shared by every drafter and draft vocabulary, so that their choices
differ by their drafting, not by timing noise. Each size keeps its own median: the cost is not
monotone in m: matmul kernels work on tiles of rows, so it rises in steps and the last size
before a step is the one worth having (a non-decreasing fit once smoothed a slow 2-row
forward over sizes 2-5 and chose a tree that decoded 1.52x instead of 1.63x, commit b452903).
Every size up to 32 is a candidate. Among the candidates within TOLERANCE of the best
predicted speed the smallest tree wins: a difference that small is noise on a shared
machine, and the smaller tree costs less where the estimate is wrong. Calibration stops
adding depths after BUDGET_SECONDS (the whole choice takes under 30 s). Results are cached per
machine, model, dtype and drafter (VOCABSPEC_CACHE/autotune.json), with the cores other
processes kept busy meanwhile, where that was more than a quiet machine's, beside it
(autotune-busy.json): such an entry is timed again by the first call that finds the machine
quiet (machine_load.py). The tree chosen is the live rule's prior (live_tree.py), not a verdict.

Where greedy decoding runs as graph steps (on CUDA: graph_step.py, captured as CUDA graphs),
a step's cost is one replayed graph, not a forward plus drafting timed apart, and graph trees
keep every level's top_k rows. `choose_graph_tree` times that very step at each (depth, size)
in place (rewound after each run, so that one decoder serves every size) beside plain
decoding's step on the same decoder, and takes tau from the graph steps' own ranks. On an
H100 in float32 a prompt-lookup step of 11 rows replayed in 1.5x plain decoding's 2.36 ms, in
bfloat16 1.15x (docs/bench/gpu): the size that pays depends on the dtype as much as the device.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..decoding.cost_curve import forward_seconds
from .machine_load import BUSY_CORES, LoadMark, machine_is_quiet
from ..speculation.proposer import Proposer
from ..runtime.linear import packing_enabled

CANDIDATE_SIZES = tuple(range(1, 13)) + (16, 20, 24, 32)
CANDIDATE_DEPTHS = (1, 2, 3, 4, 6)
TOLERANCE = 0.03
CALIBRATION_NEW_TOKENS = 32
CONFIRM_ROUNDS = 3             # rounds of the calibration prompts confirming a tree
FORWARD_REPEATS = 5
SIZE_TIMING_EVERY = 6          # steps between timings of the proposer at every size
BUDGET_SECONDS = 10.0          # calibration stops adding depths past this (shallow ones first);
                               # one more depth and the confirmation fit in the 30 s
# Open answers and answers that lean on their prompt (a summary, a calculation) accept at
# different rates, and the tree size that pays depends on the mix: with open answers alone the
# calibration saw tau grow faster with the tree than it does on Spec-Bench.
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


def pick(table: dict[str, dict], tolerance: float = TOLERANCE) -> dict:
    """The cheapest row (fewest tokens verified, then shallowest) whose predicted speed is
    within `tolerance` of the best. A tree of m nodes is at most m deep (a node's ancestors rank
    before it), so the depth it is given is at most m."""
    fastest = max(row["tokens_per_s"] for row in table.values())
    close = [row for row in table.values() if row["tokens_per_s"] >= (1 - tolerance) * fastest]
    best = min(close, key=lambda row: (row["total_tokens"], min(row["depth"], row["total_tokens"])))
    return {**best, "depth": min(best["depth"], best["total_tokens"])}


class SizeTimer(Proposer):
    """A proposer that behaves as the one it wraps, and every `every`-th step also grows the
    tree at each of `sizes` from the same state and times it. Growing leaves no trace (the
    drafter's pending cache rows are discarded), so the real proposal is unchanged."""

    def __init__(self, proposer, sizes, every: int):
        self.proposer = proposer
        self.sizes, self.every = tuple(sizes), every
        self.max_tree_tokens = proposer.max_tree_tokens
        self.taps = proposer.taps
        self.clear()

    def clear(self) -> None:
        self.propose_seconds = {m: [] for m in self.sizes}
        self.observe_seconds: list[float] = []
        self.calls = 0

    def reset(self, *args) -> None:
        self.proposer.reset(*args)

    def propose(self, root_token: int):
        if self.calls % self.every == 0:
            own_size = self.proposer.total_tokens
            try:
                for m in self.sizes:
                    self.proposer.total_tokens = m
                    start = time.perf_counter()
                    self.proposer.propose(root_token)
                    self.propose_seconds[m].append(time.perf_counter() - start)
            finally:
                self.proposer.total_tokens = own_size
        self.calls += 1
        return self.proposer.propose(root_token)

    def observe(self, *args) -> None:
        start = time.perf_counter()
        self.proposer.observe(*args)
        self.observe_seconds.append(time.perf_counter() - start)

    def draft_seconds(self) -> dict[int, float]:
        """Per size: the median proposal plus the median pass over the accepted tokens."""
        observe = statistics.median(self.observe_seconds) if self.observe_seconds else 0.0
        return {m: statistics.median(t) + observe for m, t in self.propose_seconds.items()}


def calibration_depths(depth: int) -> list[int]:
    return sorted({c for c in CANDIDATE_DEPTHS if c <= depth} | {depth})


def calibrate(model, tokenizer, drafter, draft_vocab, depth: int, top_k: int,
              forwards: dict[int, float], bar=None) -> dict:
    from ..speculation.families.eagle import EagleProposer
    from ..decoding.generate import GenerationConfig
    from ..decoding.batch import Engine

    largest = max(CANDIDATE_SIZES)
    prompts = _calibration_prompts(tokenizer)
    table = {}
    started = time.perf_counter()
    for d in calibration_depths(depth):
        if table and time.perf_counter() - started > BUDGET_SECONDS:
            break          # deeper trees cost more to calibrate than they are likely to win
        proposer = EagleProposer(drafter, draft_vocab=draft_vocab, depth=d, top_k=top_k, total_tokens=largest)
        proposer.timing_sync = True          # drafting times must include the device's work
        timer = SizeTimer(proposer, CANDIDATE_SIZES, SIZE_TIMING_EVERY)
        engine = Engine(model, tokenizer, timer, allow_inexact=True)
        engine.generate(prompts[0], GenerationConfig(max_new_tokens=4))   # warm-up
        timer.clear()
        steps = []
        for ids in prompts:
            steps += engine.generate(ids, GenerationConfig(max_new_tokens=CALIBRATION_NEW_TOKENS)).steps
            if bar is not None:
                bar.update()
        drafts = timer.draft_seconds()
        for m in CANDIDATE_SIZES:
            tau = sum(accept_length_at(s.path_ranks, m) for s in steps) / len(steps)
            table[f"{d}/{m}"] = {"depth": d, "total_tokens": m, "tau": round(tau, 3),
                                 "draft_s": round(drafts[m], 5), "forward_s": round(forwards[m], 5),
                                 "tokens_per_s": round(tau / (drafts[m] + forwards[m]), 2)}
    best = pick(table)
    ratio = confirm(model, tokenizer, EagleProposer(drafter, draft_vocab=draft_vocab, depth=best["depth"],
                                                    top_k=top_k, total_tokens=best["total_tokens"]),
                    prompts)
    # (0, 0) where drafting loses to plain decoding here
    chosen = (0, 0) if ratio < 1.0 else (best["depth"], best["total_tokens"])
    return {"depth": chosen[0], "total_tokens": chosen[1], "measured_speedup": round(ratio, 3), "table": table}


def confirm(model, tokenizer, proposer, prompts, rounds: int = CONFIRM_ROUNDS, graphs: bool | None = None) -> float:
    """The chosen tree's speed over plain decoding's, from real generations side by side. The
    prediction leaves out what a step costs besides the forward and the drafting (the head's
    later rows, bookkeeping): on a CPU where plain decoding is fast, a tree predicted 1.13x
    faster decoded at 0.81x (SmolLM2, 8-bit activations, 2026-11-26). Several rounds: where
    drafting gains 5-10%, one round's median landed either side of 1 on a shared machine."""
    return measured_speedups(model, tokenizer, {"tree": proposer}, prompts * rounds, graphs)["tree"]


def _cache_key(model, key: str) -> str:
    # The matmul path changes every timing, so it is part of what the choice depends on.
    device = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else str(model.device)
    return "|".join([key, model.weights, model.runs_on, device, str(torch.get_num_threads()),
                     "packed" if packing_enabled() else "plain",
                     torch.__version__, platform.processor() or platform.machine(),
                     str(os.cpu_count())])


def _load(path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


# A drafter's weights in a key (config.weights_key): the file, its size and its mtime.
_WEIGHTS_FIELD = re.compile(r"^(/.+):(\d+):(\d+)$")


def _reachable(key: str) -> bool:
    """Whether an entry can still be asked for: not when its key names a drafter's weights
    that are gone or changed since (a retrained or deleted drafter, a test's temporary one),
    whose key no call can make again."""
    for field in key.split("|"):
        named = _WEIGHTS_FIELD.match(field)
        if named:
            try:
                stat = Path(named.group(1)).stat()
            except OSError:
                return False
            return (stat.st_size, int(stat.st_mtime)) == (int(named.group(2)), int(named.group(3)))
    return True


def _store(path, known: dict) -> None:
    """Replace the cache file whole (never torn), keeping only the entries a call can reach,
    so that it does not grow with every drafter it has ever seen."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({key: entry for key, entry in known.items() if _reachable(key)}, indent=1))
    tmp.replace(path)


def _busy_path(path):
    """Beside the cache (`path`): the cores other processes kept busy while each of its entries
    was timed, for those timed beside more than a quiet machine's (machine_load.BUSY_CORES)."""
    return path.with_name("autotune-busy.json")


def _mark_busy(path, keys, others: float) -> None:
    """Record, beside the cache at `path`, how busy other processes kept the machine while the
    entries `keys` were just timed (forgetting an older record where it was quiet now)."""
    flags = _load(_busy_path(path))
    for key in keys:
        if others > BUSY_CORES:
            flags[key] = round(others, 2)
        else:
            flags.pop(key, None)
    if flags or _busy_path(path).exists():
        _store(_busy_path(path), flags)


def _retime_if_busy(path, known: dict, keys, log) -> None:
    """Forget the entries among `keys` timed beside other work, if the machine is quiet now:
    a verdict measured on a busy machine is not this machine's, and the first quiet call times
    it again (a busy call keeps using it)."""
    flags = _load(_busy_path(path))
    busy = [key for key in keys if key in flags and key in known]
    if busy and machine_is_quiet():
        if log:
            log(f"the cached timing was taken while other work held {max(flags[k] for k in busy):.1f} "
                f"cores; timing again on the quiet machine")
        for key in busy:
            del known[key]


def keep_calibration(sizing, key: str) -> None:
    """The live rule's calibration for the drafter `key` names (live_tree.Calibration): started
    from what the cache kept, and kept there as it learns and when the process ends. Another
    process's save in between is overwritten (the file is replaced whole, never torn)."""
    import atexit
    import weakref

    from ..runtime.files import cache_dir

    path, full_key = cache_dir() / "autotune.json", f"calibration|{key}|v1"
    sizing.calibration.load(_load(path).get(full_key))

    def persist(state: dict) -> None:
        try:
            known = _load(path)
            known[full_key] = state
            _store(path, known)
        except OSError:            # a cache directory gone (a test's) or read-only: kept in memory
            pass

    sizing.persist = persist
    alive = weakref.ref(sizing)
    atexit.register(lambda: alive() is not None and alive().save())


def forward_curve(model, log=None) -> dict[int, float]:
    """Rows verified -> seconds of the forward (cost_curve.forward_seconds), timed once per
    model shape and machine and cached with the trees' choices: its time depends on the model's
    shapes, not on its weights or drafter; a plain step's forward (0 drafted) is timed too, the
    live rule weighing every tree against it."""
    args = model.args
    shape = f"{args.arch}-{args.dim}-{args.n_layers}-{args.n_heads}-{args.n_kv_heads}-" \
            f"{args.head_dim}-{args.intermediate_size}-{args.vocab_size}"

    def compute():
        with tqdm(total=(FORWARD_REPEATS + 1) * (len(CANDIDATE_SIZES) + 1), desc="forward curve", unit="run",
                  disable=log is None, leave=False) as bar:
            timed = forward_seconds(model, (0,) + tuple(CANDIDATE_SIZES), repeats=FORWARD_REPEATS, bar=bar)
        return {str(n): t for n, t in timed.items()}

    timed = _cached(f"forward|{shape}|v10", model, compute, log, what=None)
    return {int(n) + 1: t for n, t in timed.items()}


def choose_tree(model, drafter, draft_vocab, tokenizer, depth: int, top_k: int, key: str,
                log=None) -> tuple[int, int]:
    """(depth, total_tokens) for this machine, depth at most the one given; (0, 0) where no tree
    decodes faster than plain decoding (measured)."""
    chosen, _ = tree_choice(model, drafter, draft_vocab, tokenizer, depth, top_k, key, log)
    return int(chosen["depth"]), int(chosen["total_tokens"])


def tree_choice(model, drafter, draft_vocab, tokenizer, depth: int, top_k: int, key: str,
                log=None) -> tuple[dict, dict[int, float]]:
    """What `choose_tree` chose and measured (depth, total_tokens, measured_speedup and the
    calibration table), and the forward curve it read: rows verified -> seconds. The live
    sizing rule (live_tree.py) starts from both."""
    forward = forward_curve(model, log)

    def compute():
        # Minutes on a small CPU: show where it is (no bar when the caller asked for silence).
        with tqdm(total=len(calibration_depths(depth)) * len(CALIBRATION_QUESTIONS), desc="autotune", unit="run",
                  disable=log is None, leave=False) as bar:
            return calibrate(model, tokenizer, drafter, draft_vocab, depth, top_k,
                             {n - 1: t for n, t in forward.items()}, bar)

    chosen = _cached(f"{key}|{depth}|{top_k}|v16", model, compute, log, what="draft tree size")
    if log and not chosen["total_tokens"]:
        log(f"no draft tree beat plain decoding when this machine was timed (the best measured "
            f"{chosen.get('measured_speedup', 0):.2f}x)")
    return chosen, forward


# ---------------------------------------------------------------- measured sizes: Medusa's tree, a chain

MEDUSA_SIZES = (4, 8, 12, 16, 24, 32, 48, 63)
CHAIN_LENGTHS = (1, 2, 3, 4, 5, 6, 8)


def measured_speedups(model, tokenizer, proposers: dict, prompts, graphs: bool | None = None) -> dict:
    """Each proposer's decoding speed over plain decoding's, from real generations of the
    calibration prompts taken in turn (plain, then each proposer, prompt by prompt), so that
    drift on a shared machine hits all alike: the median over prompts of each prompt's ratio,
    so that one stall of the machine during one generation does not decide. Speed is the
    decoding phase's, the tokens after the first over the time after the prompt's forward:
    that forward is the same either way, and in generations as short as these it would be a
    fifth of the time, shrinking every ratio toward 1. (A proposer's own start on the prompt,
    a drafter's read of it, is after the first token, so it counts.)"""
    from ..decoding.generate import GenerationConfig
    from ..decoding.batch import Engine

    # The tuner only measures: whether inexact drafting may run is the caller's Engine's to say.
    engines = {"plain": Engine(model, tokenizer, graphs=graphs)}
    engines.update({key: Engine(model, tokenizer, p, allow_inexact=True, graphs=graphs)
                    for key, p in proposers.items()})
    config = GenerationConfig(max_new_tokens=CALIBRATION_NEW_TOKENS)
    ratios = {key: [] for key in proposers}
    for ids in prompts:
        speed = {}
        for key, engine in engines.items():
            result = engine.generate(ids, config)
            speed[key] = (result.new_tokens - 1) / max(result.seconds - result.prefill_seconds, 1e-9)
        if speed["plain"] <= 0:      # an answer that ended at its first token measures nothing
            continue
        for key in proposers:
            ratios[key].append(speed[key] / speed["plain"])
    return {key: statistics.median(values) if values else 0.0 for key, values in ratios.items()}


def _smallest_close(speedups: dict) -> int:
    """The smallest size within TOLERANCE of the fastest; 0 where none beats plain decoding."""
    best = max(speedups.values())
    if best < 1.0:
        return 0
    return min(size for size, ratio in speedups.items() if ratio >= (1 - TOLERANCE) * best)


def _calibration_prompts(tokenizer):
    from ..runtime.prompts import encode_conversation

    return [encode_conversation(tokenizer, [("user", q)], answer_open=True) for q in CALIBRATION_QUESTIONS]


def _cached(key: str, model, compute, log, what: str | None = "draft size"):
    """The cache's entry for `key` on this machine: `compute()`'s, stored once (and again where
    it was timed beside other work and the machine is quiet now); the log names `what` is chosen."""
    from ..runtime.files import cache_dir

    path = cache_dir() / "autotune.json"
    known = _load(path)
    full_key = _cache_key(model, key)
    _retime_if_busy(path, known, (full_key,), log)
    if full_key not in known:
        if log and what:
            log(f"choosing the {what} for this machine (once; cached)...")
        mark = LoadMark()
        entry = compute()
        known = _load(path)      # what was stored meanwhile (the forward curve, another process's) stays
        known[full_key] = entry
        _store(path, known)
        _mark_busy(path, (full_key,), mark.others())
    return known[full_key]


def choose_medusa_tree(model, heads, draft_vocab, tokenizer, key: str, log=None):
    """(choices, chosen) for Medusa on this machine: the published 63-node tree's nodes ordered
    by how often verification accepted each on the calibration answers (a node is accepted only
    with its parent, so every prefix of that order is a tree, and it maximises the expected
    accepted length at its size), then what `size_choice` chose of its prefixes: the size that
    decodes fastest, measured ("size", 0 where none beats plain decoding), and each size's
    measured speedup."""
    from ..speculation.families.medusa import MEDUSA_63, MedusaProposer

    def compute():
        prompts = _calibration_prompts(tokenizer)
        from ..decoding.generate import GenerationConfig
        from ..decoding.batch import Engine

        engine = Engine(model, tokenizer, MedusaProposer(model, heads, draft_vocab, MEDUSA_63), allow_inexact=True)
        hits = [0] * len(MEDUSA_63)
        for ids in prompts:
            for step in engine.generate(ids, GenerationConfig(max_new_tokens=CALIBRATION_NEW_TOKENS)).steps:
                for rank in step.path_ranks:
                    hits[rank] += 1
        order = sorted(range(len(MEDUSA_63)), key=lambda i: (-hits[i], len(MEDUSA_63[i]), i))
        return {"choices": [list(MEDUSA_63[i]) for i in order], "hits": [hits[i] for i in order]}

    ordered = _cached(f"{key}|medusa-order|v1", model, compute, log)
    choices = [tuple(c) for c in ordered["choices"]]
    chosen = size_choice(model, tokenizer, f"{key}|medusa", MEDUSA_SIZES,
                         lambda m: MedusaProposer(model, heads, draft_vocab, choices, total_tokens=m), log)
    return choices, chosen


def choose_size(model, tokenizer, key: str, sizes, make, log=None) -> int:
    """The size among `sizes` whose proposer (`make(size)`) decodes fastest on this machine,
    measured against plain decoding side by side (the smallest within TOLERANCE of the best);
    0 where none beats plain decoding. What a family's `sizes` ask for (config.Family)."""
    return int(size_choice(model, tokenizer, key, sizes, make, log)["size"])


def size_choice(model, tokenizer, key: str, sizes, make, log=None) -> dict:
    """What `choose_size` chose ("size") and measured ("measured_speedup": size -> speedup)."""
    def compute():
        speedups = measured_speedups(model, tokenizer, {n: make(n) for n in sizes},
                                     _calibration_prompts(tokenizer)[:2])
        return {"size": _smallest_close(speedups),
                "measured_speedup": {str(n): round(r, 3) for n, r in speedups.items()}}

    chosen = _cached(f"{key}|size|v2", model, compute, log)
    if log and not chosen["size"]:
        log(f"no draft size beats plain decoding when this machine was timed (the best measured "
            f"{max(chosen['measured_speedup'].values()):.2f}x)")
    return chosen


# ---------------------------------------------------------------- graph steps (a GPU's path)

GRAPH_SIZES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
STEP_REPEATS = 10


def step_seconds(decoder, draft: bool, repeats: int | None = None) -> float:
    """Median seconds of one graph step of `decoder` run in place and rewound after each run
    (graph_step.GraphDecoder.rewound): the device's work and the one read-back. The first
    run, which captures the step's CUDA graph (or warms up), is not counted."""
    times = []
    with torch.inference_mode():          # a step updates inference tensors in place
        for run in range((repeats or STEP_REPEATS) + 1):
            with decoder.rewound():
                start = time.perf_counter()
                decoder.step(draft)
                if run:
                    times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate_graph(model, drafter, draft_vocab, prompts, depth: int, top_k: int, sizes=None,
                     new_tokens: int | None = None, bar=None) -> dict:
    """The table `choose_graph_tree` picks from: per depth, one graph generation of each
    prompt with the largest tree gives tau at every size (the accepted nodes' ranks), and its
    last decoder times the step at every size and plain decoding's step. `loop_s`: the
    generation loop's own time per step (text, bookkeeping), added to every step alike."""
    from ..speculation.families.eagle import EagleProposer, graph_tree_rows
    from ..decoding.generate import GenerationConfig
    from ..decoding.batch import Engine

    sizes = sizes or GRAPH_SIZES
    config = GenerationConfig(max_new_tokens=new_tokens or CALIBRATION_NEW_TOKENS)
    table, plain, loop = {}, [], []
    for d in calibration_depths(depth):
        proposer = EagleProposer(drafter, draft_vocab=draft_vocab, depth=d, top_k=top_k, total_tokens=max(sizes))
        largest = graph_tree_rows(d, top_k, max(sizes)) - 1       # a level drafts top_k rows at most
        engine = Engine(model, None, proposer, allow_inexact=True, graphs=True)
        steps, decoder = [], None
        for ids in prompts:
            generation = engine.stream(ids, config)
            for _ in generation:
                pass
            result, decoder = generation.result, generation.generation.proposer.decoder
            steps += result.steps
            loop.append((result.seconds - result.prefill_seconds
                         - sum(s.verify_seconds for s in result.steps)) / max(len(result.steps), 1))
            if bar is not None:
                bar.update()
        for m in [m for m in sizes if m <= largest]:
            proposer.total_tokens = m
            seconds = step_seconds(decoder, True)
            tau = sum(accept_length_at(s.path_ranks, m) for s in steps) / len(steps)
            table[f"{d}/{m}"] = {"depth": d, "total_tokens": m, "tau": round(tau, 3),
                                 "step_s": round(seconds, 6)}
        proposer.total_tokens = max(sizes)
        plain.append(step_seconds(decoder, False))
    plain_s, loop_s = statistics.median(plain), max(0.0, statistics.median(loop))
    for row in table.values():
        row["tokens_per_s"] = round(row["tau"] / (row["step_s"] + loop_s), 2)
    return {"table": table, "plain_step_s": round(plain_s, 6), "loop_s": round(loop_s, 6),
            "plain_tokens_per_s": round(1 / (plain_s + loop_s), 2)}


def graph_tree_choice(model, drafter, draft_vocab, tokenizer, depth: int, top_k: int, key: str,
                       log=None) -> dict:
    """What `choose_graph_tree` chose and measured: depth, total_tokens, measured_speedup and
    `calibrate_graph`'s table (the GPU check prints it)."""
    def compute():
        from ..speculation.families.eagle import EagleProposer

        prompts = _calibration_prompts(tokenizer)
        with tqdm(total=len(calibration_depths(depth)) * len(prompts), desc="autotune", unit="run",
                  disable=log is None, leave=False) as bar:
            calibration = calibrate_graph(model, drafter, draft_vocab, prompts, depth, top_k, bar=bar)
        best = pick(calibration["table"])
        ratio = confirm(model, tokenizer, EagleProposer(drafter, draft_vocab=draft_vocab, depth=best["depth"], top_k=top_k,
                                                        total_tokens=best["total_tokens"]), prompts, graphs=True)
        chosen = (best["depth"], best["total_tokens"]) if ratio >= 1.0 else (0, 0)
        return {"depth": chosen[0], "total_tokens": chosen[1], "measured_speedup": round(ratio, 3),
                **calibration}

    chosen = _cached(f"{key}|{depth}|{top_k}|static-v2", model, compute, log)
    if log and not chosen["total_tokens"]:
        log(f"no draft tree beats plain decoding on this device (the best measured "
            f"{chosen['measured_speedup']:.2f}x)")
    return chosen


def choose_graph_tree(model, drafter, draft_vocab, tokenizer, depth: int, top_k: int, key: str,
                       log=None) -> tuple[int, int]:
    """(depth, total_tokens) for EAGLE-2's graph steps on this device (see the module
    docstring), depth at most the one given; (0, 0) where no tree decodes faster than plain
    decoding's graph steps, measured side by side. Cached like `choose_tree`."""
    chosen = graph_tree_choice(model, drafter, draft_vocab, tokenizer, depth, top_k, key, log)
    return int(chosen["depth"]), int(chosen["total_tokens"])
