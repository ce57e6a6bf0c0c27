"""bfloat16 on torch's kernels (the path other devices take): a forward over a tree rounds
differently from one-token forwards, so speculative decoding there is refused unless the user
accepts it (allow_inexact). What is promised then, and tested here: speculative output equals
vanilla's up to the first position where the two differ, and every such divergence starts at a
near-tie of the target's own logits in vanilla decoding (both tokens within a bfloat16
rounding margin of the maximum), never at a clear preference. On the native CPU engine every
format, bf16 included, is exact (test_native.py, test_lossless.py)."""

import pytest
import torch

from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.decoding.batch import Engine
from vocabspec.runtime.loading import load_model
from vocabspec.speculation.families.pld import PromptLookupProposer

from conftest import spec_bench_prompts, forward

NEW_TOKENS = 32


def bf16_margin(logits: torch.Tensor) -> float:
    """Two bfloat16 units in the last place at the largest logit (8 significant bits: a logit
    near 20 is a multiple of 0.125). The tree and the one-token path round the layers'
    activations differently, so two tokens this close are a numerical tie."""
    top = float(logits.abs().max())
    return 2 * 2.0 ** (torch.floor(torch.log2(torch.tensor(top))).item() - 7)


def vanilla_logits_at(model, prompt_ids, generated, index):
    """The logits vanilla decoding computed for generated[index]: prefill, then one-token steps."""
    cache = model.new_cache()
    with torch.inference_mode():
        [(_, logits)] = model.prefill([(prompt_ids, cache, ())])
        for position, token in enumerate(generated[:index]):
            _, logits = forward(model, torch.tensor([token]), torch.tensor([len(prompt_ids) + position]), cache)
            cache.commit()
    return logits[0].float()


def test_inexact_speculation_is_refused_unless_accepted(smollm2):
    model, _ = load_model("smollm2", weights="bf16", backend="torch")
    assert not model.exact and model.weights == "torch-bfloat16"
    with pytest.raises(ValueError, match="not exact"):
        Engine(model, smollm2.tokenizer, PromptLookupProposer())
    Engine(model, smollm2.tokenizer, PromptLookupProposer(), allow_inexact=True)


def test_speculation_without_the_native_engine_is_refused_before_drafting(monkeypatch):
    """Where the native engine is not used (VOCABSPEC_NATIVE=0 here; no AVX2, no compiler or a
    shape it cannot run elsewhere), float32 runs on torch's kernels, which are not row-invariant
    either: refused by name before any drafter is built or timed, and the engine is said."""
    import vocabspec

    monkeypatch.setenv("VOCABSPEC_NATIVE", "0")
    with pytest.raises(ValueError, match="allow-inexact") as refused:
        vocabspec.load("smollm2", draft="eagle")
    assert "VOCABSPEC_NATIVE=0" in str(refused.value)
    lm = vocabspec.load("smollm2")
    assert "torch's kernels" in lm.engine.model.runs_on
    assert "VOCABSPEC_NATIVE=0" in lm.generate("Hi", max_new_tokens=2).runs_on


def test_bf16_divergences_start_at_near_ties(smollm2):
    model, _ = load_model("smollm2", weights="bf16", backend="torch")
    tokenizer = smollm2.tokenizer
    vanilla = Engine(model, tokenizer)
    proposers = {"eagle-random": EagleProposer(EagleDrafter.random(model, seed=1), depth=4, top_k=6,
                                               total_tokens=24),
                 "pld": PromptLookupProposer()}
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    divergences, compared = [], 0
    for category, text in spec_bench_prompts()[::4]:     # every fourth category: 4 of 13
        ids = smollm2.prompt_ids(text[:1200])
        reference = vanilla.generate(ids, config).tokens
        for name, proposer in proposers.items():
            out = Engine(model, tokenizer, proposer, allow_inexact=True).generate(ids, config).tokens
            compared += 1
            if out == reference:
                continue
            i = next((k for k, (a, b) in enumerate(zip(out, reference)) if a != b), None)
            if i is None:   # one stopped earlier at a flipped EOS decision
                i = min(len(out), len(reference))
                if i >= len(out) or i >= len(reference):
                    continue
            logits = vanilla_logits_at(model, ids, reference, i)
            gap = float(logits[reference[i]] - logits[out[i]])
            margin = bf16_margin(logits)
            divergences.append((category, name, i, gap, margin))
    print(f"bf16: {len(divergences)} of {compared} generations diverged: {divergences}")
    clear = [d for d in divergences if not 0 <= d[3] <= d[4]]
    assert not clear, f"divergences at clear preferences (gap beyond the bf16 margin): {clear}"
