"""A model of a real size's widths: Llama 3.1 8B's (4096 wide, 14336 hidden, 128k vocabulary,
an untied Q6_K head, Q4_K_M's mix of Q4_K and Q6_K matrices, Llama 3's rope factors), two
layers deep, random weights (scripts/gguf_shapes.py). It loads from its blocks in the file's
size, states what it needs, and every drafting family gives plain decoding's tokens: EAGLE-2
(the target's head, full and a 32k subset), EAGLE-3 in speculators' layout with a 32k head
of its own, prompt lookup, and EAGLE-2 with prompt lookup grafted on."""

import sys
from pathlib import Path

import pytest
import torch

from vocabspec.runtime import native
from vocabspec.runtime.files import cache_dir
from vocabspec.runtime.loading import load_model
from vocabspec.decoding.batch import Engine
from vocabspec.speculation.vocab.draft_vocab import FullVocab, StaticSubset
from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
from vocabspec.speculation.families.eagle3 import Eagle3Config, Eagle3Drafter
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.speculation.families.hybrid import EagleLookupProposer
from vocabspec.speculation.families.pld import PromptLookupProposer

from llamacpp_files import models_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gguf_shapes  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available()[0], reason=native.available()[1])

TREE = dict(depth=3, top_k=4, total_tokens=8)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target():
    path = gguf_shapes.made("llama-3.1-8b", "Q4_K_M", cache_dir() / "shapes", layers=2, vocab_dir=models_dir())
    model, _ = load_model(str(path), max_seq_len=512)
    return model, path


def test_an_8b_wide_file_runs_from_its_blocks_in_its_own_size(target):
    model, path = target
    from vocabspec.runtime.formats import PackedWeight

    types = {w.type for layer in model.stack.keep for w in layer.values() if isinstance(w, PackedWeight)}
    assert types == {"Q4_K", "Q6_K"} and model.packed_head.type == "Q6_K"
    assert model.embed_weight.type == "Q4_K"            # the embedding stays quantized
    size = path.stat().st_size
    assert 0.97 * size < model.memory.weights < 1.04 * size     # the pack: the file's size
    assert model.memory.kv == 2 * 2 * 8 * 128 * 2 * 512          # layers x (k, v) x heads x dim x half x tokens
    assert model.args.rope_scaling["type"] == "freqs" and not model.args.tied_embeddings


def drafters(model):
    a = model.args
    g = torch.Generator().manual_seed(0)
    eagle2 = EagleDrafter.random(model, seed=1, dtype=torch.bfloat16)
    eagle2.pack("q8i" if native.has_int8() else "bf16")
    head = model.packed_head
    subset = StaticSubset(head, torch.randperm(a.vocab_size, generator=g)[:32768], name="fr:32k")
    config = Eagle3Config(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                          intermediate_size=a.intermediate_size, n_layers=1, norm_eps=a.norm_eps,
                          rope_base=a.rope_base, draft_vocab_size=32000, aux_layers=(1, 2), target_dim=a.dim)
    eagle3 = Eagle3Drafter.random(model, config, seed=2, dtype=torch.bfloat16)
    eagle3.pack("q8i" if native.has_int8() else "bf16")
    return {"eagle-full": EagleProposer(eagle2, draft_vocab=FullVocab(head), **TREE),
            "eagle-fr:32k": EagleProposer(eagle2, draft_vocab=subset, **TREE),
            "eagle3": EagleProposer(eagle3, draft_vocab=eagle3.draft_vocab("full"), **TREE),
            "pld": PromptLookupProposer(),
            "eagle+pld": EagleLookupProposer(eagle2, draft_vocab=subset, **TREE)}


def test_every_family_gives_plain_decodings_tokens_at_8b_widths(target):
    model, _ = target
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    g = torch.Generator().manual_seed(3)
    # A prompt that repeats itself, so prompt lookup's proposals are accepted now and then.
    prompt = torch.randint(1000, 100000, (12,), generator=g).tolist() * 3
    reference = Engine(model).generate(prompt, config)
    assert len(reference.tokens) == NEW_TOKENS
    for name, proposer in drafters(model).items():
        result = Engine(model, proposer=proposer).generate(prompt, config)
        assert result.tokens == reference.tokens, name
        assert any(step.tree_size > 0 for step in result.steps), f"{name} never drafted"
