"""Greedy speculative decoding must emit exactly the tokens of vanilla decoding (same weights,
format and device), for every proposer and every draft vocabulary, on a prompt from every
Spec-Bench category: a random drafter, the trained (bundled) drafter with the full head, the
same with prompt lookup's path grafted on, and prompt lookup alone on every category; the
FR-Spec, VocabTrim and SpecVocab heads and a bfloat16 drafter (with FR-Spec) in turn, each on
a quarter of the categories (a head changes what is drafted, never how it is verified). That
in the default weight format; in every other format the trained drafter on every category
(each draft vocabulary in turn), and prompt lookup alone or grafted onto the tree in turn."""

import pytest
import torch

from vocabspec.speculation.config import bundled_drafter_dir
from vocabspec.speculation.vocab.draft_vocab import make_draft_vocab
from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.decoding.batch import Engine
from vocabspec.speculation.families.hybrid import EagleLookupProposer
from vocabspec.speculation.families.pld import PromptLookupProposer

from conftest import loaded, spec_bench_prompts, forward

NEW_TOKENS = {"smollm2": 24, "gemma3": 16}
# Smaller trees for Gemma keep the 262k-row draft head affordable in CI.
TREE = {"smollm2": dict(depth=4, top_k=6, total_tokens=24), "gemma3": dict(depth=2, top_k=4, total_tokens=10)}


def proposers(target):
    drafter = EagleDrafter.random(target.model, seed=1)
    if target.model.drafter_format is not None:
        drafter.pack("bf16")
    found = {
        "eagle-random": EagleProposer(drafter, **TREE[target.name]),
        "pld": PromptLookupProposer(),
    }
    files = bundled_drafter_dir(target.name)
    assert files is not None, f"no trained drafter bundled for {target.name}"
    trained = native_drafter(EagleDrafter.load(files, target.model))
    packed = target.model.packed_head
    for vocab in ("full", "fr:8k", "trim:8k", "spec:1024"):
        head = make_draft_vocab(vocab, target.model.head_weight, files, packed_head=packed)
        found[f"eagle-trained-{vocab}"] = EagleProposer(trained, draft_vocab=head, **TREE[target.name])
    # Drafting in bfloat16 for the float32 target (the default on this CPU): the drafter
    # and its head round differently, verification does not.
    # Drafting on torch's kernels in bfloat16 for the target (the drafter's own dtype).
    narrow = EagleDrafter.load(files, target.model, dtype=torch.bfloat16)
    head = make_draft_vocab("fr:8k", target.model.head_weight, files, dtype=torch.bfloat16)
    found["eagle-trained-bf16-fr:8k"] = EagleProposer(narrow, draft_vocab=head, **TREE[target.name])
    found["eagle-trained-full+pld"] = EagleLookupProposer(trained, **TREE[target.name])
    return found


def native_drafter(drafter):
    """The drafter on the native engine when its target is there (as vocabspec.load does)."""
    if drafter.target.drafter_format is not None:
        drafter.pack("bf16")
    return drafter


@pytest.mark.parametrize("weights", ["gguf", "gguf-a8", "bf16", "f32"])
def test_greedy_lossless_in_every_format(real_model, weights):
    from vocabspec.runtime.native import has_int8

    if real_model.model.weights == weights:
        pytest.skip("the default format runs the whole suite below")
    if weights == "gguf-a8" and not (real_model.model.drafter_format is not None and has_int8()):
        pytest.skip("gguf-a8 needs the native engine with 8-bit dot products")
    model = loaded(real_model.name, weights)
    assert model.model.exact
    files = bundled_drafter_dir(real_model.name)
    trained = native_drafter(EagleDrafter.load(files, model.model))
    packed = model.model.packed_head
    vocabs = ("full", "fr:8k", "trim:8k", "spec:1024")
    heads = [make_draft_vocab(v, model.model.head_weight, files, packed_head=packed) for v in vocabs]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS[real_model.name])
    vanilla = Engine(model.model, model.tokenizer)
    mismatches = []
    # The first 8 categories: each head on two, each prompt-lookup variant on four (every
    # category runs in the default format, below).
    for index, (category, text) in enumerate(spec_bench_prompts()[:8]):
        ids = model.prompt_ids(text[:1200])
        reference = vanilla.generate(ids, config).tokens
        # Prompt lookup alone and grafted onto the tree take turns: each runs on half the
        # categories in every format (both run on every category in the default format).
        engines = {
            f"eagle-{vocabs[index % 4]}": EagleProposer(trained, draft_vocab=heads[index % 4], **TREE[real_model.name]),
            **({"pld": PromptLookupProposer()} if index % 2 else
               {"eagle+pld": EagleLookupProposer(trained, draft_vocab=heads[1], **TREE[real_model.name])}),
        }
        for name, proposer in engines.items():
            if Engine(model.model, model.tokenizer, proposer).generate(ids, config).tokens != reference:
                mismatches.append((category, name))
    assert not mismatches, f"{weights}: speculative output differs from vanilla: {mismatches}"


