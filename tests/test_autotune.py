"""The tree-size chooser rests on one property: the tree of the best m nodes is exactly the
nodes of value rank < m of a larger tree, so accepted lengths at any m follow from one run."""

import random

import pytest
import torch

from vocabspec.tuning.autotune import accept_length_at
from vocabspec.speculation.tree import TreeBuilder


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
    from vocabspec.tuning.autotune import pick

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

    from vocabspec.tuning.autotune import choose_tree, pick
    from vocabspec.speculation.vocab.draft_vocab import FullVocab, StaticSubset
    from vocabspec.speculation.families.eagle import EagleDrafter

    import vocabspec.tuning.autotune as autotune

    monkeypatch.setenv("VOCABSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "CANDIDATE_SIZES", (2, 4, 8))     # a quick calibration
    monkeypatch.setattr(autotune, "CALIBRATION_NEW_TOKENS", 8)
    model = smollm2.model
    drafter = EagleDrafter.random(model)
    heads = {"full": FullVocab(model.head_weight),
             "fr": StaticSubset(model.head_weight, torch.arange(2000), name="fr")}
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
    from vocabspec.tuning.autotune import SizeTimer
    from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
    from vocabspec.decoding.generate import GenerationConfig
    from vocabspec.decoding.batch import Engine

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


# ---------------------------------------------------------------- graph steps (a GPU's path), on the CPU

@pytest.fixture(scope="module")
def torch_smollm2():
    from conftest import loaded

    return loaded("smollm2", "f32", "torch")      # torch's kernels: inexact, graph steps run


def test_graph_tree_of_m_nodes_accepts_what_the_largest_trees_ranks_say(torch_smollm2):
    """A graph tree of m nodes is the drafted nodes of value rank < m: on the same prompt the
    first step at each size accepts exactly what the largest tree's accepted ranks predict. And
    timing a step in place leaves the decoder, its caches and the drafter as they were."""
    from vocabspec.tuning.autotune import step_seconds
    from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
    from vocabspec.decoding.generate import GenerationConfig
    from vocabspec.decoding.batch import Engine
    from vocabspec.speculation.config import bundled_drafter_dir

    from conftest import spec_bench_prompts

    model, sizes = torch_smollm2.model, (1, 4, 16)
    drafter = EagleDrafter.load(bundled_drafter_dir("smollm2"), model)
    config = GenerationConfig(max_new_tokens=4, stop_on_eos=False)
    engines = {m: Engine(model, None, EagleProposer(drafter, depth=3, top_k=4, total_tokens=m),
                         allow_inexact=True, graphs=True) for m in sizes}
    gained = 0
    for _, text in spec_bench_prompts()[::4]:
        ids = torch_smollm2.prompt_ids(text[:400])
        first = {m: engine.generate(ids, config).steps[0] for m, engine in engines.items()}
        ranks = first[max(sizes)].path_ranks
        assert {m: s.accept_length for m, s in first.items()} == \
            {m: accept_length_at(ranks, m) for m in sizes}, text[:40]
        gained += first[max(sizes)].accept_length > first[min(sizes)].accept_length
    assert gained, "no prompt where the larger tree accepted more: the check would be empty"

    generation = engines[16].stream(ids, config)
    for _ in generation:
        pass
    decoder, proposer = generation.generation.proposer.decoder, engines[16].proposer

    def state():
        return ([t.clone() for t in decoder._state()], decoder.cache.bound, proposer.cache.bound,
                decoder.cache.pending, proposer.cache.pending)

    before = state()
    assert step_seconds(decoder, True, repeats=2) > 0 and step_seconds(decoder, False, repeats=2) > 0
    after = state()
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1:] == after[1:]


