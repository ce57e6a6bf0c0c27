"""Seeded fuzzing of the native engine's speculative paths, bounded in time.

Each test draws cases from a fixed list of seeds until its time budget is spent (always at
least a minimum number of cases), so a run is reproducible up to where it stops, and prints how
many cases ran. A failure names its seed and what was drawn.

- Drafting: random trees (depth 1 to MAX_DEPTH, top-k 1 to MAX_TOP_K, up to MAX_TOTAL_TOKENS
  drafted tokens: every tree the CLI accepts) from random drafters of every family that drafts
  natively: EAGLE-2 over the target's whole head or a subset of its rows, EAGLE-3 fusing 1 to 3
  target layers with a draft vocabulary of 1 token up to the full vocabulary, the identity map
  or a d2t one, its own embedding or the target's. Their weights are random, or degenerate as
  untrained checkpoints hold them (a NaN head, all-equal logits, infinities). Some draft
  vocabularies hold the tokens plain decoding emits, so that long paths are accepted and
  verification walks deep into trees. The greedy output must be plain decoding's.
- The batched forward: 1 to 16 sequences at random cache lengths up to the window, each with a
  random tree, one row or a causal run, with random taps: every row gets the bits of its
  sequence's forward alone.
- The batch engine: 1 to 16 slots stepping requests of random lengths (more requests than
  slots, so they join and leave), each slot with its own random drafter, some requests plain:
  every answer is the tokens plain decoding gives it alone.

VOCABSPEC_FUZZ_SECONDS sets each test's budget (default 12 s), e.g. to fuzz for longer locally.
"""

import os
import random
import time

import pytest
import torch

from conftest import tiny_native, forward
from vocabspec.runtime import native
from vocabspec.runtime.step_rows import StepRows
from vocabspec.decoding.batch import BatchEngine, BatchLimits, Engine
from vocabspec.speculation.vocab.draft_vocab import FullVocab, StaticSubset
from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer, NativeEagleDrafting
from vocabspec.speculation.families.eagle3 import Eagle3Config, Eagle3Drafter
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.speculation.tree import MAX_DEPTH, MAX_TOP_K, MAX_TOTAL_TOKENS, Tree

pytestmark = pytest.mark.skipif(not native.available()[0], reason=native.available()[1])

BUDGET_SECONDS = float(os.environ.get("VOCABSPEC_FUZZ_SECONDS", "12"))
SEEDS = range(10_000)       # drawn in order: a failure's seed reruns it alone (run_cases' `only`)
VOCAB = 200                 # tiny_native's vocabulary
WINDOW = 256                # and its max_seq_len


def run_cases(name: str, case, min_cases: int, budget: float = BUDGET_SECONDS) -> int:
    """Run case(seed) over SEEDS until `budget` seconds have passed and at least `min_cases` ran;
    VOCABSPEC_FUZZ_SEED=N runs seed N alone. Returns the count (printed)."""
    only = os.environ.get("VOCABSPEC_FUZZ_SEED")
    seeds = [int(only)] if only else SEEDS
    start, ran = time.perf_counter(), 0
    for seed in seeds:
        if ran >= min_cases and time.perf_counter() - start > budget:
            break
        case(seed)
        ran += 1
    print(f"{name}: {ran} cases in {time.perf_counter() - start:.1f} s")
    return ran


_TARGETS = {}


def target(arch: str, n_layers: int, weights: str):
    """A tiny random target on the native engine (built once per shape)."""
    key = (arch, n_layers, weights)
    if key not in _TARGETS:
        _TARGETS[key] = tiny_native(arch, seed=7 + n_layers, weights=weights, n_layers=n_layers)[1]
    return _TARGETS[key]


def draw_target(rng: random.Random):
    return target(rng.choice(["llama", "gemma3"]), rng.choice([2, 3, 5]), rng.choice(["f32", "bf16"]))


def draw_tree(rng: random.Random) -> tuple[int, int, int]:
    """(depth, top_k, total_tokens) within the CLI's bounds, small ones as likely as large."""
    depth = rng.randint(1, MAX_DEPTH)
    top_k = rng.choice([1, 2, rng.randint(1, 10), rng.randint(1, MAX_TOP_K), MAX_TOP_K])
    total = rng.choice([1, rng.randint(1, 16), rng.randint(1, MAX_TOTAL_TOKENS), MAX_TOTAL_TOKENS])
    return depth, top_k, total


def draft_ids(rng: random.Random, g: torch.Generator, favoured: list[int]) -> torch.Tensor:
    """A draft vocabulary (target ids, distinct): 1 token up to all of them; half the time it
    holds `favoured` (the tokens plain decoding emits), so that drafts get accepted."""
    size = rng.choice([1, rng.randint(1, 20), rng.randint(1, VOCAB), VOCAB])
    ids = torch.randperm(VOCAB, generator=g)
    if favoured and rng.random() < 0.5:
        first = torch.tensor(sorted(set(favoured)))
        ids = torch.cat([first, ids[~torch.isin(ids, first)]])
        size = max(size, first.numel())
    return ids[:size]


