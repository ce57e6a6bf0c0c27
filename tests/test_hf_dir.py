"""Loading a Hugging Face model directory (config.json + safetensors), checked against
transformers on small random Llama and Gemma 3 checkpoints."""

import pytest
import torch

from conftest import forward


transformers = pytest.importorskip("transformers")

from vocabspec.runtime.loading import ModelLoadError, load_model  # noqa: E402


def make_checkpoint(arch, directory):
    torch.manual_seed(0)
    common = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                  tie_word_embeddings=True)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=8,
                                               layer_types=["sliding_attention", "full_attention"] * 2)
        model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)   # Gemma stores w for (1 + w): exercise the shift
    model.eval().save_pretrained(directory)
    return model


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_hf_directory_matches_transformers(arch, tmp_path):
    reference = make_checkpoint(arch, tmp_path)
    ours, _ = load_model(str(tmp_path))
    ids = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, logits = forward(ours, ids, torch.arange(30), ours.new_cache(), all_logits=True)
        ref = reference(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_hf_directory_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(str(tmp_path))


FAMILIES = {   # transformers' config class, and what sets the family apart
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(rope_theta=1000000.0)),
    "mistral": ("MistralConfig", dict(rope_theta=1000000.0, sliding_window=4096)),
}
PROMPT = "The capital of France is"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's tokenizer as transformers saves one, for the random checkpoints below."""
    from vocabspec.runtime.loading import bundled_gguf

    path = bundled_gguf("smollm2")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def save_family(family, tokenizer, directory):
    """A tiny random checkpoint of `family` with a tokenizer, saved by transformers; the model."""
    torch.manual_seed(1)
    name, extra = FAMILIES[family]
    eos = tokenizer.eos_token_id
    config = getattr(transformers, name)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=family != "llama3", bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)          # logits far apart: a greedy choice no rounding can flip
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_saved_directory_decodes_as_transformers_does_from_cli_api_and_server(family, smollm2_tokenizer,
                                                                                 tmp_path, capsys):
    import json

    import httpx

    import vocabspec
    from vocabspec.cli import main
    from vocabspec.serving.server import HTTPThread, ServerLimits, create_app

    reference = save_family(family, smollm2_tokenizer, tmp_path)
    ids = smollm2_tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    expected = out[:out.index(smollm2_tokenizer.eos_token_id)] if smollm2_tokenizer.eos_token_id in out else out
    text = smollm2_tokenizer.decode(expected)

    lm = vocabspec.load(str(tmp_path), max_seq_len=256)
    result = lm.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert result.tokens == expected
    assert main(["generate", "--model", str(tmp_path), "--max-new-tokens", str(NEW_TOKENS), "--json", PROMPT]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == text
    http = HTTPThread(create_app(lm, family, ServerLimits(window=256)))
    try:
        base = http.wait_ready()
        answer = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                            "temperature": 0}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == text
    finally:
        http.stop(10)


def test_a_path_that_is_no_model_gets_a_one_line_error(tmp_path, capsys):
    from vocabspec.cli import main

    (tmp_path / "notes.txt").write_text("not a model")
    for path in (tmp_path / "notes.txt", tmp_path, tmp_path / "missing.gguf"):
        assert main(["generate", "--model", str(path), "--max-new-tokens", "2", "Hello"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("vocabspec: error:") and "\n" not in err and "Traceback" not in err, err


def test_a_model_directorys_tokenizer_tokenizes_as_its_gguf(tmp_path):
    # transformers writes SmolLM2's tokenizer (its GGUF's, which it converts right) to a
    # directory; read back from there it gives the GGUF's ids, special tokens and chat.
    from vocabspec.runtime.loading import bundled_gguf
    from vocabspec.runtime.tokenizer import load_tokenizer

    path = bundled_gguf("smollm2")
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf.save_pretrained(str(tmp_path))
    ours, theirs = load_tokenizer(tmp_path), load_tokenizer(path)
    texts = ["Hello world", " leading space", "<|im_start|>user\nhi<|im_end|>", "naïve 日本 🦙\n\n  x"]
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, parse_special=special) == theirs.encode(text, parse_special=special)
        assert ours.decode(theirs.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "user", "content": "Hi <|im_end|>"}]
    assert ours.encode_chat(chat) == theirs.encode_chat(chat)
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos) == (theirs.bos_token_id, theirs.eos_token_id, False)
