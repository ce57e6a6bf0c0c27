"""EAGLE-3 checkpoints as vLLM's `speculators` 0.9.0 saves a drafter it has built and not
trained, written without the package (tests make them at run time; none is stored).

The package's `Eagle3DraftModel(config).save_pretrained(dir)` writes config.json in its own
form (`target_hidden_size: null`, the layer's `rope_parameters`) and model.safetensors with its
layer weights drawn as transformers initialises them (normal, std 0.02; norms 1), but leaves
`lm_head.weight` and `embed_tokens.weight` as allocated: they are filled from the verifier when
training starts, and as saved they hold NaN. `d2t` and `t2d` are zeros (the identity map over
the first draft_vocab_size ids, and a t2d that disagrees with it). Such a checkpoint is valid
for the package, so vocabspec must draft with it (uselessly, and losslessly) without harm.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def untrained_speculators_checkpoint(directory: Path, args, draft_vocab: int = 8192, aux=(1, 14, 27),
                                     seed: int = 0, embed: bool = True, nan_head: bool = True) -> Path:
    """Write an untrained speculators-layout EAGLE-3 drafter for a target of ModelArgs `args`
    (one decoder layer of the target's shape) to `directory`; `embed`: with the package's own
    NaN embedding table (vocab x dim floats, as it saves it); `nan_head`: its head NaN as the
    package leaves it, else drawn as the other weights."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    dim, heads, kv, head_dim, hidden = args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.intermediate_size

    def weight(rows, cols):
        return torch.randn(rows, cols, generator=generator) * 0.02

    state = {
        "fc.weight": weight(dim, len(aux) * dim),
        "layers.0.self_attn.q_proj.weight": weight(heads * head_dim, 2 * dim),
        "layers.0.self_attn.k_proj.weight": weight(kv * head_dim, 2 * dim),
        "layers.0.self_attn.v_proj.weight": weight(kv * head_dim, 2 * dim),
        "layers.0.self_attn.o_proj.weight": weight(dim, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": weight(hidden, dim),
        "layers.0.mlp.up_proj.weight": weight(hidden, dim),
        "layers.0.mlp.down_proj.weight": weight(dim, hidden),
        "layers.0.input_layernorm.weight": torch.ones(dim),
        "layers.0.post_attention_layernorm.weight": torch.ones(dim),
        "layers.0.hidden_norm.weight": torch.ones(dim),
        "norm.weight": torch.ones(dim),
        "lm_head.weight": torch.full((draft_vocab, dim), float("nan")) if nan_head else weight(draft_vocab, dim),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        "t2d": torch.zeros(args.vocab_size, dtype=torch.bool),
    }
    if embed:
        state["embed_tokens.weight"] = torch.full((args.vocab_size, dim), float("nan"))
    save_file(state, str(directory / "model.safetensors"))
    layer = {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
             "head_dim": head_dim, "hidden_act": "silu", "hidden_size": dim, "initializer_range": 0.02,
             "intermediate_size": hidden, "max_position_embeddings": 8192, "mlp_bias": False,
             "model_type": "llama", "num_attention_heads": heads, "num_hidden_layers": 1,
             "num_key_value_heads": kv, "pad_token_id": None, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
             "rope_parameters": {"rope_theta": float(args.rope_base), "rope_type": "default"},
             "tie_word_embeddings": False, "use_cache": True, "vocab_size": args.vocab_size}
    config = {"architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
              "draft_vocab_size": draft_vocab, "dtype": "float32", "eagle_aux_hidden_state_layer_ids": list(aux),
              "embed_requires_grad": False, "fc_norm": False, "norm_before_fc": False,
              "norm_before_residual": False, "norm_output": False,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                           "speculative_tokens": 3, "verifier_accept_k": 1}],
                                     "verifier": {"architectures": [], "name_or_path": None}},
              "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
              "tie_word_embeddings": False, "transformer_layer_config": layer}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