def test_greedy_lossless_every_category(real_model):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS[real_model.name])
    vanilla = Engine(real_model.model, real_model.tokenizer)
    speculative = {name: Engine(real_model.model, real_model.tokenizer, p)
                   for name, p in proposers(real_model).items()}
    rotating = [name for name in speculative if name.startswith("eagle-trained-") and not name.endswith("full")]
    mismatches = []
    steps = []
    for index, (category, text) in enumerate(spec_bench_prompts()):
        ids = real_model.prompt_ids(text[:1200])
        reference = vanilla.generate(ids, config).tokens
        assert len(reference) > 0
        for name, engine in speculative.items():
            if name in rotating and rotating.index(name) != index % len(rotating):
                continue
            out = engine.generate(ids, config)
            if out.tokens != reference:
                mismatches.append((category, name))
            # The first token comes from prefill; each step adds its accepted drafts + 1.
            assert 1 + sum(s.accept_length for s in out.steps) >= len(out.tokens)
            if name == "eagle-trained-full":
                steps += out.steps
    assert not mismatches, f"speculative output differs from vanilla: {mismatches}"
    # Prompt lookup's paths really were grafted onto the trees (and verified).
    assert speculative["eagle-trained-full+pld"].proposer.grafted > 0
    # The trained drafter really drafts: well over one token per step on average.
    tau = sum(s.accept_length for s in steps) / len(steps)
    assert tau > 1.5, f"trained drafter's mean accepted length only {tau:.2f}"


def test_prompt_lookup_finds_the_latest_earlier_match():
    """The incremental n-gram index proposes what a scan of the whole context would: the
    continuation of the latest earlier occurrence of the longest suffix n-gram."""
    def scan(context, max_ngram, num_draft=10):
        for n in range(min(max_ngram, len(context) - 1), 0, -1):
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == context[-n:]:
                    return context[start + n:start + n + num_draft]
        return []

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        proposer = PromptLookupProposer(max_ngram=1 + trial % 4)
        context = torch.randint(0, 6, (1 + trial % 29,), generator=g).tolist()
        proposer.reset(context[:-1], None, context[-1])
        for step in range(15):
            assert proposer.lookup() == scan(proposer.context, proposer.max_ngram)
            proposer.observe([0] + torch.randint(0, 6, (step % 3,), generator=g).tolist(), None, step % 6)


def test_pld_accepts_on_repetitive_text(smollm2):
    ids = smollm2.tokenizer.encode("one two three four five six seven one two three four five six seven one two three")
    out = Engine(smollm2.model, smollm2.tokenizer, PromptLookupProposer()).generate(
        ids, GenerationConfig(max_new_tokens=24))
    ref = Engine(smollm2.model, smollm2.tokenizer).generate(ids, GenerationConfig(max_new_tokens=24))
    assert out.tokens == ref.tokens
    assert out.mean_accept_len > 1.5


