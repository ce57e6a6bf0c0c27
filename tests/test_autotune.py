"""The tree-size chooser rests on one property: the tree of the best m nodes is exactly the
nodes of value rank < m of a larger tree, so accepted lengths at any m follow from one run."""

import random

import pytest
import torch

from vocabspec.autotune import accept_length_at
from vocabspec.tree import TreeBuilder


def grow(total, seed):
    """A tree as the drafter grows it, children a fixed function of their parent (as a drafter's
    are of the path), from a few log-probabilities so that values tie often."""
    builder = TreeBuilder(root_token=0, top_k=3, total_tokens=total)

    def expand(parents):
        tokens = [[builder.token[p] * 3 + j + 1 for j in range(3)] for p in parents]
        log_probs = [[random.Random(f"{seed}-{t}").choice([-0.1, -0.5, -1.0, -2.0]) for t in row]
                     for row in tokens]
        builder.add_children(parents, torch.tensor(tokens), torch.tensor(log_probs))

    expand([0])
    for _ in range(3):
        frontier = builder.frontier()
        if frontier:
            expand(frontier)
    return builder.build()


def test_smaller_tree_is_the_low_ranked_part_of_a_larger_one():
    for seed in range(20):
        big = grow(30, seed)
        for m in (1, 4, 9, 17):
            small = grow(m, seed)
            kept = {int(big.tokens[i]) for i, r in enumerate(big.ranks) if 0 <= r < m}
            assert set(small.tokens[1:].tolist()) == kept
            # every kept node's parent is kept (a connected tree)
            for i, r in enumerate(big.ranks):
                if 0 <= r < m and big.parents[i] > 0:
                    assert big.ranks[int(big.parents[i])] < m


def test_accept_length_at():
    assert accept_length_at((0, 3, 7), 64) == 4
    assert accept_length_at((0, 3, 7), 5) == 3
    assert accept_length_at((0, 3, 7), 1) == 2
    assert accept_length_at((), 8) == 1


def test_pick_prefers_the_smallest_tree_within_tolerance():
    from vocabspec.autotune import pick

    table = {"1/8": {"depth": 1, "total_tokens": 8, "tokens_per_s": 9.8},
             "1/24": {"depth": 1, "total_tokens": 24, "tokens_per_s": 10.0},
             "2/8": {"depth": 2, "total_tokens": 8, "tokens_per_s": 9.9},
             "1/4": {"depth": 1, "total_tokens": 4, "tokens_per_s": 9.0}}
    assert pick(table, tolerance=0.03) == table["1/8"]      # 9.8 is within 3% of 10.0
    assert pick(table, tolerance=0.0) == table["1/24"]
    assert pick(table, tolerance=0.15) == table["1/4"]
    # A tree of one node is one deep whatever depth it was calibrated at.
    single = {"3/1": {"depth": 3, "total_tokens": 1, "tokens_per_s": 9.0},
              "1/2": {"depth": 1, "total_tokens": 2, "tokens_per_s": 8.0}}
    assert pick(single, tolerance=0.0) == {**single["3/1"], "depth": 1}


def test_strategies_share_one_forward_timing_and_choices_are_cached(smollm2, tmp_path, monkeypatch):
    import json

    from vocabspec.autotune import choose_tree, pick
    from vocabspec.draft_vocab import FullVocab, StaticSubset
    from vocabspec.drafter import EagleDrafter

    import vocabspec.autotune as autotune

    monkeypatch.setenv("VOCABSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "CANDIDATE_SIZES", (2, 4, 8))     # a quick calibration
    monkeypatch.setattr(autotune, "CALIBRATION_NEW_TOKENS", 8)
    model = smollm2.model
    drafter = EagleDrafter.random(model)
    heads = {"full": FullVocab(model.embed.weight),
             "fr": StaticSubset(model.embed.weight, torch.arange(2000), name="fr")}
    chosen = {name: choose_tree(model, drafter, head, smollm2.tokenizer, depth=1, top_k=4,
                                key=f"test|{name}") for name, head in heads.items()}
    known = json.loads((tmp_path / "autotune.json").read_text())
    assert sum(key.startswith("forward|") for key in known) == 1
    tables = [entry["table"] for key, entry in known.items() if not key.startswith("forward|")]
    assert len(tables) == 2
    assert [row["forward_s"] for row in tables[0].values()] == \
        [row["forward_s"] for row in tables[1].values()]
    for name, (depth, total) in chosen.items():
        entry = next(e for k, e in known.items() if k.startswith(f"test|{name}|"))
        best = pick(entry["table"])
        # The predicted best tree, unless real generations measured it slower than plain
        # decoding (an untrained drafter here): then no tree.
        assert entry["measured_speedup"] > 0
        want = (best["depth"], best["total_tokens"]) if entry["measured_speedup"] >= 1 else (0, 0)
        assert (depth, total) == want
    # A second call reads the cache instead of calibrating again.
    (tmp_path / "autotune.json").write_text(json.dumps(
        {k: ({**e, "total_tokens": 7} if k.startswith("test|full|") else e) for k, e in known.items()}))
    assert choose_tree(model, drafter, heads["full"], smollm2.tokenizer, depth=1, top_k=4,
                       key="test|full")[1] == 7


def test_timing_every_size_leaves_the_proposals_unchanged():
    """The calibration grows the tree at every candidate size between real steps; the drafter's
    cache and the real proposals must not notice, and every size gets timed."""
    from vocabspec.autotune import SizeTimer
    from vocabspec.drafter import EagleDrafter, EagleProposer
    from vocabspec.generate import Engine, GenerationConfig

    from conftest import tiny_model

    model = tiny_model("llama")
    drafter = EagleDrafter.random(model, seed=5)
    prompt = torch.randint(model.args.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    config = GenerationConfig(max_new_tokens=24, stop_on_eos=False)

    def run(wrap):
        proposer = EagleProposer(drafter, depth=3, top_k=4, total_tokens=16)
        timer = SizeTimer(proposer, (1, 2, 5, 12), every=3) if wrap else None
        result = Engine(model, None, timer or proposer, allow_inexact=True).generate(prompt, config)
        return result, timer

    plain, _ = run(False)
    timed, timer = run(True)
    assert timed.tokens == plain.tokens
    assert [s.path_ranks for s in timed.steps] == [s.path_ranks for s in plain.steps]
    assert [s.tree_size for s in timed.steps] == [s.tree_size for s in plain.steps]
    assert timer.proposer.total_tokens == 16
    sampled = (len(plain.steps) + 2) // 3
    assert all(len(seconds) == sampled for seconds in timer.propose_seconds.values())
    assert len(timer.observe_seconds) == len(plain.steps)
    assert set(timer.draft_seconds()) == {1, 2, 5, 12}
