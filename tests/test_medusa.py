"""Medusa: the shipped heads draft the published tree and greedy output stays plain decoding's,
with every draft head (full, FR-Spec, VocabTrim, SpecVocab) (graph steps' Medusa is in
test_graph_step.py); the tree is built as the choices say; bad checkpoints and trees are
refused by name. Sampling is checked in test_sampling.py."""

import pytest
import torch

from vocabspec.speculation.vocab.draft_vocab import make_draft_vocab
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.decoding.batch import Engine
from vocabspec.speculation.families.medusa import (MEDUSA_63, MedusaHeads, MedusaMismatch, MedusaProposer,
                                                   TreeLayout, bundled_medusa_dir, check_choices)
from vocabspec.speculation.config import DraftConfig, bundled_drafter_dir
from vocabspec.tuning.proposers import make_proposer

from conftest import spec_bench_prompts, tiny_model

NEW_TOKENS = {"smollm2": 32, "gemma3": 24}


def shipped_proposer(target, vocab: str, total_tokens: int = 24) -> MedusaProposer:
    heads = MedusaHeads.load(bundled_medusa_dir(target.name), target.model.args)
    packed = target.model.packed_head
    head = make_draft_vocab(vocab, target.model.head_weight, bundled_drafter_dir(target.name),
                            packed_head=packed)
    return MedusaProposer(target.model, heads, head, total_tokens=total_tokens)


def test_medusa_greedy_lossless_with_every_draft_head(real_model):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS[real_model.name])
    vanilla = Engine(real_model.model, real_model.tokenizer)
    vocabs = ("full", "fr:8k", "trim:8k", "spec:1024")
    steps, mismatches = [], []
    for index, (category, text) in enumerate(spec_bench_prompts()[::3]):
        ids = real_model.prompt_ids(text[:1200])
        reference = vanilla.generate(ids, config).tokens
        for vocab in ("full", vocabs[1 + index % 3]):
            out = Engine(real_model.model, real_model.tokenizer,
                         shipped_proposer(real_model, vocab)).generate(ids, config)
            if out.tokens != reference:
                mismatches.append((category, vocab))
            steps += out.steps
    assert not mismatches, f"Medusa's output differs from plain decoding: {mismatches}"
    tau = sum(s.accept_length for s in steps) / len(steps)
    assert tau > 1.3, f"the shipped heads' mean accepted length is only {tau:.2f}"


def test_tree_follows_the_choices():
    layout = TreeLayout(MEDUSA_63, torch.device("cpu"))
    ids = torch.arange(40).view(4, 10) + 100          # head k's i-th candidate: 100 + 10 k + i
    tree = layout.tree(torch.tensor(7), ids)
    assert tree.size == 63 and int(tree.tokens[0]) == 7
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    found = set()
    for node in range(1, 64):
        path = tree.path_to(node)[1:]
        choice = tuple(tokens[n] - 100 - 10 * depth for depth, n in enumerate(path))
        found.add(choice)
        assert parents[node] < node and int(tree.depths[node]) == len(choice)
        assert tree.ranks[node] == MEDUSA_63.index(choice)
    assert found == set(MEDUSA_63)
    # Children in draft order: a better candidate first.
    for kids in tree.children:
        assert [tokens[k] for k in kids] == sorted(tokens[k] for k in kids)


@pytest.mark.parametrize("choices, why", [([(0,), (0,)], "repeated"), ([(0, 1)], "before its parent"),
                                          ([(0,), (0, 10)], "indices"), ([(0,), (0, 0), (0, 0, 0)], "indices"),
                                          ([], "at least one")])
def test_bad_trees_are_refused(choices, why):
    with pytest.raises(ValueError, match=why):
        check_choices(choices, n_heads=2)


def test_heads_save_load_and_mismatches(tmp_path):
    model = tiny_model("llama", seed=2)
    heads = MedusaHeads.random(model.args.dim, 3, seed=4)
    heads.save(tmp_path / "heads", model.args, extra={"note": "test"})
    back = MedusaHeads.load(tmp_path / "heads", model.args)
    features = torch.randn(5, model.args.dim)
    # 8-bit rows: close, not equal (the heads choose drafts, never outputs).
    assert torch.allclose(back(features), heads(features), atol=0.05)
    other = tiny_model("llama", seed=2, dim=48, n_heads=6)
    with pytest.raises(MedusaMismatch, match="hidden_size"):
        MedusaHeads.load(tmp_path / "heads", other.args)
    with pytest.raises(MedusaMismatch, match="gemma3"):
        MedusaHeads.load(tmp_path / "heads", tiny_model("gemma3").args)
    (tmp_path / "heads" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(MedusaMismatch, match="unreadable"):
        MedusaHeads.load(tmp_path / "heads", model.args)
    with pytest.raises(MedusaMismatch, match="missing config.json"):
        MedusaHeads.load(tmp_path / "nowhere", model.args)


def test_medusa_method_names_and_refusals():
    config = DraftConfig.from_method("medusa+fr:32k@4x24")
    assert (config.method, config.vocab, config.total_tokens) == ("medusa", "fr:32k", 24)
    assert DraftConfig.from_method("medusa").vocab == "full"
    with pytest.raises(ValueError, match="not to --draft pld"):
        DraftConfig(method="pld", vocab="fr:8k")
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="no Medusa heads are bundled"):
        make_proposer(model, DraftConfig(method="medusa"), "tiny")


def test_medusa_sized_live_gives_plain_decodings_tokens(real_model):
    """With the live rule (live_tree.py) each step keeps the best of the drafted nodes by their
    path values, at more than one size, and greedy output is still plain decoding's; the kept
    nodes are a tree (each one's parent kept) ranked as valued."""
    from vocabspec.speculation.live_tree import LiveSizing

    config = GenerationConfig(max_new_tokens=NEW_TOKENS[real_model.name])
    vanilla = Engine(real_model.model, real_model.tokenizer)
    proposer = shipped_proposer(real_model, "full", total_tokens=len(MEDUSA_63))
    curve = {n: 0.004 + 0.0004 * n for n in range(1, 34)}      # fixed costs: the rule, not the host
    proposer.sizing = sizing = LiveSizing(curve, draft_level=0.0003, prior_speedup=1.2, total=3,
                                          most_depth=4, most=16)
    sizing.costs.step = sizing.costs.read_took = sizing.costs.grew = lambda *_: None
    sizing.keep_sizes = True
    engine = Engine(real_model.model, real_model.tokenizer, proposer)
    accepted = 0
    for _, text in spec_bench_prompts()[:4]:
        ids = real_model.prompt_ids(text[:1200])
        out = engine.generate(ids, config)
        assert out.tokens == vanilla.generate(ids, config).tokens
        accepted += sum(step.accept_length - 1 for step in out.steps)
    sizes = [size for _, size in sizing.sizes]
    assert len(set(sizes)) > 1 and max(sizes) <= 16, sizes
    assert accepted > 0
    layout = proposer.layout(16)
    log_probs = -torch.rand(4, 10).sort(dim=1).values          # each head's candidates best first
    tree = layout.valued_tree(7, torch.arange(40).view(4, 10) + 100, log_probs)
    values = tree.values.tolist()
    best_values = sorted(values[1:], reverse=True)
    for m in (1, 5, 11):
        kept = tree.best(m)
        parents, kept_values = kept.parents.tolist(), kept.values.tolist()
        assert kept.size == m and all(parents[n] < n for n in range(1, m + 1))
        assert all(kept_values[n] <= kept_values[parents[n]] for n in range(1, m + 1))
        assert sorted(kept_values[1:], reverse=True) == best_values[:m]
