"""Drafters beyond EAGLE's one layer on the last feature: fused features (EAGLE-3's low/mid/high
layers) and deeper drafters. The target's tapped layer outputs are the right tensors, reach the
drafter through prefill and every verified step, survive a save/load, and training reads them
from the feature shards; a deeper drafter's tree rows see only their ancestors in every layer."""

import pytest
import torch

from vocabspec.speculation.config import bundled_drafter_dir
from vocabspec.speculation.families.eagle import DrafterMismatch, EagleDrafter, EagleProposer
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.decoding.batch import Engine
from vocabspec.speculation.families.eagle import draft_states, features_of
from vocabspec.training.train import (OnlineFeatures, TrainConfig, extract_features, load_shards, online_sets,
                             train_drafter)

from conftest import tiny_model, forward


def test_taps_are_the_outputs_of_those_layers():
    model = tiny_model("gemma3")
    ids = torch.randint(model.args.vocab_size, (10,))
    cache = model.new_cache(16)
    hidden, _, tapped = forward(model, ids, torch.arange(10), cache, taps=(0, 2))
    assert torch.equal(tapped[:, -model.args.dim:], hidden)          # layer 2 is the last
    # Layer 0's output: the same model cut after its first layer.
    module = model.module
    module.layers, kept = module.layers[:1], module.layers
    try:
        first, _ = forward(model, ids, torch.arange(10), model.new_cache(16))
    finally:
        module.layers = kept
    assert torch.allclose(tapped[:, :model.args.dim], first, atol=1e-5)


def test_new_taps_start_as_the_untapped_drafter():
    model = tiny_model("llama")
    drafter = EagleDrafter.random(model, seed=2).float()
    features = torch.randn(8, model.args.dim)
    tokens = torch.randint(97, (8,))
    before = draft_states(drafter, tokens, features)
    drafter.add_taps((0, 1))
    tapped = torch.randn(8, 2 * model.args.dim)
    after = draft_states(drafter, tokens, drafter.input_features(features, tapped))
    assert torch.allclose(before, after, atol=1e-6)
    with pytest.raises(ValueError, match="fuses target layers"):
        drafter.input_features(features, None)


def test_tapped_drafter_saves_and_loads(tmp_path):
    model = tiny_model("gemma3")
    drafter = EagleDrafter.random(model, seed=3, taps=(1, 0))
    assert drafter.taps == (0, 1)
    drafter.save(tmp_path / "d")
    again = EagleDrafter.load(tmp_path / "d", model)
    assert again.taps == (0, 1) and torch.equal(again.fuse.weight, drafter.fuse.weight)
    with pytest.raises(DrafterMismatch, match="taps"):
        EagleDrafter.random(tiny_model("gemma3", n_layers=2), taps=(1,))   # the last layer
    deeper = tiny_model("gemma3", n_layers=5)
    drafter = EagleDrafter.random(deeper, taps=(3,))
    drafter.save(tmp_path / "deep")
    with pytest.raises(DrafterMismatch, match="taps"):
        EagleDrafter.load(tmp_path / "deep", model)                        # 3 layers only


def test_engine_feeds_the_drafter_the_tapped_rows_of_accepted_tokens(smollm2):
    """After a speculative generation the drafter's state equals the one computed offline from
    a single target pass over the committed text: prefill and every accepted path passed the
    right rows of the right layers."""
    model, dim = smollm2.model, smollm2.model.args.dim
    drafter = EagleDrafter.load(bundled_drafter_dir("smollm2"), model)
    drafter.add_taps((1, 14))
    with torch.no_grad():        # taps that matter, small enough that drafts still get accepted
        drafter.fuse.weight[:, :-dim] = torch.randn(dim, 2 * dim,
                                                    generator=torch.Generator().manual_seed(0)) * 0.05
    engine = Engine(model, smollm2.tokenizer, EagleProposer(drafter, depth=4, top_k=6, total_tokens=24))
    ids = smollm2.prompt_ids("List three facts about the Moon.")
    out = engine.generate(ids, GenerationConfig(max_new_tokens=24, stop_on_eos=False))
    assert max(s.accept_length for s in out.steps) > 1      # some steps accepted a path
    committed = engine.slots[0].cache.length
    reference = Engine(model, smollm2.tokenizer).generate(
        ids, GenerationConfig(max_new_tokens=40, stop_on_eos=False)).tokens
    assert reference[:len(out.tokens)] == out.tokens
    text = torch.tensor((ids + reference)[:committed + 1])
    with torch.inference_mode():
        hidden, _, tapped = forward(model, text[:-1], torch.arange(committed), model.new_cache(committed),
                                  logits_rows=torch.tensor([], dtype=torch.long), taps=(1, 14))
        inputs = drafter.input_features(features_of(model, hidden), tapped)
        # draft_states pairs input i with token i + 1: the last token needs no input of its own.
        expected = draft_states(drafter, text, torch.cat([inputs, inputs[-1:]]))[-1]
    assert torch.allclose(engine.proposer.last_state[0], expected, atol=1e-3, rtol=1e-3)


