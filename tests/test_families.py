"""Model families against transformers' own implementation: a tiny random model of each, built
with transformers' class and config and saved by it, loaded by vocabspec, gives the same
logits (float32) and the same greedy tokens, on torch's kernels and on the native engine.
Real-scale settings where they matter: head_dim 64, RoPE base 500,000 with Llama 3's scaling,
positions past the original context, a sliding window shorter than the text, an untied head,
Gemma 3's query scale apart from head_dim. Settings vocabspec does not compute are refused."""

import json

import pytest
import torch

from conftest import forward


transformers = pytest.importorskip("transformers")

from vocabspec.decoding.generate import GenerationConfig  # noqa: E402
from vocabspec.decoding.batch import Engine
from vocabspec.runtime.loading import ModelLoadError, load_model  # noqa: E402

SHAPE = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)


def llama3(**extra):
    return transformers.LlamaConfig(**SHAPE, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, **extra)


FAMILIES = {
    "llama3": (transformers.LlamaForCausalLM, llama3),
    "qwen2": (transformers.Qwen2ForCausalLM,
              lambda: transformers.Qwen2Config(**SHAPE, rope_theta=1000000.0, tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3ForCausalLM,
              lambda: transformers.Qwen3Config(**SHAPE, rope_theta=1000000.0, tie_word_embeddings=True)),
    "mistral": (transformers.MistralForCausalLM,
                lambda: transformers.MistralConfig(**SHAPE, sliding_window=16)),
    "gemma3": (transformers.Gemma3ForCausalLM,
               lambda: transformers.Gemma3TextConfig(**{**SHAPE, "num_key_value_heads": 1}, sliding_window=16,
                                                     query_pre_attn_scalar=48, sliding_window_pattern=2)),
}


def save_tiny(family: str, path, **extra):
    cls, make_config = FAMILIES[family]
    torch.manual_seed(7)
    model = cls(make_config(**extra) if extra else make_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():   # norms off 1 and biases off 0, so both count
            if "norm" in name:
                p.copy_(torch.rand_like(p) * 0.5 + (0.75 if family != "gemma3" else -0.25))
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, backend, tmp_path):
    from vocabspec.runtime import native

    if backend == "native" and not native.available()[0]:
        pytest.skip(native.available()[1])
    reference = save_tiny(family, tmp_path)
    ours, _ = load_model(str(tmp_path), weights="f32", backend=backend)
    assert ours.args.arch == {"llama3": "llama"}.get(family, family)
    # 120 tokens: past Llama's original 64-token context and every window of 16.
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = reference(ids[None]).logits[0].float()
        _, got = forward(ours, ids, torch.arange(120), ours.new_cache(256), all_logits=True)
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max()), family
    prompt = ids[:20].tolist()
    out = Engine(ours).generate(prompt, GenerationConfig(max_new_tokens=24, stop_on_eos=False)).tokens
    with torch.inference_mode():
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    min_new_tokens=24, pad_token_id=0)[0, 20:].tolist()
    assert out == theirs, family


