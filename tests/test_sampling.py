"""Speculative sampling draws from exactly the target's distribution.

On a tiny random model (on the native engine, with EAGLE's drafter drafting whole trees in one
native call where the head allows it) the exact distribution of the first two generated tokens is computed
from the target's own logits; thousands of speculative runs (random drafter, a real tree) must
match it under a chi-square test (the full head with top-p < 1, the cut heads at temperature 1
and with top-p). Below the root, at temperature 1 and with top-k:
the joint distribution of four tokens over a four-token vocabulary, with trees two levels
deep, so that acceptance at depth 2, residuals at non-root nodes and the bonus token after an
accepted leaf all occur (and are counted), for EAGLE's drafter, Medusa's heads and an independent
draft model.

For a sharper check, VOCABSPEC_SAMPLING_RUNS and VOCABSPEC_SAMPLING_FIRST_SEED set the number
of runs and the first seed of every case here (e.g. 90000 runs from seed 200000)."""

import os

import pytest
import torch
from scipy.stats import chisquare

from vocabspec.speculation.vocab.draft_vocab import FullVocab, SpecVocab, StaticSubset
from vocabspec.speculation.families.draft_model import DraftModelProposer
from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.speculation.proposer import Proposer
from vocabspec.decoding.batch import Engine
from vocabspec.speculation.families.hybrid import EagleLookupProposer
from vocabspec.speculation.families.medusa import MedusaHeads, MedusaProposer
from vocabspec.speculation.sampling import SamplingParams, target_probs
from vocabspec.speculation.tree import chain
from vocabspec.speculation.vocab.token_map import successor_lists
from vocabspec.speculation.verify import verify_sampling

from conftest import tiny_model, tiny_native, forward

VOCAB = 8


def sampling_target(seed: int, vocab: int, n_layers: int):
    """The tiny target: on the native engine where it runs here (exact by construction, as
    speculative sampling's equality with the target's distribution needs), else on torch's
    kernels in float32 (speculation then allowed explicitly: see `engine`)."""
    from vocabspec.runtime import native

    if native.available()[0]:
        return tiny_native("llama", seed, vocab_size=vocab, n_layers=n_layers, scale=0.15)[1]
    return tiny_model("llama", seed=seed, vocab_size=vocab, n_layers=n_layers)


def engine(model, proposer):
    return Engine(model, None, proposer, allow_inexact=not model.exact)


def eagle_drafter(model, seed: int, dtype=None) -> EagleDrafter:
    """A random drafter, on the native engine with its target (then it drafts whole trees in
    one call, native.NativeDrafter) unless asked for another dtype."""
    drafter = EagleDrafter.random(model, seed=seed, dtype=dtype)
    if model.drafter_format is not None and dtype is None:
        drafter.pack("f32")
    return drafter


def full_head(model) -> FullVocab:
    return FullVocab(model.scoring_head if model.packed_head is not None else model.embed.weight)


def exact_two_token_distribution(model, prompt, params):
    cache = model.new_cache()
    with torch.inference_mode():
        _, logits = forward(model, torch.tensor(prompt), torch.arange(len(prompt)), cache)
        cache.commit()
        p1 = target_probs(logits, params)[0]
        joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        for a in range(VOCAB):
            if p1[a] == 0:
                continue
            _, l2 = forward(model, torch.tensor([a]), torch.tensor([len(prompt)]), cache)
            cache.discard()
            joint[a] = p1[a].double() * target_probs(l2, params)[0].double()
    return joint.flatten()


def sampled_counts(engine, prompt, params, runs, first_seed=0):
    counts = torch.zeros(VOCAB * VOCAB)
    for seed in range(first_seed, first_seed + runs):
        config = GenerationConfig(max_new_tokens=2, stop_on_eos=False,
                                  sampling=SamplingParams(params.temperature, params.top_p, params.top_k, seed))
        a, b = engine.generate(prompt, config).tokens
        counts[a * VOCAB + b] += 1
    return counts


