"""An independent draft model: the target's own 8-bit copy drafts for its float32 self, in a
chain and in a tree, with its full head and a VocabTrim head; greedy output stays plain
decoding's and the copy really drafts (most drafts accepted). A draft model with another
vocabulary or tokenizer is refused by name. Sampling is checked in test_sampling.py."""

import pytest

from vocabspec.speculation.families.draft_model import DraftModelMismatch, DraftModelProposer, check_same_tokenizer
from vocabspec.speculation.vocab.draft_vocab import make_draft_vocab
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.decoding.batch import Engine
from vocabspec.speculation.config import DraftConfig, bundled_drafter_dir
from vocabspec.tuning.proposers import make_proposer

from conftest import loaded, spec_bench_prompts, tiny_model

NEW_TOKENS = {"smollm2": 32, "gemma3": 24}


def test_low_bit_copy_drafts_losslessly(real_model):
    """Target: the GGUF run in float32. Draft: the same file with 8-bit activations (the
    default format here), with a KV cache of its own."""
    target = loaded(real_model.name, "f32")
    draft = real_model.model
    packed = draft.packed_head
    trim = make_draft_vocab("trim:8k", draft.head_weight, bundled_drafter_dir(real_model.name),
                            packed_head=packed)
    shapes = {"chain": dict(depth=4, top_k=1, total_tokens=4), "tree": dict(depth=3, top_k=3, total_tokens=6)}
    config = GenerationConfig(max_new_tokens=NEW_TOKENS[real_model.name])
    vanilla = Engine(target.model, target.tokenizer)
    mismatches, steps = [], []
    for index, (category, text) in enumerate(spec_bench_prompts()[::4]):
        ids = target.prompt_ids(text[:1200])
        reference = vanilla.generate(ids, config).tokens
        for shape, head in (("chain", None), ("tree" if index % 2 else "chain", trim)):
            proposer = DraftModelProposer(draft, head, **shapes[shape])
            out = Engine(target.model, target.tokenizer, proposer).generate(ids, config)
            if out.tokens != reference:
                mismatches.append((category, shape, "full" if head is None else "trim"))
            steps += out.steps
    assert not mismatches, f"the draft model's output differs from plain decoding: {mismatches}"
    tau = sum(s.accept_length for s in steps) / len(steps)
    assert tau > 2.5, f"the 8-bit copy's mean accepted length is only {tau:.2f}"


def test_draft_model_with_another_vocabulary_is_refused(smollm2):
    with pytest.raises(DraftModelMismatch, match="share the target's tokenizer"):
        make_proposer(smollm2.model, DraftConfig(method="model", draft_model="gemma3", total_tokens=4),
                      "smollm2", tokenizer=smollm2.tokenizer)


class _Tokenizer:
    def __init__(self, vocab):
        self.backend = type("Backend", (), {"get_vocab": lambda self_: vocab})()


def test_draft_model_with_another_tokenizer_is_refused():
    model = tiny_model("llama", vocab_size=3)
    same = {"a": 0, "b": 1, "c": 2}
    check_same_tokenizer(_Tokenizer(same), _Tokenizer(dict(same)), model.args, model.args, "copy")
    with pytest.raises(DraftModelMismatch, match="another tokenizer"):
        check_same_tokenizer(_Tokenizer(same), _Tokenizer({"a": 0, "c": 1, "b": 2}), model.args,
                             model.args, "shuffled")


def test_draft_model_options_are_checked():
    assert DraftConfig.from_method("model:smollm2+trim:8k@4x4").draft_model == "smollm2"
    with pytest.raises(ValueError, match="names its draft model"):
        DraftConfig(method="model")
    with pytest.raises(ValueError, match="SpecVocab"):
        DraftConfig(method="model", draft_model="smollm2", vocab="spec:1024")
    with pytest.raises(ValueError, match="draft weight format"):
        DraftConfig(method="model", draft_model="smollm2", draft_weights="q2")
    with pytest.raises(ValueError, match="depth >= 1"):
        DraftModelProposer(tiny_model("llama"), depth=0)


def test_command_line_names_the_draft_model():
    from vocabspec.cli import build_parser, draft_config

    args = build_parser().parse_args(["generate", "--draft", "model:smollm2", "--draft-weights", "gguf",
                                      "--draft-vocab", "trim:8k", "hello"])
    config = draft_config(args)
    assert (config.method, config.draft_model, config.draft_weights, config.vocab) == \
        ("model", "smollm2", "gguf", "trim:8k")
    assert draft_config(build_parser().parse_args(["generate", "--draft", "medusa", "hi"])).method == "medusa"
    for bad in ("model", "model:", "medusa2"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "--draft", bad, "hello"])


def test_a_draft_models_chain_sized_live_gives_plain_decodings_tokens(smollm2):
    """The live rule sizing a draft model's chain each step (the 8-bit copy drafting for the
    float32 target): greedy output is plain decoding's; the rule drafted, its chains were cut
    where their calibrated chances stopped paying (more than one length kept), drafts were
    accepted, and steps that drafted nothing left the draft's catch-up to the next probe."""
    from vocabspec.speculation.live_tree import LiveSizing

    target = loaded("smollm2", "f32")
    proposer = DraftModelProposer(smollm2.model, depth=6, top_k=1, total_tokens=6)
    curve = {n: 0.010 + 0.001 * n for n in range(1, 10)}     # a float32 step; a row on top of it
    sizing = LiveSizing(curve, draft_level=0.001, prior_speedup=1.5, total=3, most_depth=6, most=6)
    sizing.keep_sizes = True
    proposer.sizing = sizing
    config = GenerationConfig(max_new_tokens=48)
    vanilla, live = Engine(target.model, target.tokenizer), Engine(target.model, target.tokenizer, proposer)
    accepted = 0
    for _, text in spec_bench_prompts()[::5]:
        ids = target.prompt_ids(text[:600])
        out = live.generate(ids, config)
        assert out.tokens == vanilla.generate(ids, config).tokens
        accepted += sum(step.accept_length - 1 for step in out.steps)
    sizes = [size for _, size in sizing.sizes]
    assert sizes and len(set(sizes)) > 1 and accepted > 10, (sizes, accepted)