def test_stop_string_inside_a_multi_token_step(smollm2):
    """A step that accepts several tokens must stop exactly where one-token decoding stops."""
    ids = smollm2.tokenizer.encode("one two three four five six seven one two three four five six seven one two three")
    config = GenerationConfig(max_new_tokens=24, stop=[" one"])
    ref = Engine(smollm2.model, smollm2.tokenizer).generate(ids, config)
    out = Engine(smollm2.model, smollm2.tokenizer, PromptLookupProposer()).generate(ids, config)
    assert ref.stop_reason == out.stop_reason == "stop"
    assert out.tokens == ref.tokens and out.text == ref.text
    assert " one" not in out.text
    # The case under test happened: accepted tokens after the stop string were dropped.
    assert 1 + sum(s.accept_length for s in out.steps) > len(out.tokens)


def test_stream_never_shows_the_start_of_a_stop_string(smollm2):
    """A stop string spanning several tokens: its first tokens are held back, not streamed and
    then contradicted by the final text."""
    ids = smollm2.tokenizer.encode("one two three four five six seven one two three four five six seven one two three")
    config = GenerationConfig(max_new_tokens=24, stop=[" seven one"])
    for proposer in (None, PromptLookupProposer()):
        generation = Engine(smollm2.model, smollm2.tokenizer, proposer).stream(ids, config)
        pieces = list(generation)
        assert generation.result.stop_reason == "stop"
        assert "".join(pieces) == generation.result.text == " six"


def test_eagle_with_lookup_switches_to_copying_and_back(smollm2):
    """On text that repeats, the hybrid proposes the lookup path alone once it is being
    followed (no drafter call), and its output stays vanilla's."""
    ids = smollm2.tokenizer.encode("one two three four five six seven one two three four five six seven one two three")
    config = GenerationConfig(max_new_tokens=24)
    proposer = EagleLookupProposer(EagleDrafter.load(bundled_drafter_dir("smollm2"), smollm2.model),
                                   depth=2, top_k=4, total_tokens=8)
    out = Engine(smollm2.model, smollm2.tokenizer, proposer).generate(ids, config)
    ref = Engine(smollm2.model, smollm2.tokenizer).generate(ids, config)
    assert out.tokens == ref.tokens
    assert 0 < proposer.copy_steps < len(out.steps)
    with pytest.raises(ValueError):
        EagleLookupProposer(EagleDrafter.random(smollm2.model), copy_after=0)


def test_logprobs_unchanged_by_speculation(real_model):
    """Each emitted token's log-probability (and its alternatives) under speculation equals
    plain decoding's, bit for bit: it comes from the row verification read, which carries the
    bits a one-row step would. And it is the target's: the log-softmax of a teacher-forced
    forward over the prompt and the output."""
    files = bundled_drafter_dir(real_model.name)
    drafter = native_drafter(EagleDrafter.load(files, real_model.model))
    config = GenerationConfig(max_new_tokens=NEW_TOKENS[real_model.name], logprobs=3)
    ids = real_model.prompt_ids("Write the numbers from one to twenty, separated by commas.")
    plain = Engine(real_model.model, real_model.tokenizer).generate(ids, config)
    assert len(plain.logprobs) == len(plain.tokens) > 0
    for proposer in (EagleProposer(drafter, **TREE[real_model.name]), PromptLookupProposer()):
        out = Engine(real_model.model, real_model.tokenizer, proposer).generate(ids, config)
        assert out.tokens == plain.tokens
        assert out.logprobs == plain.logprobs, type(proposer).__name__
        assert max(s.accept_length for s in out.steps) > 1      # it did speculate
    model = real_model.model
    cache = model.new_cache(len(ids) + len(plain.tokens))
    with torch.inference_mode():
        _, logits = forward(model, torch.tensor(ids + plain.tokens[:-1]), torch.arange(len(ids) + len(plain.tokens) - 1),
                          cache, all_logits=True)[:2]
    forced = torch.log_softmax(logits[len(ids) - 1:].float(), -1)
    for row, entry in zip(forced, plain.logprobs):
        assert abs(float(row[entry.token]) - entry.logprob) < 1e-4
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
        assert entry.top[0][0] == entry.token                      # greedy: the argmax
    with pytest.raises(ValueError, match="logprobs"):
        GenerationConfig(logprobs=21)
