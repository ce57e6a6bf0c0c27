"""EAGLE-3 drafters in the ecosystem's layouts: loaded for any target, drafting EAGLE-2's
dynamic trees, saved back.

EAGLE-3 (Li et al., 2025) drafts from three target layers at once. At a position the target
has run, `fc` fuses the outputs of a low, a middle and a high layer into one feature; the
first decoder layer's attention reads the next token's embedding and that feature side by
side, each through a norm of its own (q, k and v over 2 x hidden), with the feature as the
residual; a final norm and the drafter's own LM head score a draft vocabulary, whose ids map
to the target's by `d2t` (target id = draft id + d2t[draft id]). A deeper draft step reads
the layer's output (before the final norm) in place of the fused feature, as EAGLE-2's
drafter reads its predicted feature.

Two layouts are read and written:
- speculators' (vllm-project/speculators, what vLLM serves): config.json with
  `speculators_model_type: eagle3` and the layer's `transformer_layer_config`; tensors
  `fc`, `layers.N.*` (layer 0 with `hidden_norm`), `norm`, `lm_head`, `d2t`, `t2d`,
  optionally `embed_tokens`;
- SGLang's `LlamaForCausalLMEagle3` (EAGLE-3's reference checkpoints): a Llama config with
  `draft_vocab_size`; tensors `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, optionally
  `embed_tokens`, any of them under `model.`.

Target layers are named as both do, by Hugging Face's hidden-state index: 0 is the embedding
output and i the output of layer i - 1 (the input of layer i); by default [2, N/2, N - 3].
The embedding is the checkpoint's where it has one, else the target's table (unscaled, as
both read it). Drafting runs on torch's kernels, on any device, or where the target runs on
the native CPU engine, on it: a read and a whole tree one native call each, as EAGLE-2's
(`pack`). It only chooses what is drafted, so the target's verification keeps the
output exactly the target's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .eagle import (DrafterMismatch, PackedLayers, RuntimeDrafter, TorchLayers, attention_mask, copy_checkpoint,
                    randomized, unfused, unpack_q8_0)
from ...runtime.kv_cache import KVCache
from ...runtime.linear import Linear
from ...runtime.model import Block, ModelArgs, RMSNorm, rope_tables

LAYOUTS = ("speculators", "sglang")


@dataclass
class Eagle3Config:
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    n_layers: int
    norm_eps: float
    rope_base: float
    draft_vocab_size: int
    aux_layers: tuple[int, ...]            # target hidden-state indices fused by fc, in fc's order
    target_dim: int
    layer_type: str = "llama"              # the drafter's layers: llama, or qwen3 (q/k norms)
    rope_scaling: dict | None = None
    attention_bias: bool = False
    fc_bias: bool = False
    norm_before_residual: bool = False     # the residual is the normed feature
    norm_before_fc: bool = False           # one norm over fc's whole input
    fc_norm: bool = False                  # one norm per fused layer
    norm_output: bool = False              # the layer's output is normed before it is fed back


def _layer_fields(c: dict) -> dict:
    """What a Hugging Face layer config says of the drafter's layers."""
    rope = c.get("rope_parameters") or {}
    base = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("llama3", "linear"):
            raise DrafterMismatch(f"RoPE scaling {kind!r} (supported: llama3, linear)")
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_type", "rope_theta")} | {"type": kind}
    heads = c["num_attention_heads"]
    return dict(dim=c["hidden_size"], n_heads=heads, n_kv_heads=c.get("num_key_value_heads", heads),
                head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                intermediate_size=c["intermediate_size"], norm_eps=c.get("rms_norm_eps", 1e-6),
                rope_base=float(base), rope_scaling=scaling, attention_bias=bool(c.get("attention_bias", False)),
                layer_type="qwen3" if c.get("model_type") == "qwen3" else "llama")


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    return (2, n_layers // 2, n_layers - 3)


def read_config(config: dict, target) -> tuple[str, Eagle3Config]:
    """(layout, config) of an EAGLE-3 checkpoint's config.json for `target`."""
    n = target.args.n_layers
    if config.get("speculators_model_type") == "eagle3":
        layer = config.get("transformer_layer_config") or {}
        aux = config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(n)
        fields = dict(n_layers=layer.get("num_hidden_layers", 1), draft_vocab_size=config["draft_vocab_size"],
                      fc_bias=False, norm_before_residual=bool(config.get("norm_before_residual")),
                      norm_before_fc=bool(config.get("norm_before_fc")), fc_norm=bool(config.get("fc_norm")),
                      norm_output=bool(config.get("norm_output")),
                      target_dim=config.get("target_hidden_size") or layer["hidden_size"])
        layout = "speculators"
    else:
        layer = config
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(n)
        fields = dict(n_layers=config.get("num_hidden_layers", 1),
                      draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
                      fc_bias=bool(config.get("bias", False)),
                      target_dim=config.get("target_hidden_size") or config["hidden_size"])
        layout = "sglang"
    try:
        return layout, Eagle3Config(**_layer_fields(layer), **fields, aux_layers=tuple(int(i) for i in aux))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DrafterMismatch(f"not an EAGLE-3 config: {exc!r} missing or malformed") from exc


def check_t2d(t2d: torch.Tensor, ids: torch.Tensor, vocab: int, directory) -> None:
    """A checkpoint's t2d (one flag per target id: in the draft vocabulary): the target's length,
    flags 0 or 1, and where any is set, exactly the ids d2t maps to. All zeros is accepted: vLLM's
    speculators saves an untrained drafter so, and d2t alone says what the draft ids are."""
    if t2d.dim() != 1 or t2d.numel() != vocab:
        raise DrafterMismatch(f"EAGLE-3 drafter {directory}: t2d of shape {tuple(t2d.shape)}, the target "
                              f"has {vocab} ids")
    if t2d.dtype != torch.bool:
        bad = (t2d != 0) & (t2d != 1)
        if bool(bad.any()):
            at = int(bad.nonzero()[0, 0])
            raise DrafterMismatch(f"EAGLE-3 drafter {directory}: t2d[{at}] is {t2d[at].item()}, not 0 or 1")
    flags = t2d != 0
    if bool(flags.any()):
        want = torch.zeros(vocab, dtype=torch.bool)
        want[ids] = True
        if not torch.equal(flags, want):
            at = int((flags != want).nonzero()[0, 0])
            raise DrafterMismatch(f"EAGLE-3 drafter {directory}: t2d[{at}] is {bool(flags[at])}, but d2t "
                                  f"{'does not map' if flags[at] else 'maps'} a draft id to target id {at}")


def is_eagle3(directory: str | Path) -> bool:
    """Whether `directory` holds an EAGLE-3 checkpoint in either layout."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return config.get("speculators_model_type") == "eagle3" or \
        any("Eagle3" in a for a in config.get("architectures") or [])


class Eagle3Drafter(RuntimeDrafter):
    """An EAGLE-3 drafter for `target`; the interface of drafter.EagleDrafter that
    drafter.EagleProposer drafts with (forward, input_rows, head_input, new_cache, taps)."""

    def __init__(self, target, config: Eagle3Config):
        super().__init__()
        ta = target.args
        if config.target_dim != ta.dim:
            raise DrafterMismatch(f"fuses target states of width {config.target_dim}, the target's are {ta.dim}")
        if len(config.aux_layers) < 1 or any(not 1 <= i <= ta.n_layers for i in config.aux_layers):
            raise DrafterMismatch(f"fuses target layers {list(config.aux_layers)}: this target's hidden "
                                  f"states run from 1 to {ta.n_layers} (0, the embedding, is not read)")
        if not 1 <= config.draft_vocab_size <= ta.vocab_size:
            raise DrafterMismatch(f"draft vocabulary of {config.draft_vocab_size} tokens; the target has "
                                  f"{ta.vocab_size}")
        for name in ("dim", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "n_layers"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DrafterMismatch(f"{name}={value!r}: a positive integer is needed")
        if config.n_heads % config.n_kv_heads:
            raise DrafterMismatch(f"{config.n_heads} attention heads do not share {config.n_kv_heads} "
                                  "key-value heads evenly")
        self.config = config
        self.args = ModelArgs(arch=config.layer_type, vocab_size=config.draft_vocab_size, dim=config.dim,
                              n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
                              head_dim=config.head_dim, intermediate_size=config.intermediate_size,
                              norm_eps=config.norm_eps, rope_base=config.rope_base,
                              rope_scaling=config.rope_scaling, max_seq_len=ta.max_seq_len,
                              qkv_bias=config.attention_bias)
        a, width = self.args, len(config.aux_layers) * ta.dim
        self.input_norm = RMSNorm(width, a.norm_eps) if config.norm_before_fc else None
        self.fc_norms = nn.ModuleList(RMSNorm(ta.dim, a.norm_eps) for _ in config.aux_layers) \
            if config.fc_norm else None
        self.fc = Linear(width, a.dim, bias=config.fc_bias)
        self.embed_norm = RMSNorm(a.dim, a.norm_eps)     # layer 0's input_layernorm
        self.hidden_norm = RMSNorm(a.dim, a.norm_eps)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.n_layers))
        first = self.layers[0]
        first.attn.wqkv = Linear(2 * a.dim, first.attn.wqkv.out_features, bias=config.attention_bias)
        first.attn_norm = nn.Identity()                  # embed_norm and hidden_norm instead
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.lm_head = Linear(a.dim, config.draft_vocab_size, bias=False)
        self.embed = None                                # the checkpoint's, when it has one
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size))   # target id per row
        # The target's taps (native.c: outputs of layers) that hold the fused hidden states;
        # index n_layers is the last layer's output, which the engine always passes.
        self.taps = tuple(sorted({i - 1 for i in config.aux_layers if i < ta.n_layers}))
        self.__dict__["target"] = target                 # shared, never trained
        cos, sin = rope_tables(a.head_dim, a.rope_base, a.max_seq_len + 256, a.rope_scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # How it runs: torch's modules, or packed on the native engine beside its target (`pack`).
        self.__dict__["runtime"] = Eagle3TorchLayers(self)

    # ------------------------------------------------------------ the native engine

    def pack(self, kind: str) -> None:
        """Draft on the native CPU engine beside a target there (as eagle.EagleDrafter.pack):
        fc, the layers and the draft head as `kind` weights (q8i: GGUF's Q8_0 groups beside
        8-bit activations), float32 activations, a native KV cache. What is drafted changes by
        rounding only; verification is untouched."""
        from ...runtime.formats import pack_float

        c, a = self.config, self.args
        if not self.native_fits:
            raise ValueError("EAGLE-3 drafters that norm fc's inputs (fc_norm, norm_before_fc) draft on "
                             "torch's kernels")
        rope = {"global": tuple(t.float().contiguous() for t in
                                rope_tables(a.head_dim, a.rope_base, a.max_seq_len + 256, a.rope_scaling))}
        first = {"attn_norm": self.embed_norm.weight.detach().float().contiguous(),
                 "hidden_norm": self.hidden_norm.weight.detach().float().contiguous(),
                 "norm_residual": c.norm_before_residual}
        pack, stack = self.packed_layers(kind, rope, first)
        fc_bias = None if self.fc.bias is None else self.fc.bias.detach().float()
        embed = None if self.embed is None else pack_float(self.embed.weight, "bf16")
        self.__dict__["runtime"] = Eagle3PackedLayers(self, pack(self._fc_over_rows(), bias=fc_bias), stack, pack, embed)

    @property
    def native_fits(self) -> bool:
        """Whether the native engine can draft with it: not where fc's inputs are normed first
        (speculators' fc_norm, norm_before_fc)."""
        return not (self.config.fc_norm or self.config.norm_before_fc)

    def _fc_over_rows(self) -> torch.Tensor:
        """fc's weight with its inputs in the order the engine passes the target's rows (the
        taps ascending, then the last layer's state), so that the native fc reads them as they
        come; a block that no fused layer reads is zero."""
        dim, order = self.target.args.dim, [t + 1 for t in self.taps] + [self.target.args.n_layers]
        weight = self.fc.weight.detach().float()
        out = torch.zeros(weight.shape[0], len(order) * dim, device=weight.device)
        for k, layer in enumerate(self.config.aux_layers):
            j = order.index(layer)
            out[:, j * dim:(j + 1) * dim] += weight[:, k * dim:(k + 1) * dim]
        return out

    # ------------------------------------------------------------ running

    def embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows of its embedding: the checkpoint's, or the target's table as it is."""
        if self.embed is not None:
            return self.embed(tokens)
        return self.target.embedding_rows(tokens)

    def input_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Fused features from the target's rows at positions it has run: its tapped layer
        outputs side by side (`taps` order), then its last layer's hidden state."""
        return self.runtime.input_rows(rows)

    def torch_input_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """`input_rows` on torch's modules."""
        dim, n = self.target.args.dim, self.target.args.n_layers
        parts = {t + 1: rows[:, k * dim:(k + 1) * dim] for k, t in enumerate(self.taps)}
        parts[n] = rows[:, -dim:]
        dtype = self.fc.weight.dtype
        chunks = [parts[i].to(dtype) for i in self.config.aux_layers]
        if self.fc_norms is not None:
            chunks = [norm(c) for norm, c in zip(self.fc_norms, chunks)]
        x = torch.cat(chunks, dim=-1)
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.fc(x)

    def head_input(self, states: torch.Tensor) -> torch.Tensor:
        """What the draft head scores: the drafter's output through its final norm."""
        return states if self.config.norm_output else self.norm(states)

    def torch_forward(self, tokens, features, positions, cache: KVCache, tree_mask=None):
        """`forward` on torch's modules."""
        dtype = self.fc.weight.dtype
        embeds, features = self.embedding(tokens).to(dtype), features.to(dtype)
        mask = attention_mask(cache, tokens.shape[0], tree_mask, tokens.device)
        cos, sin = self.cos[positions], self.sin[positions]
        first, rest = self.layers[0], self.layers[1:]
        normed = self.hidden_norm(features)
        x = (normed if self.config.norm_before_residual else features) + \
            first.attn(torch.cat([self.embed_norm(embeds), normed], dim=-1), cos, sin, cache, mask, 0)
        x = x + first.mlp(first.mlp_norm(x))
        for layer in rest:
            x = layer(x, cos, sin, cache, mask, 0)
        cache.advance(tokens.shape[0])
        return self.norm(x) if self.config.norm_output else x

    def narrowed(self, spec: str, files: Path | None = None,
                 token_map: str | Path | None = None) -> "Eagle3Drafter":
        """The drafter with the draft vocabulary `spec` (fr:N or trim:N, see `draft_vocab`) as
        its own: the same drafts from a smaller head, to ship or export."""
        from dataclasses import replace

        if self.runtime.packed:
            raise ValueError("narrow a drafter before it drafts natively")
        subset = self.draft_vocab(spec, files, token_map)
        narrow = Eagle3Drafter(self.target, replace(self.config, draft_vocab_size=subset.size))
        # The checkpoint's own embedding (an nn.Embedding set at load, not a parameter the
        # narrow drafter is built with) goes across as the module, not through the state dict.
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("embed.")}
        narrow.load_state_dict(state | {"lm_head.weight": subset.weight, "draft_ids": subset.draft_to_target})
        if self.embed is not None:
            narrow.embed = self.embed
        return narrow.to(self.fc.weight).eval().requires_grad_(False)

    def draft_vocab(self, spec: str, files: Path | None = None, token_map: str | Path | None = None):
        """The draft vocabulary over the drafter's own vocabulary: `full` (all of it), or `fr:N` /
        `trim:N`: the token map's first N tokens that the drafter's vocabulary holds."""
        from ..vocab.draft_vocab import StaticSubset, parse_draft_vocab
        from ..vocab.token_map import load_token_map

        kind, size = parse_draft_vocab(spec)
        rows, ids = self.lm_head.weight, self.draft_ids
        pack = self.runtime.pack_rows       # natively: the rows packed as the layers
        if kind == "full":
            return StaticSubset.of_rows(pack(rows), ids, name=f"eagle3:{ids.numel()}")
        if kind == "spec":
            raise ValueError(f"--draft-vocab {spec}: SpecVocab's ranker scores the target's vocabulary, "
                             "and an EAGLE-3 drafter's head has a draft vocabulary of its own; use full "
                             "(the drafter's), fr:N or trim:N")
        path = Path(token_map) if token_map else (files / f"token_map_{kind}.pt" if files else None)
        if path is None or not path.exists():
            raise ValueError(f"--draft-vocab {spec} needs a token map ({path} does not exist)")
        ranked = load_token_map(path, self.target.args.vocab_size).to(ids.device)
        row_of = torch.full((self.target.args.vocab_size,), -1, dtype=torch.long, device=ids.device)
        row_of[ids] = torch.arange(ids.numel(), device=ids.device)
        keep = row_of[ranked]
        keep = keep[keep >= 0][:size]
        if keep.numel() == 0:
            raise ValueError(f"token map {path} shares no token with the drafter's vocabulary")
        return StaticSubset.of_rows(pack(rows[keep]), ids[keep], name=f"{kind}:{size}")

    # ------------------------------------------------------------ checkpoints

    @classmethod
    def random(cls, target, config: Eagle3Config, seed: int = 0,
               dtype: torch.dtype | None = None) -> "Eagle3Drafter":
        """An untrained drafter (tests); its draft vocabulary: the target's first ids."""
        return randomized(cls(target, config), target, seed, dtype)

    def state_in(self, layout: str) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors in `layout` (speculators or sglang)."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown EAGLE-3 layout {layout!r} (choose from {', '.join(LAYOUTS)})")
        a = self.args
        state = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight}
        if self.fc.bias is not None:
            state["fc.bias"] = self.fc.bias
        if self.input_norm is not None:
            state["input_norm.weight"] = self.input_norm.weight
        if self.fc_norms is not None:
            state.update({f"fc_norm.{i}.weight": n.weight for i, n in enumerate(self.fc_norms)})
        d2t = self.draft_ids - torch.arange(self.draft_ids.numel(), device=self.draft_ids.device)
        t2d = torch.zeros(self.target.args.vocab_size, dtype=torch.bool, device=d2t.device)
        t2d[self.draft_ids] = True
        state.update({"d2t": d2t, "t2d": t2d})
        if self.embed is not None:
            state["embed_tokens.weight"] = self.embed.weight
        for index, layer in enumerate(self.layers):
            prefix = ("midlayer." if index == 0 else f"additional_layers.{index - 1}.") \
                if layout == "sglang" else f"layers.{index}."
            state |= unfused(a, layer, prefix) | {prefix + "mlp.down_proj.weight": layer.mlp.w_down.weight,
                                                  prefix + "self_attn.o_proj.weight": layer.attn.wo.weight,
                                                  prefix + "post_attention_layernorm.weight": layer.mlp_norm.weight}
            if layer.attn.q_norm is not None:
                state |= {prefix + "self_attn.q_norm.weight": layer.attn.q_norm.weight,
                          prefix + "self_attn.k_norm.weight": layer.attn.k_norm.weight}
            if index == 0:
                state |= {prefix + "input_layernorm.weight": self.embed_norm.weight,
                          prefix + "hidden_norm.weight": self.hidden_norm.weight}
            else:     # SGLang's later layers call their input norm hidden_norm
                name = "hidden_norm" if layout == "sglang" else "input_layernorm"
                state[prefix + f"{name}.weight"] = layer.attn_norm.weight
        return state

    def config_in(self, layout: str, extra: dict | None = None) -> dict:
        """config.json in `layout`."""
        c, ta = self.config, self.target.args
        layer = {"architectures": ["LlamaForCausalLM"], "model_type": c.layer_type, "hidden_size": c.dim,
                 "intermediate_size": c.intermediate_size, "num_attention_heads": c.n_heads,
                 "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": c.n_layers,
                 "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_base, "hidden_act": "silu",
                 "attention_bias": c.attention_bias, "vocab_size": ta.vocab_size,
                 "max_position_embeddings": ta.context_length or ta.max_seq_len, "tie_word_embeddings": False}
        if c.rope_scaling is not None:
            layer["rope_scaling"] = {"rope_type" if k == "type" else k: v for k, v in c.rope_scaling.items()}
        if layout == "sglang":
            config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": c.draft_vocab_size,
                      "target_hidden_size": ta.dim, "bias": c.fc_bias,
                      "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layers)}}
        else:
            config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                      "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
                      "target_hidden_size": ta.dim, "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
                      "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc,
                      "fc_norm": c.fc_norm, "norm_output": c.norm_output, "embed_requires_grad": False,
                      "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                             "proposal_methods": [{"proposal_type": "greedy",
                                                                   "speculative_tokens": 3}],
                                             "verifier": {"architectures": [], "name_or_path": None}}}
        if extra:
            config["vocabspec"] = extra
        return config

    def save(self, directory: str | Path, layout: str = "speculators", extra: dict | None = None,
             q8_0: bool = False) -> None:
        """config.json and model.safetensors in `layout`. q8_0: its matrices as GGUF's Q8_0
        groups (`NAME` codes beside `NAME_scale`, as drafter.EagleDrafter.save writes them):
        about half of bfloat16's bytes, for the package's own bundle; vocabspec reads them,
        and `vocabspec export` writes floats for other readers."""
        from safetensors.torch import save_file

        from ...runtime.formats import q8_0_groups

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_in(layout).items()}
        if q8_0:
            for name in [k for k, v in state.items() if v.dim() == 2 and v.shape[1] % 32 == 0
                         and k != "embed_tokens.weight"]:
                state[name], state[name + "_scale"] = q8_0_groups(state[name].float())
        save_file(state, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(self.config_in(layout, extra), indent=2))

    @classmethod
    def load(cls, directory: str | Path, target, dtype: torch.dtype | None = None) -> "Eagle3Drafter":
        """A checkpoint in either layout, for `target`, computing in `dtype` (default: the
        target's, float32 for a quantized one)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        try:
            config = json.loads((directory / "config.json").read_text())
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError("no .safetensors file")
            state = {}
            for path in files:
                state.update(load_file(str(path)))
            state = unpack_q8_0(state)          # a bundle's Q8_0 groups (`save(q8_0=True)`)
        except Exception as exc:
            raise DrafterMismatch(f"EAGLE-3 drafter {directory}: unreadable checkpoint ({exc})") from exc
        state = {k.removeprefix("model."): v for k, v in state.items()}
        try:
            layout, parsed = read_config(config, target)
            drafter = cls(target, parsed)
        except DrafterMismatch as exc:
            raise DrafterMismatch(f"EAGLE-3 drafter {directory}: {exc}") from exc
        mine = drafter.state_in(layout)
        missing = [k for k in mine if k not in state and k not in ("t2d", "embed_tokens.weight")]
        if missing:
            raise DrafterMismatch(f"EAGLE-3 drafter {directory} ({layout} layout): tensors missing: "
                                  f"{', '.join(missing)}")
        unknown = sorted(set(state) - set(mine) - {"embed_tokens.weight", "t2d"})
        if unknown:
            raise DrafterMismatch(f"EAGLE-3 drafter {directory} ({layout} layout): tensors this reader "
                                  f"does not know: {', '.join(unknown[:8])}")
        d2t = state["d2t"]
        if d2t.dim() != 1 or d2t.is_floating_point() or d2t.is_complex():
            raise DrafterMismatch(f"EAGLE-3 drafter {directory}: d2t must be one row of integer offsets, "
                                  f"not {d2t.dtype} of shape {tuple(d2t.shape)}")
        d2t = d2t.long()
        ids = torch.arange(d2t.numel()) + d2t
        if d2t.numel() != parsed.draft_vocab_size or int(ids.min()) < 0 or \
                int(ids.max()) >= target.args.vocab_size or torch.unique(ids).numel() != ids.numel():
            raise DrafterMismatch(f"EAGLE-3 drafter {directory}: d2t does not map its {parsed.draft_vocab_size} "
                                  f"draft ids to distinct ids of the target's {target.args.vocab_size}")
        if "t2d" in state:
            check_t2d(state["t2d"], ids, target.args.vocab_size, directory)
        if "embed_tokens.weight" not in state and parsed.dim != target.args.dim:
            raise DrafterMismatch(f"EAGLE-3 drafter {directory}: hidden_size {parsed.dim} reads the target's "
                                  f"embedding, whose width is {target.args.dim}, and it has none of its own")
        if "embed_tokens.weight" in state:
            table = state["embed_tokens.weight"]
            if tuple(table.shape) != (target.args.vocab_size, parsed.dim):
                raise DrafterMismatch(f"EAGLE-3 drafter {directory}: embed_tokens of shape {tuple(table.shape)}, "
                                      f"the target needs ({target.args.vocab_size}, {parsed.dim})")
            drafter.embed = nn.Embedding(*table.shape)
            mine["embed_tokens.weight"] = drafter.embed.weight
        copy_checkpoint({k: v for k, v in mine.items() if k not in ("d2t", "t2d")}, state,
                        f"EAGLE-3 drafter {directory}")
        drafter.draft_ids.copy_(ids)
        dtype = dtype or (target.dtype if target.dtype in (torch.float32, torch.bfloat16, torch.float16)
                          else torch.float32)
        return drafter.to(device=target.device, dtype=dtype).eval().requires_grad_(False)


class Eagle3TorchLayers(TorchLayers):
    """An EAGLE-3 drafter run by torch's modules."""

    def input_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.drafter.torch_input_rows(rows)

    def pack_rows(self, weight: torch.Tensor):
        return weight