def make_head(kind, model):
    weight = model.head_weight
    if kind == "full":
        return full_head(model)
    if kind == "subset":        # FR-Spec / VocabTrim: drafts only from 5 of the 8 tokens,
        # computed in bfloat16 as the drafter drafting for it is (see the test)
        return StaticSubset(weight, torch.tensor([0, 2, 3, 5, 7]), dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(7)   # SpecVocab with an untrained rank-2 ranker,
    # the text's tokens and one successor per drafted token (token t is followed by t + 3)
    successors = successor_lists([[t, (t + 3) % VOCAB] for t in range(VOCAB)], VOCAB, width=1)
    return SpecVocab(weight, torch.randn(2, weight.shape[1], generator=generator),
                     torch.randn(VOCAB, 2, generator=generator), candidates=4,
                     successors=successors, successor_count=1)


T1, TOP_P = SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.7)


# Top-p with the full head (temperature 1 and top-k with it are checked below the root, on
# deeper trees); the cut heads (which change the draft distribution q, not the target's) at
# temperature 1 and with top-p.
@pytest.mark.parametrize("head, params", [("full", TOP_P), ("subset", T1), ("subset", TOP_P), ("spec", T1)],
                         ids=["full-t0.8-top_p0.7", "subset-t1", "subset-t0.8-top_p0.7", "spec-t1"])
def test_speculative_sampling_matches_target_distribution(params, head):
    model = sampling_target(seed=3, vocab=VOCAB, n_layers=2)
    prompt = [1, 2, 3, 4]
    # The subset case also drafts in bfloat16 for the float32 target: still exact.
    dtype = torch.bfloat16 if head == "subset" else None
    proposer = EagleProposer(eagle_drafter(model, seed=5, dtype=dtype),
                             draft_vocab=make_head(head, model), depth=2, top_k=3, total_tokens=6)
    # SpecVocab 6000 runs: its t1 case scores p = 0.0009 on seeds 0-2999 alone. That block is
    # an unlucky draw, not a bias: 270,000 runs on other seeds give p = 0.56 (BENCHMARKS.md).
    assert_samples_match(model, proposer, prompt, params, runs=6000 if head == "spec" else 3000)
    # And the drafter really was used: some drafted tokens were accepted.
    assert proposer.cache.length > 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_p=0.7)],
                         ids=["t1", "t0.8-top_p0.7"])
def test_sampling_with_prompt_lookup_grafted_matches_target_distribution(params):
    """Prompt lookup's path is a deterministic candidate like the drafter's: still exact. The
    prompt holds every token twice, so every first token has a lookup continuation."""
    model = sampling_target(seed=3, vocab=VOCAB, n_layers=2)
    proposer = EagleLookupProposer(eagle_drafter(model, seed=5), draft_vocab=full_head(model), depth=2, top_k=3,
                                   total_tokens=6)
    assert_samples_match(model, proposer, list(range(VOCAB)) * 2, params)
    assert proposer.grafted > 0


def assert_samples_match(model, proposer, prompt, params, runs=3000):
    runs = int(os.environ.get("VOCABSPEC_SAMPLING_RUNS", runs))
    first_seed = int(os.environ.get("VOCABSPEC_SAMPLING_FIRST_SEED", 0))
    expected = exact_two_token_distribution(model, prompt, params)
    counts = sampled_counts(engine(model, proposer), prompt, params, runs, first_seed)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token the processed target distribution excludes"
    # Pool cells with tiny expectations so the chi-square approximation holds.
    exp_counts = expected[keep] * runs
    big = exp_counts >= 5
    obs = torch.cat([counts[keep][big], counts[keep][~big].sum()[None]])
    exp = torch.cat([exp_counts[big], exp_counts[~big].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    obs, exp = obs.double().numpy(), exp.double().numpy()
    stat, p_value = chisquare(obs, exp / exp.sum() * obs.sum())
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}"


def test_verify_sampling_single_node_is_exact():
    # One node, children 2 then 0: P(emit x) must equal p(x) for every x.
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]]).repeat(4, 1)
    params = SamplingParams(temperature=1.0)
    p = target_probs(logits[:1], params)[0].double()
    tree = chain(9, [2])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    runs = 20000
    for _ in range(runs):
        verdict = verify_sampling(tree, logits, params, generator)
        token = 2 if len(verdict.path) > 1 else verdict.next_token
        counts[token] += 1
    observed = counts.double().numpy()
    stat, p_value = chisquare(observed, (p / p.sum()).numpy() * observed.sum())
    assert p_value > 1e-3


