"""Loading a Hugging Face model directory (config.json + safetensors), checked against
transformers on small random Llama and Gemma 3 checkpoints."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vocabspec.engine.loading import ModelLoadError, load_model  # noqa: E402


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
        _, logits = ours(ids, torch.arange(30), ours.new_cache(), all_logits=True)
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


def test_a_model_directorys_tokenizer_tokenizes_as_its_gguf(tmp_path):
    # transformers writes SmolLM2's tokenizer (its GGUF's, which it converts right) to a
    # directory; read back from there it gives the GGUF's ids, special tokens and chat.
    from vocabspec.engine.loading import bundled_gguf
    from vocabspec.engine.tokenizer import load_tokenizer

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
