"""Our model against transformers' implementation of the same GGUF, in float32: the native
engine with float32 weights (the same values as transformers' dequantization)."""

import pytest
import torch

from conftest import forward

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ours(real_model):
    from vocabspec.runtime.loading import load_model

    return load_model(real_model.name, weights="f32")[0]


@pytest.fixture(scope="module")
def reference(real_model):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig

    from vocabspec.runtime.files import cache_dir, file_key, write_atomically

    logging.set_verbosity_error()
    path = real_model.path
    # transformers reads a GGUF in Python (about a minute for Gemma's: its configuration alone
    # half of it); the configuration and weights it made are kept, keyed by the file's contents
    # and transformers' version, and go back into a model transformers builds from them.
    saved = cache_dir() / f"transformers-{path.stem}-{file_key(path)}-{transformers.__version__}"
    weights = saved / "weights.safetensors"
    if weights.exists():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(saved)), dtype=torch.float32)
        load_model(model, str(weights), strict=True)
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    model.config.save_pretrained(str(saved))
    write_atomically(weights, lambda tmp: save_model(model, str(tmp)))
    return model


def test_logits_match_transformers(real_model, ours, reference):
    # 700 tokens: past Gemma's 512-token sliding window, so local and global layers both count.
    torch.manual_seed(0)
    ids = torch.randint(10, 5000, (700,))
    model = ours
    cache = model.new_cache()
    with torch.inference_mode():
        _, logits = forward(model, ids, torch.arange(700), cache, all_logits=True)
        ref = reference(ids[None]).logits[0].float()
    diff = (logits - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"{real_model.name}: max |logit diff| {diff:.2e} at logit scale {scale:.1f}")
    assert diff < 1e-3 * scale
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


# One prompt: the logits test above already compares every position of another text, and each
# further prompt here was the same check over another 64 tokens.
PROMPTS = ["Explain why the sky is blue."]


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_64_tokens_match_transformers(real_model, ours, reference, text):
    from vocabspec.decoding.generate import GenerationConfig
    from vocabspec.decoding.batch import Engine

    ids = real_model.prompt_ids(text)
    engine = Engine(ours, real_model.tokenizer)
    ours = engine.generate(ids, GenerationConfig(max_new_tokens=64))
    with torch.inference_mode():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                 eos_token_id=sorted(engine.eos_ids), pad_token_id=0)
    theirs = out[0, len(ids):].tolist()
    if theirs and theirs[-1] in engine.eos_ids:   # transformers keeps the EOS token, we drop it
        theirs = theirs[:-1]
    assert ours.tokens == theirs
    assert len(ours.tokens) >= 16