def degrade(weight: torch.Tensor, style: str, g: torch.Generator) -> None:
    """Make `weight` (in place) as an untrained or broken checkpoint holds it."""
    if style == "nan":              # speculators' untrained head: NaN throughout
        weight.fill_(float("nan"))
    elif style == "ties":           # every logit equal: the ranking is all ties
        weight.zero_()
    elif style == "inf":            # a few rows of infinities among finite ones
        rows = torch.randint(0, weight.shape[0], (max(1, weight.shape[0] // 8),), generator=g)
        weight[rows] = float("inf")
        weight[rows[::2], ::3] = float("-inf")


def draw_proposer(rng: random.Random, g: torch.Generator, model, favoured: list[int]) -> tuple[EagleProposer, str]:
    """A random natively drafting EAGLE-2 or EAGLE-3 proposer for `model`, and what was drawn."""
    depth, top_k, total = draw_tree(rng)
    kind = rng.choice(["f32", "bf16"])
    style = rng.choice(["random"] * 5 + ["nan", "ties", "inf"])
    seed = rng.randrange(1 << 30)
    a = model.args
    if rng.random() < 0.4:
        drafter = EagleDrafter.random(model, seed=seed, input_norm=rng.random() < 0.5, n_layers=rng.randint(1, 2),
                                      dtype=torch.float32)
        degrade(drafter.fc.weight, style, g)
        if style == "ties":
            drafter.fc.bias.zero_()
        drafter.pack(kind)
        ids = draft_ids(rng, g, favoured) if rng.random() < 0.6 else None
        packed = model.packed_head
        head = FullVocab(packed) if ids is None else StaticSubset(packed, ids, name=f"fr:{ids.numel()}")
        what = f"eagle2 head={'full' if ids is None else ids.numel()}"
    else:
        taps = rng.sample(range(1, a.n_layers + 1), rng.randint(1, min(3, a.n_layers)))
        ids = draft_ids(rng, g, favoured)
        config = Eagle3Config(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                              intermediate_size=a.intermediate_size, n_layers=rng.randint(1, 2), norm_eps=1e-6,
                              rope_base=10000.0, draft_vocab_size=ids.numel(), aux_layers=tuple(taps),
                              target_dim=a.dim, fc_bias=rng.random() < 0.3,
                              norm_before_residual=rng.random() < 0.5, norm_output=rng.random() < 0.5)
        drafter = Eagle3Drafter.random(model, config, seed=seed, dtype=torch.float32)
        mapped = rng.random() < 0.7          # else the identity: the vocabulary's first ids
        if mapped:
            drafter.draft_ids.copy_(ids)
        else:
            drafter.draft_ids.copy_(torch.arange(ids.numel()))
        if rng.random() < 0.3:               # the checkpoint's own embedding
            drafter.embed = torch.nn.Embedding(VOCAB, a.dim)
            drafter.embed.weight.data.copy_(torch.randn(VOCAB, a.dim, generator=g))
        degrade(drafter.lm_head.weight, style, g)
        drafter.pack(kind)
        rows = drafter.draft_ids.numel()
        if rng.random() < 0.7:
            head = drafter.draft_vocab("full")
        else:                                 # a subset of its rows, as fr:N and trim:N are
            keep = torch.randperm(rows, generator=g)[:rng.randint(1, rows)]
            head = StaticSubset.of_rows(drafter.runtime.pack_rows(drafter.lm_head.weight[keep]),
                                        drafter.draft_ids[keep], f"fr:{keep.numel()}")
        what = (f"eagle3 taps={taps} vocab={rows}{' d2t' if mapped else ''} head={head.size} "
                f"layers={config.n_layers} own_embed={drafter.embed is not None}")
    proposer = EagleProposer(drafter, draft_vocab=head, depth=depth, top_k=top_k, total_tokens=total)
    assert isinstance(proposer.drafting, NativeEagleDrafting), what
    return proposer, f"{what} {kind} weights={style} tree=({depth}, {top_k}, {total})"


def plain(model, prompt: list[int], max_new: int) -> list[int]:
    return Engine(model).generate(prompt, GenerationConfig(max_new_tokens=max_new)).tokens


# ---------------------------------------------------------------- one sequence, every drafter

def test_random_drafters_and_trees_decode_as_plain_decoding():
    totals = {"steps": 0, "accepted": 0, "longest": 0}

    def case(seed: int) -> None:
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        model = draw_target(rng)
        length = rng.choice([1, rng.randint(2, 40), rng.randint(2, WINDOW - 60)])
        max_new = rng.randint(1, min(48, WINDOW - length - 2))
        prompt = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        want = plain(model, prompt, max_new)
        proposer, what = draw_proposer(rng, g, model, want)
        got = Engine(model, proposer=proposer).generate(prompt, GenerationConfig(max_new_tokens=max_new))
        assert got.tokens == want, f"seed {seed}: {what}, prompt of {length}, {max_new} new tokens"
        totals["steps"] += len(got.steps)
        totals["accepted"] += sum(step.accept_length - 1 for step in got.steps)
        totals["longest"] = max([totals["longest"]] + [step.accept_length - 1 for step in got.steps])

    ran = run_cases("drafting", case, min_cases=24)
    print(f"drafting: {totals['accepted']} drafts accepted over {totals['steps']} steps, "
          f"at most {totals['longest']} in one")
    # The oracle vocabularies make some drafts acceptable: verification walked past the root.
    assert totals["accepted"] > 0, f"no draft accepted in {ran} cases"


# ---------------------------------------------------------------- the batched forward

def random_tree(rng: random.Random, g: torch.Generator, size: int) -> Tree:
    """`size` rows, root first, each node's parent an earlier row no deeper than MAX_DEPTH - 1."""
    parents, depths = [-1], [0]
    for _ in range(size - 1):
        parent = rng.choice([n for n in range(len(parents)) if depths[n] < MAX_DEPTH])
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return Tree.from_parents(torch.randint(0, VOCAB, (size,), generator=g), torch.tensor(parents))


def test_batched_rows_have_the_bits_of_each_sequence_alone():
    def case(seed: int) -> None:
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        model = draw_target(rng)
        taps = tuple(sorted(rng.sample(range(model.args.n_layers), rng.randint(0, model.args.n_layers))))
        items = []
        for _ in range(rng.randint(1, 16)):
            rows = rng.choice([1, rng.randint(1, 8), rng.randint(1, MAX_TOTAL_TOKENS + 1)])
            length = rng.choice([0, 1, rng.randint(0, WINDOW - rows), WINDOW - rows])
            cache = model.new_cache(WINDOW)
            if length:
                with torch.inference_mode():
                    forward(model, torch.randint(0, VOCAB, (length,), generator=g), torch.arange(length), cache,
                          logits_rows=[])
                cache.commit()
            shape = rng.choice(["tree", "row", "causal"]) if rows > 1 else "row"
            if shape == "tree":
                tree = random_tree(rng, g, rows)
                items.append((tree.tokens, tree.positions(length), cache, tree.parents))
            else:
                rows = 1 if shape == "row" else rows
                items.append((torch.randint(0, VOCAB, (rows,), generator=g),
                              torch.arange(length, length + rows), cache, None))
        with torch.inference_mode():
            step = StepRows(taps=taps)
            for tokens, positions, cache, parents in items:
                step.add(tokens, cache, parents, positions)
            model.forward(step)
            together = [step.hidden_of(span) for span in step.spans]
            tapped = [step.tapped_of(span, taps)[0] if taps else None for span in step.spans]
            for _, _, cache, _ in items:
                cache.discard()
            for index, ((tokens, positions, cache, parents), rows, layers) in enumerate(zip(items, together, tapped)):
                alone = forward(model, tokens, positions, cache, parents=parents, logits_rows=[], taps=taps)
                cache.discard()
                where = f"seed {seed}: sequence {index} of {len(items)} ({cache.length} cached, {tokens.numel()} rows)"
                assert torch.equal(alone[0], rows), where
                if taps:
                    assert torch.equal(alone[2], layers), where

    run_cases("batched forward", case, min_cases=12)


# ---------------------------------------------------------------- the batch engine

def test_the_batch_engine_with_random_drafters_gives_each_request_its_plain_tokens():
    def case(seed: int) -> None:
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        model = draw_target(rng)
        slots = rng.randint(1, 16)
        requests = []
        for _ in range(rng.randint(1, slots + 4)):
            length = rng.choice([1, rng.randint(2, 30), rng.randint(2, WINDOW - 30)])
            max_new = rng.randint(1, min(24, WINDOW - length - 2))
            prompt = torch.randint(0, VOCAB, (length,), generator=g).tolist()
            requests.append((prompt, max_new, rng.random() < 0.8, plain(model, prompt, max_new)))
        favoured = [t for *_, want in requests for t in want]
        drawn = [draw_proposer(rng, g, model, favoured) for _ in range(slots)]
        made = iter(drawn)
        batch = BatchEngine(model, None, lambda: next(made)[0],
                            BatchLimits(max_batch=slots, max_waiting=len(requests), window=WINDOW,
                                        tree_rows=slots * (MAX_TOTAL_TOKENS + 1)), thread=False)
        try:
            submitted = [batch.submit(prompt, GenerationConfig(max_new_tokens=max_new), draft)
                         for prompt, max_new, draft, _ in requests]
            batch.run(until=lambda: all(request.done.is_set() for request in submitted))
            for index, (request, (prompt, max_new, draft, want)) in enumerate(zip(submitted, requests)):
                assert request.wait(0).tokens == want, \
                    (f"seed {seed}: request {index} of {len(requests)} in {slots} slots (prompt of "
                     f"{len(prompt)}, {max_new} new, draft={draft}); drafters: {[w for _, w in drawn]}")
        finally:
            batch.close()

    run_cases("batch engine", case, min_cases=8)