def test_sampling_parameters_are_validated():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_greedy_token_takes_the_first_of_tied_maxima():
    """Vanilla decoding and greedy verification both pick by `greedy_token`; it must agree
    with torch.argmax, ties included (first index), or near-ties would decide differently."""
    from vocabspec.speculation.sampling import greedy_token

    row = torch.tensor([0.5, 2.0, -1.0, 2.0, 2.0])
    assert greedy_token(row) == 1 == int(row.argmax())
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        row = torch.randint(0, 4, (1000,), generator=generator).float()   # many ties
        assert greedy_token(row) == int(row.argmax())


# ---------------------------------------------------------------- below the root

DEEP_VOCAB = 4
DEEP_TOKENS = 4


class RecordingProposer(Proposer):
    """Wraps a proposer and keeps every tree it proposes, to see which paths verification took."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.trees = []
        self.max_tree_tokens = proposer.max_tree_tokens
        self.taps = proposer.taps

    def reset(self, *args):
        self.proposer.reset(*args)

    def propose(self, root_token):
        tree = self.proposer.propose(root_token)
        self.trees.append(tree)
        return tree

    def observe(self, *args):
        self.proposer.observe(*args)


def exact_joint(model, prompt, params, length):
    """P(first `length` generated tokens) from the target's own logits, (VOCAB ** length,)."""
    joint = torch.zeros((DEEP_VOCAB,) * length, dtype=torch.float64)

    def walk(prefix, p):
        if len(prefix) == length:
            joint[prefix] = p
            return
        cache = model.new_cache()
        ids = prompt + list(prefix)
        with torch.inference_mode():
            _, logits = forward(model, torch.tensor(ids), torch.arange(len(ids)), cache)
        q = target_probs(logits, params)[0].double()
        for t in range(DEEP_VOCAB):
            if q[t] > 0:
                walk(prefix + (t,), p * q[t])

    walk((), 1.0)
    return joint.flatten()


def deep_proposer(kind: str, model):
    """A proposer whose first tree is two levels deep over the four-token vocabulary."""
    if kind == "medusa":         # random heads: the two best of each head, three nodes below
        heads = MedusaHeads.random(model.args.dim, 2, seed=3)
        return MedusaProposer(model, heads, choices=[(0,), (1,), (0, 0), (0, 1), (1, 0)])
    if kind == "model":          # an independent draft model (random, one layer)
        draft = tiny_model("llama", seed=12, vocab_size=DEEP_VOCAB, n_layers=1)
        return DraftModelProposer(draft, depth=2, top_k=2, total_tokens=4)
    if kind == "eagle3":         # three target layers fused, a draft vocabulary of 3 of the 4 tokens
        from vocabspec.speculation.families.eagle3 import Eagle3Config, Eagle3Drafter

        a = model.args
        config = Eagle3Config(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                              intermediate_size=a.intermediate_size, n_layers=1, norm_eps=1e-6,
                              rope_base=10000.0, draft_vocab_size=3, aux_layers=(1, 2, 3), target_dim=a.dim)
        drafter = Eagle3Drafter.random(model, config, seed=4, dtype=torch.float32)
        if model.drafter_format is not None:     # as the product drafts with a native target: natively
            drafter.pack("f32")
        return EagleProposer(drafter, draft_vocab=drafter.draft_vocab("full"), depth=1, top_k=2, total_tokens=4)
    # depth=1: one expansion below the root's children, so trees reach depth 2.
    return EagleProposer(eagle_drafter(model, seed=2), draft_vocab=full_head(model), depth=1, top_k=2, total_tokens=4)