class Eagle3PackedLayers(PackedLayers):
    """An EAGLE-3 drafter packed on the native engine (`Eagle3Drafter.pack`): fc over the
    target's rows in the engine's order, the layers a native stack whose first layer reads the
    embeddings, its head's rows packed as the layers (`pack_rows`), its own embedding packed
    (None: the target's)."""

    def __init__(self, drafter, fc, stack, pack, embed):
        super().__init__(drafter, fc, stack)
        self.pack_rows, self.embed = pack, embed

    def input_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.fc.matmul(rows)

    def forward(self, tokens, features, positions, cache, tree_mask=None):
        d = self.drafter
        x = features.float().contiguous().clone()
        embeds = d.embedding(tokens).float().contiguous()
        self.stack.forward(x, positions, cache.keys, cache.values, cache.length, cache.pending, tree_mask,
                           embeds=embeds)
        cache.advance(tokens.shape[0])
        return d.norm(x) if d.config.norm_output else x

    def native_parts(self) -> dict:
        """Its own embedding (else the target's, unscaled), its final norm on the head's input or
        on its output (`norm_output`), and a first layer that reads the embeddings."""
        d = self.drafter
        norm = d.norm.weight
        return dict(embed=self.embed or d.target.embed_weight, embed_scale=None, norm=None, eps=d.args.norm_eps,
                    fused=True, head_norm=None if d.config.norm_output else norm,
                    out_norm=norm if d.config.norm_output else None)