def test_llama_saved_the_older_way(tmp_path):
    """rope_theta and rope_scaling at the config's top level (transformers 4's layout)."""
    reference = save_tiny("llama3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours, _ = load_model(str(tmp_path), weights="f32", backend="torch")
    assert ours.args.rope_base == 500000.0 and ours.args.rope_scaling["type"] == "llama3"
    ids = torch.arange(5, 105)
    with torch.inference_mode():
        want = reference(ids[None]).logits[0]
        _, got = forward(ours, ids, torch.arange(100), ours.new_cache(128), all_logits=True)
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max())


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "yarn"),
    ({"model_type": "falcon"}, "falcon"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "activation"),
])
def test_unsupported_settings_are_refused(change, message, tmp_path):
    save_tiny("llama3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tmp_path), backend="torch")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_drafting_pipeline_for_each_family(family, tmp_path):
    """What `vocabspec train`, `vocabspec vocab --source target` and `vocabspec export` do, on a
    tiny model of each family: the target's own answers as data, features, a few training
    steps, a VocabTrim token map from the target's predictions; speculative decoding with the
    trained drafter and that map gives plain decoding's tokens; the export loads back and
    reads as the family's Hugging Face config."""
    from vocabspec.speculation.vocab.draft_vocab import make_draft_vocab
    from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
    from vocabspec.export import export
    from vocabspec.speculation.vocab.token_map import count_target_predictions, rank, save_token_map
    from vocabspec.training.train import TrainConfig, extract_features, train_drafter

    reference = save_tiny(family, tmp_path / "target")
    model, _ = load_model(str(tmp_path / "target"), weights="f32", max_seq_len=128)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (8,), generator=generator).tolist() for _ in range(8)]
    config = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    answers = [Engine(model).generate(p, config).tokens for p in prompts]
    sequences = [p + a for p, a in zip(prompts, answers)]

    run = tmp_path / "run"
    cfg = TrainConfig.of(out=str(run), max_len=64, top_candidates=8, negatives=16, epochs=40,
                      max_steps=24, accumulate=2, lr=3e-3, warmup_steps=2, noise=0.0,
                      checkpoint_every=12)
    extract_features(cfg, model, {"train": sequences[2:], "heldout": sequences[:2]})
    drafter = train_drafter(cfg, model, log=lambda *_: None)
    history = torch.load(run / "checkpoint.pt")["history"]
    losses = [h["train"]["regression"] + h["train"]["classification"] for h in history]
    assert losses[-1] < losses[0], (family, losses)

    ranked = rank(count_target_predictions(run / "features"), 300)
    save_token_map(ranked[:64], tmp_path / "token_map_trim.pt")
    for vocab in ("full", "trim:64"):
        head = make_draft_vocab(vocab, model.head_weight, tmp_path)
        proposer = EagleProposer(drafter, draft_vocab=head, depth=4, top_k=4, total_tokens=12)
        # On torch's kernels (a family the native engine cannot run) float32 is not row-
        # invariant, so speculation is allowed explicitly; its output is still checked below.
        engine = Engine(model, proposer=proposer, allow_inexact=not model.exact)
        steps = 0
        for prompt, want in zip(prompts[:4], answers[:4]):
            result = engine.generate(prompt, config)
            assert result.tokens == want, (family, vocab)
            steps += len(result.steps)
        assert steps < 4 * 40, (family, vocab)     # drafts were accepted, so verification was tested

    drafter.save(tmp_path / "drafter")
    written = export(str(tmp_path / "target"), tmp_path / "export", draft_path=str(tmp_path / "drafter"),
                     draft_vocab="trim:64", token_map=str(tmp_path / "token_map_trim.pt"))
    assert {p.name for p in written} >= {"config.json", "model.safetensors", "token_map.pt"}
    again = EagleDrafter.load(tmp_path / "export", model)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b.to(a.dtype)), (family, name)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "export")
    assert type(theirs) is type(reference.config), family
    assert theirs.max_position_embeddings == 512 and theirs.head_dim == 64
    # Gemma 3 keeps RoPE per layer type; the drafter's one layer is a global-attention layer.
    rope = [c.rope_parameters.get("full_attention", c.rope_parameters) for c in (theirs, reference.config)]
    assert rope[0]["rope_theta"] == rope[1]["rope_theta"] and rope[0]["rope_type"] == rope[1]["rope_type"]
    if family == "llama3":
        assert rope[0]["factor"] == 8.0 and rope[0]["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_family_that_differs_in_features_is_one_table_row(backend, tmp_path, monkeypatch):
    """A throwaway family, Llama with a GELU gate: one row of ARCH_FEATURES (and its name in
    the loader's table), and it matches transformers on both engines."""
    from vocabspec.runtime import loading, model, native

    if backend == "native" and not native.available()[0]:
        pytest.skip(native.available()[1])
    monkeypatch.setitem(model.ARCH_FEATURES, "llama-gelu", model.ArchFeatures(gelu=True))
    monkeypatch.setitem(loading.HF_ARCHS, "llama", "llama-gelu")
    reference = save_tiny("llama3", tmp_path, hidden_act="gelu_pytorch_tanh")
    ours, _ = load_model(str(tmp_path), weights="f32", backend=backend)
    assert ours.args.arch == "llama-gelu" and ours.args.features.gelu
    ids = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = reference(ids[None]).logits[0].float()
        _, got = forward(ours, ids, torch.arange(80), ours.new_cache(128), all_logits=True)
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max())
    monkeypatch.setitem(loading.HF_ARCHS, "llama", "llama")     # without the row: refused
    with pytest.raises(ModelLoadError, match="activation"):
        load_model(str(tmp_path), weights="f32", backend=backend)