def test_graph_tree_choice_is_measured_on_graph_steps_and_cached(torch_smollm2, tmp_path, monkeypatch):
    import json

    import vocabspec.tuning.autotune as autotune
    from vocabspec.tuning.autotune import choose_graph_tree, pick
    from vocabspec.speculation.vocab.draft_vocab import StaticSubset
    from vocabspec.speculation.families.eagle import EagleDrafter
    from vocabspec.speculation.config import bundled_drafter_dir

    monkeypatch.setenv("VOCABSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "GRAPH_SIZES", (2, 4))          # a quick calibration
    monkeypatch.setattr(autotune, "STEP_REPEATS", 2)
    monkeypatch.setattr(autotune, "CALIBRATION_NEW_TOKENS", 8)
    monkeypatch.setattr(autotune, "CALIBRATION_QUESTIONS", autotune.CALIBRATION_QUESTIONS[:2])
    model = torch_smollm2.model
    drafter = EagleDrafter.load(bundled_drafter_dir("smollm2"), model)
    head = StaticSubset(model.head_weight, torch.arange(8000), name="fr")
    depth, total = choose_graph_tree(model, drafter, head, torch_smollm2.tokenizer, depth=2, top_k=4,
                                      key="test|static")
    known = json.loads((tmp_path / "autotune.json").read_text())
    (key, entry), = known.items()
    assert "static" in key
    table = entry["table"]
    assert set(table) == {"1/2", "1/4", "2/2", "2/4"}
    for d in (1, 2):             # a larger tree keeps every node of a smaller one
        assert 1 <= table[f"{d}/2"]["tau"] <= table[f"{d}/4"]["tau"]
    assert all(row["step_s"] > 0 for row in table.values()) and entry["plain_step_s"] > 0
    best = pick(table)
    want = (best["depth"], best["total_tokens"]) if entry["measured_speedup"] >= 1 else (0, 0)
    assert entry["measured_speedup"] > 0 and (depth, total) == want
    (tmp_path / "autotune.json").write_text(json.dumps({key: {**entry, "total_tokens": 7}}))
    assert choose_graph_tree(model, drafter, head, torch_smollm2.tokenizer, depth=2, top_k=4,
                              key="test|static")[1] == 7


def test_inexact_engines_tune_and_graph_ones_tune_by_graph_steps(torch_smollm2, tmp_path, monkeypatch):
    """On torch's kernels (inexact, allowed by the caller) the tuner's own engines run too; and
    where an Engine would run graph steps (CUDA), EAGLE's tree is chosen by the graph tuner."""
    import vocabspec.tuning.autotune as autotune
    import vocabspec.decoding.generate as generate
    from vocabspec.speculation.vocab.draft_vocab import FullVocab
    from vocabspec.speculation.families.eagle import EagleDrafter
    from vocabspec.speculation.config import DraftConfig
    from vocabspec.tuning.proposers import make_proposer

    monkeypatch.setenv("VOCABSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "CANDIDATE_SIZES", (2,))
    monkeypatch.setattr(autotune, "FORWARD_REPEATS", 1)
    monkeypatch.setattr(autotune, "CALIBRATION_NEW_TOKENS", 4)
    monkeypatch.setattr(autotune, "CALIBRATION_QUESTIONS", autotune.CALIBRATION_QUESTIONS[:1])
    model = torch_smollm2.model
    depth, total = autotune.choose_tree(model, EagleDrafter.random(model), FullVocab(model.head_weight),
                                        torch_smollm2.tokenizer, depth=1, top_k=4, key="test|inexact")
    assert (depth, total) in ((0, 0), (1, 2))

    calls = []

    def static_tuner(model, drafter, head, tokenizer, depth, top_k, key, log=None):
        calls.append((depth, top_k))
        return 2, 5

    monkeypatch.setattr(autotune, "choose_graph_tree", static_tuner)
    monkeypatch.setattr(generate, "graphs_by_default", lambda model: True)
    proposer = make_proposer(model, DraftConfig(method="eagle", vocab="full", depth=3, top_k=4),
                             "smollm2", torch_smollm2.tokenizer)
    assert calls == [(3, 4)] and (proposer.depth, proposer.total_tokens) == (2, 5)


def test_a_timing_taken_beside_other_work_is_timed_again_once_the_machine_is_quiet(tmp_path, monkeypatch):
    """A cached choice timed while other processes held cores is a busy machine's, not this
    machine's: a call on a still busy machine uses it, the first quiet call times it again, and
    a quiet timing then stands."""
    import json

    import vocabspec.tuning.autotune as autotune

    from conftest import tiny_model

    monkeypatch.setenv("VOCABSPEC_CACHE", str(tmp_path))
    load = {"others": 1.6, "quiet": False}

    class Mark:
        def others(self):
            return load["others"]

    monkeypatch.setattr(autotune, "LoadMark", Mark)
    monkeypatch.setattr(autotune, "machine_is_quiet", lambda seconds=None: load["quiet"])
    model, timings = tiny_model("llama"), []

    def choice():
        return autotune._cached("test|busy", model, lambda: timings.append(1) or {"size": len(timings)}, None)

    def flags():
        return list(json.loads((tmp_path / "autotune-busy.json").read_text()).values())

    assert choice() == {"size": 1} and len(timings) == 1 and flags() == [1.6]
    assert choice()["size"] == 1 and len(timings) == 1         # still busy: the busy timing serves
    load.update(others=0.0, quiet=True)
    assert choice() == {"size": 2} and len(timings) == 2 and flags() == []    # quiet: timed again
    assert choice() == {"size": 2} and len(timings) == 2       # and that timing stands


def test_other_processes_load_is_measured():
    """LoadMark counts other processes' CPU time, not this process's own."""
    import subprocess
    import sys
    import time

    from vocabspec.tuning.machine_load import LoadMark

    mark = LoadMark()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:          # this process's own work counts for nothing
        pass
    own = mark.others()
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass"])
    time.sleep(0.15)
    mark = LoadMark()
    time.sleep(0.4)
    beside = mark.others()
    spinner.wait()
    assert beside >= 0.6, beside              # a whole core's spinning, seen
    assert beside > own, (own, beside)


def test_the_cache_keeps_only_entries_a_call_can_reach(tmp_path, monkeypatch):
    """An entry whose key names a drafter's weights (config.weights_key) is dropped at the next
    save once those weights are gone or changed (no call can make that key again: a deleted or
    retrained drafter, a test's temporary one); entries without weights, and those of weights
    as they are, stay."""
    import json
    import os

    import vocabspec.tuning.autotune as autotune
    from vocabspec.speculation.config import weights_key

    monkeypatch.setenv("VOCABSPEC_CACHE", str(tmp_path / "cache"))
    drafters = {}
    for name in ("kept", "deleted", "retrained"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"weights")
        drafters[name] = f"smollm2|{weights_key(tmp_path / name)}|full"
    known = {key: {"depth": 1} for key in drafters.values()}
    known["forward|llama-576|v10|gguf-a8"] = {"0": 0.003}
    known[f"calibration|{drafters['deleted']}|v1"] = {"hits": []}
    path = tmp_path / "cache" / "autotune.json"
    path.parent.mkdir()
    autotune._store(path, known)
    assert set(json.loads(path.read_text())) == set(known)              # every entry reachable
    (tmp_path / "deleted" / "model.safetensors").unlink()
    retrained = tmp_path / "retrained" / "model.safetensors"
    os.utime(retrained, (retrained.stat().st_atime, retrained.stat().st_mtime + 5))
    autotune._store(path, json.loads(path.read_text()))
    assert set(json.loads(path.read_text())) == {drafters["kept"], "forward|llama-576|v10|gguf-a8"}
