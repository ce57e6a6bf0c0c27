"""`vocabspec export` writes what SGLang / vLLM read: the EAGLE checkpoint layout and the token
map (SGLang list, EAGLE-3 d2t/t2d); the files are read back and checked key by key."""

import json

import pytest
import torch

from conftest import forward
from safetensors.torch import load_file

from vocabspec.cli import main
from vocabspec.speculation.families.eagle import EagleDrafter
from vocabspec.runtime.formats import PackedWeight
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.decoding.batch import Engine
from vocabspec.speculation.vocab.token_map import load_token_map, save_token_map

EAGLE_KEYS = {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
              "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
              "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
              "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"}


def test_export_round_trip(smollm2, tmp_path, capsys):
    model = smollm2.model
    drafter = EagleDrafter.random(model, seed=4)
    drafter.save(tmp_path / "drafter")
    ranked = torch.randperm(model.args.vocab_size)[:5000].tolist()
    save_token_map(ranked, tmp_path / "map.pt")
    out = tmp_path / "export"
    assert main(["export", "--model", "smollm2", "--draft-path", str(tmp_path / "drafter"),
                 "--draft-vocab", "fr:4096", "--token-map", str(tmp_path / "map.pt"),
                 "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    a = model.args
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert (config["hidden_size"], config["vocab_size"], config["num_key_value_heads"]) == \
        (a.dim, a.vocab_size, a.n_kv_heads)
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == EAGLE_KEYS          # no input norm on layer 0, as EAGLE-1/2
    assert tensors["fc.weight"].shape == (a.dim, 2 * a.dim)
    assert tensors["layers.0.self_attn.k_proj.weight"].shape == (a.n_kv_heads * a.head_dim, a.dim)
    assert torch.equal(tensors["fc.weight"], drafter.fc.weight)
    # The exported drafter loads back and drafts the same.
    again = EagleDrafter.load(out, model)
    assert torch.equal(again.layers[0].mlp.w_down.weight, drafter.layers[0].mlp.w_down.weight)
    # Token map: SGLang's list of the 4096 most frequent, and EAGLE-3's d2t/t2d.
    token_map = torch.load(out / "token_map.pt")
    assert isinstance(token_map, list) and token_map == ranked[:4096]
    d2t = load_file(str(out / "d2t_t2d.safetensors"))
    assert d2t["d2t"].shape == (4096,) and d2t["t2d"].shape == (a.vocab_size,)
    assert d2t["t2d"].sum() == 4096
    assert load_token_map(out / "d2t_t2d.safetensors").tolist() == sorted(ranked[:4096])


def test_export_refuses_spec_vocab_and_bad_paths(smollm2, tmp_path, capsys):
    assert main(["export", "--model", "smollm2", "--draft-path", str(tmp_path / "nope"),
                 "--out", str(tmp_path / "x")]) == 2
    assert "missing config.json" in capsys.readouterr().err
    # Two layers or fused taps have no place in the one-layer EAGLE-1/2 layout.
    EagleDrafter.random(smollm2.model, n_layers=2).save(tmp_path / "deep")
    assert main(["export", "--model", "smollm2", "--draft-path", str(tmp_path / "deep"),
                 "--out", str(tmp_path / "y")]) == 2
    assert "has 2 layers" in capsys.readouterr().err


def test_exported_drafter_matches_eagle_reference(smollm2, tmp_path):
    """The exported checkpoint, loaded by EAGLE's own reference drafter from its config.json,
    computes our drafter's states, past position 64 too; the config states the target's real
    context length and RoPE base (not the window export loaded the target with)."""
    cnets = pytest.importorskip("eagle.model.cnets", reason="needs EAGLE's reference drafter: "
                                "pip install --no-deps eagle-llm")
    from eagle.model.configs import EConfig

    from vocabspec.speculation.families.eagle import draft_states, features_of

    out = tmp_path / "export"
    assert main(["export", "--model", "smollm2", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    target = smollm2.model
    assert config["max_position_embeddings"] == target.args.context_length == 8192
    assert config["rope_theta"] == target.args.rope_base and config["rope_scaling"] is None
    econfig = EConfig.from_pretrained(str(out))
    if (econfig.rope_scaling or {}).get("rope_type") == "default":
        econfig.rope_scaling = None      # transformers 5 fills in what EAGLE's code expects absent
    reference = cnets.Model(econfig, bias=True).float().eval()
    state = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) == {"embed_tokens.weight"}
    reference.embed_tokens.weight.data = target.embed_weight.dequantize()    # the packed embedding's values
    # EAGLE's reference hard-codes RoPE base 10000; an engine reads the base from the config.
    head_dim = config["head_dim"]
    for layer in reference.layers:
        layer.self_attn.rotary_emb = cnets.LlamaRotaryEmbedding(
            head_dim, config["max_position_embeddings"], base=config["rope_theta"])
    ids = smollm2.prompt_ids("Explain how a bicycle works, step by step, in detail.")
    answer = Engine(target, smollm2.tokenizer).generate(ids, GenerationConfig(max_new_tokens=96, stop_on_eos=False))
    tokens = ids + answer.tokens
    tokens = torch.tensor(tokens)
    assert len(tokens) > 100
    with torch.inference_mode():
        hidden, _ = forward(target, tokens, torch.arange(len(tokens)), target.new_cache(len(tokens)))
        features = features_of(target, hidden)
        ours = draft_states(EagleDrafter.load(out, target, dtype=torch.float32), tokens, features)
        theirs = reference(features[:-1][None], tokens[1:][None])[0]
    assert (ours[64:] - theirs[64:]).abs().max() < 1e-4 * theirs.abs().max()
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()



def test_drafters_ship_as_q8_0_groups_the_engine_drafts_with_unchanged(smollm2, tmp_path):
    """Shipped drafters hold their matrices as Q8_0 groups (half of bfloat16's bytes): loaded,
    they give the native engine exactly the 8-bit groups it drafts with beside 8-bit activations,
    and they export as bfloat16 for EAGLE's readers."""
    model = smollm2.model
    drafter = EagleDrafter.random(model, seed=4)
    drafter.save(tmp_path / "q8", q8_0=True)
    tensors = load_file(str(tmp_path / "q8" / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.int8 and tensors["fc.weight_scale"].dtype == torch.float16
    again = EagleDrafter.load(tmp_path / "q8", model)
    drafter.pack("q8i")
    again.pack("q8i")
    for ours, theirs in zip(drafter.runtime.stack.keep + [{"fc": drafter.runtime.fc}],
                            again.runtime.stack.keep + [{"fc": again.runtime.fc}]):
        for name, packed in ours.items():
            if isinstance(packed, PackedWeight):
                assert torch.equal(packed.data, theirs[name].data) and packed.type == theirs[name].type
    out = tmp_path / "export"
    assert main(["export", "--model", "smollm2", "--draft-path", str(tmp_path / "q8"), "--out", str(out)]) == 0
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == EAGLE_KEYS and exported["fc.weight"].dtype == torch.bfloat16