def test_batched_requests_feed_their_drafters_the_tapped_rows(smollm2):
    """A fused-feature drafter in continuous batching: each request gets plain decoding's tokens,
    and its drafter the tapped rows it gets alone (the same drafts, so the same accepted
    lengths step by step)."""
    from vocabspec.decoding.batch import BatchEngine, BatchLimits

    model, dim = smollm2.model, smollm2.model.args.dim

    def tapped_proposer():
        drafter = EagleDrafter.load(bundled_drafter_dir("smollm2"), model)
        drafter.add_taps((1, 14))
        with torch.no_grad():
            drafter.fuse.weight[:, :-dim] = torch.randn(dim, 2 * dim,
                                                        generator=torch.Generator().manual_seed(0)) * 0.05
        return EagleProposer(drafter, depth=3, top_k=4, total_tokens=8)

    prompts = [smollm2.prompt_ids(p) for p in ("List three facts about the Moon.", "Why is the sky blue?",
                                                "Name two rivers in Europe.")]
    config = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    batch = BatchEngine(model, smollm2.tokenizer, tapped_proposer,
                        BatchLimits(max_batch=3, window=512, tree_rows=64))
    try:
        together = [request.wait(120) for request in [batch.submit(ids, config) for ids in prompts]]
    finally:
        batch.close()
    for ids, result in zip(prompts, together):
        alone = Engine(model, smollm2.tokenizer, tapped_proposer()).generate(ids, config)
        plain = Engine(model, smollm2.tokenizer).generate(ids, config)
        assert result.tokens == alone.tokens == plain.tokens
        assert [s.accept_length for s in result.steps] == [s.accept_length for s in alone.steps]
    assert max(s.accept_length for r in together for s in r.steps) > 1


def test_training_reads_taps_from_the_shards(tmp_path):
    model = tiny_model("llama", vocab_size=40, n_layers=4)
    sequences = [[(7 * i + j) % 40 for j in range(16)] for i in range(6)]
    cfg = TrainConfig.of(out=str(tmp_path), taps="1,2", top_candidates=4, max_len=32, epochs=2,
                      accumulate=2, lr=3e-3, warmup_steps=1, checkpoint_every=3, noise=0.0,
                      negatives=4)
    extract_features(cfg, model, {"train": sequences, "heldout": sequences[:2]})
    tokens, hidden, _, tapped = load_shards(cfg, "train")[0]
    with torch.inference_mode():
        _, _, expected = forward(model, tokens.long(), torch.arange(16), model.new_cache(16), taps=(1, 2))
    assert torch.equal(tapped, expected.to(torch.bfloat16))
    drafter = train_drafter(cfg, model, log=lambda _: None)
    assert drafter.taps == (1, 2) and drafter.fuse.weight.abs().sum() > 0
    # The shards serve a run without taps (the last layer's states only); not other taps.
    assert load_shards(TrainConfig.of(out=str(tmp_path)), "train")[0][3] is None
    with pytest.raises(ValueError, match="taps"):
        load_shards(TrainConfig.of(out=str(tmp_path), taps="0"), "train")
    # An extraction for other taps rebuilds them.
    extract_features(TrainConfig.of(out=str(tmp_path), taps="0", top_candidates=4, max_len=32),
                     model, {"train": sequences})
    tokens, _, _, tapped = load_shards(TrainConfig.of(out=str(tmp_path), taps="0"), "train")[0]
    with torch.inference_mode():
        _, _, expected = forward(model, tokens.long(), torch.arange(16), model.new_cache(16), taps=(0,))
    assert torch.equal(tapped, expected.to(torch.bfloat16))