@pytest.mark.parametrize("kind, params", [("eagle", SamplingParams(temperature=1.0)),
                                          ("eagle", SamplingParams(temperature=1.3, top_k=3)),
                                          ("medusa", SamplingParams(temperature=1.0)),
                                          ("model", SamplingParams(temperature=1.0)),
                                          ("eagle3", SamplingParams(temperature=1.0))],
                         ids=["t1", "t1.3-top_k3", "medusa-t1", "draft-model-t1", "eagle3-t1"])
def test_sampling_below_the_root_matches_target_distribution(kind, params):
    """Four tokens: the first step's tree is two levels deep over a four-token vocabulary, so
    verification accepts at depth 2, samples residuals at non-root nodes and adds the bonus
    token after accepted leaves; the joint distribution of the four tokens (256 cells) must be
    the target's. Each of those events is counted and must occur in at least 2% of the runs.
    For EAGLE's drafter, Medusa's heads, an independent draft model and an EAGLE-3 drafter (on
    a three-layer target, whose layers it fuses)."""
    model = sampling_target(seed=11, vocab=DEEP_VOCAB, n_layers=3 if kind == "eagle3" else 2)
    prompt = [1, 2, 3, 0]
    # 5,000 runs for the plain temperature-1 case, 3,000 for the others (CI's time).
    runs = int(os.environ.get("VOCABSPEC_SAMPLING_RUNS", 5000 if kind == "eagle" and params.top_k == 0 else 3000))
    first_seed = int(os.environ.get("VOCABSPEC_SAMPLING_FIRST_SEED", 0))
    proposer = RecordingProposer(deep_proposer(kind, model))
    runner = engine(model, proposer)
    expected = exact_joint(model, prompt, params, DEEP_TOKENS)
    counts = torch.zeros_like(expected)
    events = {"accepted at depth >= 2": 0, "residual below the root": 0, "bonus after a leaf": 0}
    for seed in range(first_seed, first_seed + runs):
        proposer.trees.clear()
        config = GenerationConfig(max_new_tokens=DEEP_TOKENS, stop_on_eos=False,
                                  sampling=SamplingParams(params.temperature, params.top_p, params.top_k, seed))
        out = runner.generate(prompt, config)
        index = 0
        for t in out.tokens:
            index = index * DEEP_VOCAB + t
        counts[index] += 1
        # Walk the first step's tree along the emitted tokens: what did verification do there?
        tree, tokens = proposer.trees[0], out.tokens[1:]
        step = out.steps[0].accept_length      # accepted drafts + the token after them
        node, depth = 0, 0
        for token in tokens[:step - 1]:
            node = next(c for c in tree.children[node] if int(tree.tokens[c]) == token)
            depth += 1
        if depth >= 2:
            events["accepted at depth >= 2"] += 1
        if depth >= 1 and 1 + step <= len(out.tokens):    # the step's last token was emitted
            if tree.children[node]:      # every child of the last accepted node was rejected
                events["residual below the root"] += 1
            else:
                events["bonus after a leaf"] += 1
    assert all(n > runs // 50 for n in events.values()), events
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a sequence the processed target distribution excludes"
    exp_counts = expected[keep] * runs
    big = exp_counts >= 5
    obs = torch.cat([counts[keep][big], counts[keep][~big].sum()[None]]).numpy()
    exp = torch.cat([exp_counts[big], exp_counts[~big].sum()[None]]).numpy()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    _, p_value = chisquare(obs, exp / exp.sum() * obs.sum())
    assert p_value > 1e-3, f"chi-square p={p_value:.2e} over {len(obs)} cells; events {events}"
