"""Greedy steps with static shapes (static_step.py, what the engine runs on a GPU), on the CPU:
they emit plain decoding's tokens, EAGLE-2's static tree keeps the dynamic tree's nodes, and a
step reads the device back once (counted by wrapping every way a tensor reaches the host)."""

import pytest
import torch

from vocabspec.drafter import EagleDrafter, EagleProposer
from vocabspec.generate import Engine, GenerationConfig
from vocabspec.loading import load_model
from vocabspec.pld import PromptLookupProposer
from vocabspec.proposers import bundled_drafter_dir
from vocabspec.static_step import count_read_backs

from conftest import spec_bench_prompts


@pytest.fixture(scope="module")
def torch_smollm2(smollm2):
    """SmolLM2 on torch's kernels in float32: the path a GPU takes."""
    model, _ = load_model("smollm2", backend="torch")
    return model, smollm2


def paths(tree_tokens, parents) -> set[tuple[int, ...]]:
    """Every node as the token path from the root's child down to it."""
    out = set()
    for node in range(1, len(tree_tokens)):
        path, at = [], node
        while at != 0:
            path.append(tree_tokens[at])
            at = parents[at]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_static_steps_emit_plain_decoding(smollm2, torch_smollm2, backend):
    model = smollm2.model if backend == "native" else torch_smollm2[0]
    tokenizer = smollm2.tokenizer
    drafter = EagleDrafter.load(bundled_drafter_dir("smollm2"), model)
    if model.native is not None:
        drafter.use_native()
    config = GenerationConfig(max_new_tokens=24)
    vanilla = Engine(model, tokenizer)
    for category, text in spec_bench_prompts()[::3]:
        ids = smollm2.prompt_ids(text[:1200])
        want = vanilla.generate(ids, config).tokens
        for proposer in (EagleProposer(drafter, depth=3, top_k=4, total_tokens=10), PromptLookupProposer()):
            # torch's kernels are not row-invariant (allowed explicitly); float32 ties that
            # close do not occur on these prompts.
            engine = Engine(model, tokenizer, proposer, static=True, allow_inexact=model.native is None)
            assert engine.static
            out = engine.generate(ids, config)
            assert out.tokens == want, (backend, category, type(proposer).__name__)
            assert 1 + sum(s.accept_length for s in out.steps) >= len(out.tokens)
        assert Engine(model, tokenizer, static=True).generate(ids, config).tokens == want


def test_static_tree_keeps_the_dynamic_trees_nodes(smollm2):
    model = smollm2.model
    drafter = EagleDrafter.load(bundled_drafter_dir("smollm2"), model)
    drafter.use_native()
    ids = smollm2.prompt_ids("Write a short story about a lighthouse keeper.")
    for depth, top_k, total in ((1, 3, 3), (3, 4, 10), (5, 6, 24)):
        proposer = EagleProposer(drafter, depth=depth, top_k=top_k, total_tokens=total)
        # Reach a real mid-generation state, then draft both ways from it.
        Engine(model, smollm2.tokenizer, proposer).generate(ids, GenerationConfig(max_new_tokens=9))
        root = 42
        dynamic = proposer.propose(root)
        static = proposer.propose_static(torch.tensor(root))
        assert static.tokens.numel() == dynamic.tokens.numel() == total + 1
        assert paths(static.tokens.tolist(), static.parents.tolist()) == \
            paths(dynamic.tokens.tolist(), dynamic.parents.tolist())
        assert torch.equal(static.mask, static.mask & torch.ones_like(static.mask).tril())


@pytest.mark.parametrize("method", ["plain", "pld", "eagle"])
def test_one_read_back_per_step(torch_smollm2, method):
    model, smollm2 = torch_smollm2
    proposer = None
    if method == "pld":
        proposer = PromptLookupProposer()
    elif method == "eagle":
        proposer = EagleProposer(EagleDrafter.load(bundled_drafter_dir("smollm2"), model),
                                 depth=3, top_k=4, total_tokens=8)
    engine = Engine(model, smollm2.tokenizer, proposer, static=True, allow_inexact=True)
    ids = smollm2.prompt_ids("one two three four five six seven one two three four five six")
    config = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    engine.generate(ids, config)                        # warm-up
    with count_read_backs() as counts:
        out = engine.generate(ids, config)
    steps = len(out.steps)
    assert steps >= 5
    # One a step, one for the prefill's token: nothing else may wait for the device.
    assert counts["n"] <= steps + 1, f"{counts['n']} read-backs in {steps} steps ({method})"