def test_online_features_are_the_shards_rows_and_train_the_same_drafter(tmp_path):
    """Features computed as training draws each sequence are the shards' rows bit for bit, so
    a run on them trains the very drafter a run on shards does."""

    model = tiny_model("llama", vocab_size=40, n_layers=4)
    sequences = [[(7 * i + j) % 40 for j in range(10 + i)] for i in range(6)] + [[3, 4]]
    split = {"train": sequences, "heldout": sequences[:2]}
    cfg = TrainConfig.of(out=str(tmp_path / "shards"), taps="1,2", top_candidates=4, max_len=32, epochs=2,
                      accumulate=2, lr=3e-3, warmup_steps=1, checkpoint_every=3, noise=0.0, negatives=4)
    extract_features(cfg, model, split)
    shards, online = load_shards(cfg, "train"), OnlineFeatures(model, sequences, cfg)
    assert len(online) == len(shards) == 6                  # the 2-token sequence left out by both
    for computed, stored in zip(online[:], shards):
        assert all(torch.equal(a, b) for a, b in zip(computed, stored))
    from_shards = train_drafter(cfg, model, log=lambda _: None)
    online_cfg = cfg.but(out=str(tmp_path / "online"), online_features=True)
    from_online = train_drafter(online_cfg, model, {**split, "features": online_sets(online_cfg, model, split)},
                                log=lambda _: None)
    assert not (tmp_path / "online" / "features").exists()
    expected = from_shards.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in from_online.state_dict().items())


@pytest.mark.parametrize("n_layers", [1, 2])
def test_drafter_tree_rows_equal_their_paths_run_alone(n_layers):
    """Sibling draft nodes see their ancestors and not each other, in every drafter layer."""
    model = tiny_model("gemma3")
    drafter = EagleDrafter.random(model, seed=4, n_layers=n_layers).float()
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(97, (5,), generator=generator)
    prefix_features = torch.randn(5, model.args.dim, generator=generator)
    nodes = torch.tensor([11, 12, 13])                 # 12 and 13 are both children of 11
    node_features = torch.randn(3, model.args.dim, generator=generator)

    def after_prefix():
        cache = drafter.new_cache(16)
        drafter(prefix, prefix_features, torch.arange(5), cache)
        cache.commit()
        return cache

    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree = drafter(nodes, node_features, torch.tensor([5, 6, 6]), after_prefix(), tree_mask=mask)
    for child in (1, 2):
        path = torch.tensor([0, child])
        alone = drafter(nodes[path], node_features[path], torch.tensor([5, 6]), after_prefix())
        assert torch.allclose(tree[child], alone[1], atol=1e-5)


def test_bad_taps_and_depths_are_refused_clearly(tmp_path):
    from vocabspec.training.train import parse_taps

    model = tiny_model("llama")
    ids = torch.arange(4)
    with pytest.raises(ValueError, match="layers 0 to 2"):
        forward(model, ids, torch.arange(4), model.new_cache(8), taps=(3,))
    with pytest.raises(ValueError, match="layer indices"):
        parse_taps("1;2")
    with pytest.raises(ValueError, match="fuse layers 0 to 1"):
        extract_features(TrainConfig.of(out=str(tmp_path), taps="2"), model, {"train": [[1, 2, 3]]})
    with pytest.raises(DrafterMismatch, match="at least one layer"):
        EagleDrafter(model, n_layers=0)
    drafter = EagleDrafter.random(model, n_layers=2)
    drafter.save(tmp_path / "two")
    with pytest.raises(DrafterMismatch, match="num_hidden_layers=2"):
        EagleDrafter.load(tmp_path / "two", tiny_model("llama", n_layers=1))


def test_the_trainers_tau_estimate_runs_on_torchs_kernels():
    """The trainer measures tau on its torch target, where drafting is otherwise refused as
    inexact: the estimate must run there and count at least the bonus token a step."""
    from vocabspec.training.train import measure_tau

    model = tiny_model("llama")
    assert not model.exact
    drafter = EagleDrafter.random(model, seed=1)
    tau = measure_tau(drafter, model, [[1, 2, 3, 4], [5, 6, 7]], max_new_tokens=6)
    assert 1.0 <= tau <= 7.0
