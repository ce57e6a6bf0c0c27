"""The EAGLE drafter and the proposer that grows EAGLE-2 dynamic trees with it.

Drafter: fc(concat(token embedding, target feature)) -> one decoder layer of the target's
architecture (EAGLE's; more can be trained) -> a draft LM-head strategy. The embedding is the
target's own (frozen); the drafter keeps its own KV cache of accepted context.

Features follow EAGLE-1/2 (and SGLang): the target's last-layer hidden states after its final
norm, the vectors its LM head multiplies. The drafter input at position i pairs feature f_i
with token t_{i+1} and predicts f_{i+1}, which the head turns into t_{i+2}. Optionally
(`taps`, after EAGLE-3) the outputs of a few lower target layers are fused into f_i wherever
the target has run; draft steps inside the tree read the drafter's own predictions as usual.

The drafter may compute in a narrower dtype than its target (bfloat16 drafting for a float32
target halves the bytes each draft step streams): it only chooses what is drafted, and
verification by the target is untouched, so the output stays the target's own.

Checkpoints use EAGLE's layout: a directory with config.json (num_hidden_layers: 1 for
EAGLE's drafter) and model.safetensors holding fc.weight (+ fc.bias) and layers.N.* in Hugging
Face names; a drafter with taps adds fuse.weight and lists them in config.json.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..vocab.draft_vocab import FullVocab, VocabTimedDrafting
from ...runtime.kv_cache import DeviceKVCache, KVCache
from ...runtime.linear import Linear
from ...runtime.backend import Backend
from ...runtime.model import ARCH_FEATURES, Block, CustomAttention, ModelArgs
from ..proposer import Proposer, GraphDrafting
from ..tree import Tree, TreeBuilder, chain, flatten

_HF_NAMES = {  # our Block's parameter names -> EAGLE / Hugging Face names (q, k, v fused here)
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
}


def _hf_names(arch: str) -> dict[str, str]:
    """_HF_NAMES for one architecture: with sandwich norms (Gemma 3) the norm before the MLP
    has another name."""
    names = dict(_HF_NAMES)
    if ARCH_FEATURES[arch].sandwich_norms:
        names["mlp_norm.weight"] = "pre_feedforward_layernorm.weight"
    return names


HF_CLASSES = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
              "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
              "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}


def hf_config(a: ModelArgs) -> dict:
    """What a Hugging Face config says of the target's architecture and positions: what an
    engine reading a drafter checkpoint sizes its layers and RoPE tables from. The context
    length is the model's, not the window this process allocated."""
    architecture, model_type = HF_CLASSES[a.arch]
    scaling = a.rope_scaling
    if scaling is not None and scaling["type"] == "freqs":
        raise ValueError("the target's RoPE scaling came as a GGUF's rope_freqs table, which a "
                         "Hugging Face config cannot state: load the target from its Hugging Face "
                         "directory to export")
    if scaling is not None:
        scaling = {"rope_type" if k == "type" else k: v for k, v in scaling.items()}
        scaling["type"] = scaling["rope_type"]       # older readers (EAGLE's) look for "type"
    config = {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": a.dim, "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim, "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_base, "rope_scaling": scaling,
        "max_position_embeddings": a.context_length or a.max_seq_len,
        "hidden_act": "gelu_pytorch_tanh" if a.features.gelu else "silu",
        "attention_bias": a.qkv_bias, "tie_word_embeddings": a.tied_embeddings,
    }
    if a.features.query_scalar:
        config["query_pre_attn_scalar"] = a.query_pre_attn_scalar
    return config


def unfused(a: ModelArgs, layer: Block, prefix: str) -> dict[str, torch.Tensor]:
    """A layer's fused q/k/v and gate/up matrices as Hugging Face's separate ones (views), under
    `prefix`."""
    sizes = [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
    state = {}
    for kind in ("weight", "bias") if a.qkv_bias else ("weight",):
        for name, part in zip("qkv", getattr(layer.attn.wqkv, kind).split(sizes)):
            state[prefix + f"self_attn.{name}_proj.{kind}"] = part
    gate, up = layer.mlp.w_gate_up.weight.split(a.intermediate_size)
    return state | {prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up}


class DrafterMismatch(ValueError):
    """A drafter that does not fit its target model."""


def drafter_args(target: ModelArgs, n_layers: int = 1) -> ModelArgs:
    """Global-attention layers of the target's architecture (EAGLE's drafter has one)."""
    return replace(target, n_layers=n_layers, sliding_window=None, layer_types=None)


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.backends.mkldnn.is_available() \
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def draft_dtype(target: Backend, requested: str = "auto") -> torch.dtype:
    """The dtype drafting computes in. "auto": bfloat16 for a float32 target where the hardware
    has fast bfloat16 matmuls (the drafter is memory-bound like decoding, and its draft head
    is the target's head: half the bytes, about half the time), else the target's dtype."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if requested == "auto":
        if target.dtype == torch.float32 and bf16_supported(target.device):
            return torch.bfloat16
        return target.dtype
    if requested not in names:
        raise ValueError(f"unknown draft dtype {requested!r} (choose from auto, float32, bfloat16)")
    return names[requested]


def attention_mask(cache, n: int, tree_mask, device):
    """What n new drafter rows attend to over `cache`: a tree's rows (tree_mask (n, pending +
    n)) the committed slots and their ancestors; accepted rows the context causally; a
    CustomAttention given as `tree_mask` computes its own."""
    if isinstance(cache, DeviceKVCache):
        return cache.begin(n, tree_mask)
    if isinstance(tree_mask, CustomAttention):
        return tree_mask
    if tree_mask is not None:
        return torch.cat([torch.ones(n, cache.length, dtype=torch.bool, device=device), tree_mask], dim=1)
    if n > 1:
        return torch.ones(n, cache.length + n, dtype=torch.bool, device=device).tril(cache.length)
    return None


def randomized(drafter: nn.Module, target: Backend, seed: int, dtype: torch.dtype | None) -> nn.Module:
    """`drafter` untrained: norms at 1, matrices drawn with variance 1 / inputs, the rest 0; on
    the target's device, in `dtype` (default: the target's), frozen."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * p.shape[1] ** -0.5)
            else:
                p.zero_()
    return drafter.to(device=target.device, dtype=dtype or target.dtype).eval().requires_grad_(False)


class RuntimeDrafter(nn.Module):
    """What EAGLE-2's and EAGLE-3's drafters share: their `runtime` (TorchLayers, or a packed
    form on the native engine) runs their layers and holds their caches."""

    def forward(self, tokens, features, positions, cache: KVCache, tree_mask=None):
        """The drafter's states (n, dim) for (token, feature) pairs: what the head scores (after
        `head_input`) and what a draft step below reads as its feature."""
        return self.runtime.forward(tokens, features, positions, cache, tree_mask)

    def packed_layers(self, kind: str, rope: dict, first: dict | None = None):
        """(pack, stack): `packer(kind)` for the drafter's other matrices, and its decoder layers
        as a native stack of `kind` weights over `rope` (`first`: what its first layer reads
        besides, native_stack's)."""
        from ...runtime.formats import block_biases, block_linears
        from ...runtime.native_backend import block_norms, native_stack

        pack = packer(kind, self.target)
        biases = block_biases(self.args, self.layers)
        packed = {name: pack(w, bias=biases.get(name)) for name, w in block_linears(self.args, self.layers).items()}
        return pack, native_stack(self.args, block_norms(self.layers), packed, rope, first)

    def new_cache(self, max_len: int, on_device: bool = False) -> KVCache:
        """A cache for this drafter; on_device: a DeviceKVCache (kv_cache.py) for graph steps."""
        a, w = self.args, self.fc.weight
        if on_device:
            return DeviceKVCache(a.n_layers, a.n_kv_heads, a.head_dim, max_len, w.dtype, w.device)
        return self.runtime.new_cache(a, max_len)


class EagleDrafter(RuntimeDrafter):
    def __init__(self, target: Backend, input_norm: bool = False, taps: tuple[int, ...] = (),
                 n_layers: int = 1):
        super().__init__()
        if n_layers < 1:
            raise DrafterMismatch(f"a drafter needs at least one layer, not {n_layers}")
        self.args = drafter_args(target.args, n_layers)
        dim = self.args.dim
        self.fc = Linear(2 * dim, dim, bias=True)
        # EAGLE-3's fused features: outputs of a few lower target layers (`taps`) join the
        # last-layer feature at positions the target has run; deeper draft steps read the
        # drafter's own predicted feature, as without taps.
        self.taps = checked_taps(taps, target)
        self.fuse = Linear((len(self.taps) + 1) * dim, dim, bias=False) if self.taps else None
        self.layers = nn.ModuleList(Block(self.args, i) for i in range(n_layers))
        # EAGLE-1/2 drafters (and SGLang's LlamaForCausalLMEagle) feed fc's output to attention
        # without the first layer's input norm; keep that unless a checkpoint carries one.
        self.input_norm = input_norm
        if not input_norm:
            self.layers[0].attn_norm = nn.Identity()
        # Shared with the target, never trained: not registered as parameters.
        self.__dict__["target"] = target
        # How it runs: torch's modules, or packed on the native engine beside its target (`pack`).
        self.__dict__["runtime"] = TorchLayers(self)

    def pack(self, kind: str) -> None:
        """Draft on the native CPU engine beside a target there: fc and the layers as `kind`
        weights (bf16 holds a bfloat16 checkpoint exactly; q8i: Q8_0 groups beside 8-bit
        activations), float32 activations, a native KV cache. What is drafted changes by
        rounding only; verification is untouched."""
        if self.fuse is not None:
            raise ValueError("drafters with taps draft on torch's kernels")
        pack, stack = self.packed_layers(kind, self.target.rope)
        self.__dict__["runtime"] = PackedLayers(self, pack(self.fc.weight, bias=self.fc.bias), stack)

    @classmethod
    def random(cls, target: Backend, seed: int = 0, input_norm: bool = False,
               dtype: torch.dtype | None = None, taps: tuple[int, ...] = (),
               n_layers: int = 1) -> "EagleDrafter":
        """An untrained drafter (tests, and measuring the engine's overhead)."""
        return randomized(cls(target, input_norm=input_norm, taps=taps, n_layers=n_layers), target, seed, dtype)

    def add_taps(self, taps: tuple[int, ...]) -> None:
        """Start fusing `taps` into an untapped drafter: the fusion starts as the identity on
        the last-layer feature, so the drafter drafts as before until training moves it."""
        dim = self.args.dim
        weight = self.fc.weight
        self.taps = checked_taps(taps, self.target)
        self.fuse = Linear((len(self.taps) + 1) * dim, dim, bias=False).to(weight)
        with torch.no_grad():
            self.fuse.weight.zero_()
            self.fuse.weight[:, -dim:] = torch.eye(dim, dtype=weight.dtype, device=weight.device)

    def input_features(self, features: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
        """The feature input at positions the target has run: `features` (n, dim) fused with
        the tapped layer outputs (n, len(taps) * dim) when the drafter has taps."""
        if self.fuse is None:
            return features
        if tapped is None:
            raise ValueError("this drafter fuses target layers "
                             f"{self.taps}: their outputs are needed")
        dtype = self.fuse.weight.dtype
        # Parameter-free RMS norm per layer: the residual stream's scale grows with depth and
        # is huge at attention-sink positions (the first token's reaches 1000 in SmolLM2).
        parts = [F.rms_norm(t.float(), (t.shape[-1],), eps=1e-6).to(dtype)
                 for t in tapped.split(self.args.dim, dim=-1)]
        return self.fuse(torch.cat(parts + [features.to(dtype)], dim=-1))

    def input_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The drafter's input features from the target's rows at positions it has run: its
        tapped layer outputs (if any), then its last layer's hidden state."""
        width = self.target.args.dim
        return self.input_features(self.target.norm(rows[:, -width:]), rows[:, :-width] if self.taps else None)

    def head_input(self, states: torch.Tensor) -> torch.Tensor:
        """What the draft head scores: the predicted features themselves (the target's head
        reads features after its final norm)."""
        return states

    def torch_forward(self, tokens, features, positions, cache: KVCache, tree_mask=None):
        """`forward` on torch's modules."""
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([self.target.embed_tokens(tokens).to(dtype), features.to(dtype)], dim=-1))
        cos, sin = self.target.rope["global"]
        mask = attention_mask(cache, tokens.shape[0], tree_mask, tokens.device)
        cos, sin = cos[positions], sin[positions]
        for layer in self.layers:
            x = layer(x, cos, sin, cache, mask, 0)
        cache.advance(tokens.shape[0])
        return x

    def add_layer(self) -> None:
        """Deepen the drafter by one layer that starts as the identity (its attention and MLP
        outputs are zero, so the residual stream passes through): it drafts as before until
        training moves it."""
        layer = Block(drafter_args(self.target.args, len(self.layers) + 1), len(self.layers))
        layer = layer.to(self.fc.weight)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(self.layers[-1].state_dict()[name]
                                if name in self.layers[-1].state_dict() else torch.ones_like(param))
                elif name in ("attn.wo.weight", "mlp.w_down.weight"):
                    param.zero_()
        self.layers.append(layer)
        self.args = drafter_args(self.target.args, len(self.layers))

    # ------------------------------------------------------------ checkpoints

    def save(self, directory: str | Path, extra: dict | None = None, q8_0: bool = False) -> None:
        """config.json and model.safetensors in EAGLE's layout. q8_0: the matrices as GGUF's Q8_0
        groups (an 8-bit code per weight, a float16 scale per 32 inputs: `NAME` and
        `NAME_scale`), as the native engine drafts with them beside 8-bit activations; about half
        of bfloat16's bytes."""
        from safetensors.torch import save_file

        from ...runtime.formats import q8_0_groups

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        a = self.args
        config = {
            **hf_config(a),
            "num_hidden_layers": len(self.layers), "bias": True,
            "vocabspec": {"arch": a.arch, "feature": "post_norm", "taps": list(self.taps),
                          **(extra or {})},
        }
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        state = {}
        for name, tensor in self.eagle_state_dict().items():
            if q8_0 and tensor.dim() == 2 and tensor.shape[1] % 32 == 0:
                state[name], state[name + "_scale"] = q8_0_groups(tensor)
            else:
                state[name] = tensor.to(torch.bfloat16) if q8_0 else tensor
        save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))

    def eagle_state_dict(self) -> dict[str, torch.Tensor]:
        state = {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias}
        if self.fuse is not None:
            state["fuse.weight"] = self.fuse.weight
        a = self.args
        names = _hf_names(a.arch)
        for index, layer in enumerate(self.layers):
            prefix = f"layers.{index}."
            state |= unfused(a, layer, prefix)
            for ours, param in layer.state_dict().items():
                if ours in names:
                    state[prefix + names[ours]] = param
        return state

    @classmethod
    def load(cls, directory: str | Path, target: Backend,
             dtype: torch.dtype | None = None) -> "EagleDrafter":
        """A checkpoint for `target`, computing in `dtype` (default: the target's)."""
        directory, ta = Path(directory), target.args
        config, state = read_checkpoint(directory, "drafter", DrafterMismatch, ta)
        n_layers = config.get("num_hidden_layers", 1)
        if not isinstance(n_layers, int) or not 1 <= n_layers <= ta.n_layers:
            raise DrafterMismatch(f"drafter {directory}: num_hidden_layers={n_layers!r}, need "
                                  f"1 to {ta.n_layers} (the target's depth)")
        arch = config.get("vocabspec", {}).get("arch", "llama")
        if arch != ta.arch:
            raise DrafterMismatch(f"drafter {directory} is for a {arch} target, not {ta.arch}")
        taps = config.get("vocabspec", {}).get("taps", [])
        if not isinstance(taps, list):
            raise DrafterMismatch(f"drafter {directory}: vocabspec.taps={taps!r}, a list of layer indices")
        taps = tuple(taps)
        try:
            drafter = cls(target, input_norm="layers.0.input_layernorm.weight" in state, taps=taps,
                          n_layers=n_layers)
        except DrafterMismatch as exc:
            raise DrafterMismatch(f"drafter {directory}: {exc}") from exc
        # The checkpoint's tensors into the drafter's own, through the views its writer names
        # (eagle_state_dict: q/k/v and gate/up as parts of the fused matrices).
        mine = drafter.eagle_state_dict()
        state.setdefault("fc.bias", torch.zeros(drafter.args.dim))     # EAGLE-1/2 may have none
        missing = [name for name in mine if name not in state]
        if missing:
            raise DrafterMismatch(f"drafter {directory}: tensors missing: {', '.join(missing)}")
        copy_checkpoint(mine, state, f"drafter {directory}: tensor shapes do not fit the target")
        return drafter.to(device=target.device, dtype=dtype or target.dtype).eval().requires_grad_(False)


def read_checkpoint(directory: Path, what: str, error: type, target_args: ModelArgs):
    """(config, tensors) of `directory`'s config.json and model.safetensors (Q8_0 groups as
    floats: unpack_q8_0), refused as `error` naming `what` where either is missing or
    unreadable, or the config's hidden_size or vocab_size is not its target's."""
    from safetensors.torch import load_file

    for name in ("config.json", "model.safetensors"):
        if not (directory / name).exists():
            raise error(f"{what} {directory}: missing {name}")
    try:
        config = json.loads((directory / "config.json").read_text())
        tensors = unpack_q8_0(load_file(str(directory / "model.safetensors")))
    except Exception as exc:
        raise error(f"{what} {directory}: unreadable checkpoint ({exc})") from exc
    for key, want in (("hidden_size", target_args.dim), ("vocab_size", target_args.vocab_size)):
        if config.get(key) != want:
            raise error(f"{what} {directory}: {key}={config.get(key)} but the target model has {want}")
    return config, tensors


def copy_checkpoint(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], where: str) -> None:
    """A checkpoint's `state` into a drafter's `tensors` (views of its own, by the checkpoint's
    names), each of the same shape, else DrafterMismatch (`where`: the message's start)."""
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise DrafterMismatch(f"{where}: {name} has shape {tuple(state[name].shape)}, the config gives "
                                      f"{tuple(tensor.shape)}")
            tensor.copy_(state[name].to(tensor.dtype))


def unpack_q8_0(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with Q8_0 groups (`NAME` codes beside `NAME_scale`, see
    EagleDrafter.save) as float32 matrices; other tensors as they are."""
    from ...runtime.formats import q8_0_float

    out = {}
    for name, tensor in state.items():
        if name.endswith("_scale") and name[:-len("_scale")] in state:
            continue
        scale = state.get(name + "_scale")
        out[name] = q8_0_float(tensor, scale) if scale is not None else tensor
    return out


def checked_taps(taps, target: Backend) -> tuple[int, ...]:
    """`taps` in order, if a drafter for `target` can fuse them."""
    if any(isinstance(t, bool) or not isinstance(t, int) for t in taps):
        raise DrafterMismatch(f"taps {list(taps)}: layer indices are integers")
    taps = tuple(sorted(taps))
    if any(not 0 <= t < target.args.n_layers - 1 for t in taps):
        raise DrafterMismatch(f"taps {list(taps)}: a drafter can fuse layers 0 to "
                              f"{target.args.n_layers - 2} (the last layer's feature is always read)")
    return taps


# ---------------------------------------------------------------- how a drafter runs

def packer(kind: str, target):
    """pack(weight, bias=None) -> a formats.PackedWeight in `kind` (q8i: Q8_0 groups beside
    8-bit activations; bf16 or f32), for a drafter beside `target` on the native engine."""
    from ...runtime.formats import pack_float, quantize_q8

    if target.drafter_format is None:
        raise ValueError(f"a drafter packs its weights to draft beside a target on the native engine; this "
                         f"target runs on {target.runs_on}")
    if kind == "q8i":
        return lambda w, bias=None: quantize_q8(w.float(), bias)
    return lambda w, bias=None: pack_float(w, kind, bias)


class TorchLayers:
    """An EAGLE drafter run by torch's modules (any device, the drafter's dtype)."""

    packed = False

    def __init__(self, drafter):
        self.drafter = drafter

    def forward(self, tokens, features, positions, cache, tree_mask=None):
        return self.drafter.torch_forward(tokens, features, positions, cache, tree_mask)

    def new_cache(self, a: ModelArgs, max_len: int) -> KVCache:
        w = self.drafter.fc.weight
        return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, max_len, w.dtype, w.device)

    def tree_drafting(self, proposer):
        """How `proposer` reads and grows trees with this drafter (its `drafting`)."""
        return TorchEagleDrafting(proposer)


class PackedLayers(TorchLayers):
    """An EAGLE-2 drafter packed on the native engine (`EagleDrafter.pack`): fc a packed
    matrix, the layers a native stack, float32 activations, a native-layout cache."""

    packed = True

    def __init__(self, drafter, fc, stack):
        super().__init__(drafter)
        self.fc, self.stack = fc, stack

    def forward(self, tokens, features, positions, cache, tree_mask=None):
        x = self.fc.matmul(torch.cat([self.drafter.target.embed_tokens(tokens).float(), features.float()], dim=-1))
        self.stack.forward(x, positions, cache.keys, cache.values, cache.length, cache.pending, tree_mask)
        cache.advance(tokens.shape[0])
        return x

    def new_cache(self, a: ModelArgs, max_len: int) -> KVCache:
        return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, max_len, torch.float32, self.drafter.fc.weight.device,
                       layout="native")

    def native_drafter(self, draft_vocab):
        """A NativeDrafter over the packed layers and the head's packed rows (None for a head
        that is not packed, or not of fixed rows), with `native_parts`."""
        from ...runtime.native import NativeDrafter

        ids = packed_vocab_ids(draft_vocab)
        return None if ids is False else NativeDrafter(self.fc, self.stack, draft_vocab.weight, ids,
                                                       **self.native_parts())

    def native_parts(self) -> dict:
        """NativeDrafter's embedding and norms: the target's packed embedding and final norm."""
        t = self.drafter.target
        return dict(embed=t.embed_weight, embed_scale=t.embed_scale, norm=t.norm.weight, eps=t.args.norm_eps)

    def tree_drafting(self, proposer):
        """One native call a read and a tree (NativeEagleDrafting) where its head is packed and a
        level drafts at most 64 children a node; torch's loop over the packed layers elsewhere."""
        calls = self.native_drafter(proposer.draft_vocab) if proposer.top_k <= 64 else None
        return NativeEagleDrafting(proposer, calls) if calls is not None else TorchEagleDrafting(proposer)


# ---------------------------------------------------------------- whole sequences (training)

class _NoCache:
    """Stands in for a KV cache when a whole sequence is processed at once during training."""

    length = 0
    pending = 0

    def write(self, layer, keys, values):
        return keys, values

    def advance(self, n):
        pass


def draft_states(drafter: EagleDrafter, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Drafter states for a whole sequence at once: input i is (token i+1, feature i)."""
    positions = torch.arange(tokens.shape[0] - 1, device=features.device)
    return drafter(tokens[1:], features[:-1], positions, _NoCache())


def features_of(target: Backend, hidden: torch.Tensor) -> torch.Tensor:
    """The drafter's features: stored hidden states through the target's final norm."""
    return target.norm(hidden.float())



def packed_vocab_ids(draft_vocab):
    """The target id of each row of a draft head packed for the native engine (None: the rows
    are the target's whole vocabulary in order); False for a head that is not packed or not of
    fixed rows (SpecVocab's)."""
    from ..vocab.draft_vocab import StaticSubset

    if not isinstance(draft_vocab, (FullVocab, StaticSubset)) or isinstance(draft_vocab.weight, torch.Tensor):
        return False
    return draft_vocab.draft_to_target if isinstance(draft_vocab, StaticSubset) else None


def drafts_in_graphs(draft_vocab) -> bool:
    """Whether EAGLE-2 with this draft vocabulary can run as graph steps (graph_step.py): not with
    SpecVocab, whose candidates need the drafted tokens on the host."""
    return not hasattr(draft_vocab, "candidate_ids")


class EagleProposer(VocabTimedDrafting, Proposer):
    """Grows an EAGLE-2 dynamic draft tree from the drafter's view of the accepted context,
    through its backend: the native engine's one-call reads and trees where the drafter and its
    head run there (`NativeEagleDrafting`), else torch's (`TorchEagleDrafting`); graph steps
    draft through `graph_form`'s `EagleGraphDrafting`. Timings (`time_breakdown`): the decoder
    layer with fc ("layer"), the head's matmuls, softmax and top-k, ranker (SpecVocab), and tree
    bookkeeping (the rest).

    The drafter reads accepted tokens when it next drafts, all since its last tree in one read
    (or every READ_AFTER tokens): in a full batch most steps draft nothing, and a read a step
    per request cost as much as a tenth of the step. On the native engine a row's state does
    not depend on how many rows a read holds, so the trees are the same either way.

    Where the live rule is dormant (drafting has not paid for long, live_tree.py) the drafter
    reads only the last DORMANT_CONTEXT tokens of a prompt and before each probe: its context
    is then that tail (its positions follow its own cache), which costs a probe some accepted
    tokens and spares every other step the drafter's read. Greedy output is the same either
    way; a sampled request (no live rule) always reads everything."""

    phases = ("layer", "native")
    READ_AFTER = 64
    DORMANT_CONTEXT = 32

    def __init__(self, drafter: EagleDrafter, draft_vocab=None, depth: int = 6, top_k: int = 10,
                 total_tokens: int = 60):
        if depth < 0 or top_k < 1 or total_tokens < 1:
            raise ValueError(f"need depth >= 0, top_k >= 1, total_tokens >= 1; got "
                             f"{depth}, {top_k}, {total_tokens}")
        self.drafter = drafter
        self.target = drafter.target
        self.draft_vocab = draft_vocab or FullVocab(self.target.head_weight.to(drafter.fc.weight.dtype))
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.max_tree_tokens = total_tokens
        self.cache = drafter.new_cache(self.target.args.max_seq_len + depth * top_k + 1)
        self._host_cache = self.cache
        self._graph_forms: dict[int, EagleGraphDrafting] = {}    # by target cache size
        self._state_buffer = None        # graph steps: last_state, updated in place
        self.taps = drafter.taps        # the engine then passes these layers' outputs too
        self._last_state = None
        self._unread: list[tuple[list[int], torch.Tensor]] = []   # accepted, not yet read
        self.device = self.target.device
        self.drafting = drafter.runtime.tree_drafting(self)
        self.reset_timings()

    @property
    def tree_shape(self) -> tuple[int, int]:
        return self.depth, self.total_tokens

    def draft_parameters(self) -> int:
        """The drafter's layer(s) and fc, the draft head's rows, and a ranker if any."""
        layer = sum(p.numel() for p in self.drafter.parameters())
        extra = self.draft_vocab.down.numel() + self.draft_vocab.vocab_t.numel() if hasattr(self.draft_vocab, "down") else 0
        return layer + self.draft_vocab.size * self.target.args.dim + extra

    def step_layer(self, *args, **kwargs) -> torch.Tensor:
        start = time.perf_counter()
        out = self.drafter(*args, **kwargs)
        if self.draft_vocab.sync:
            torch.cuda.synchronize()
        self.timings["layer"] += time.perf_counter() - start
        return out

    def read_forward(self, tokens: list[int], features: torch.Tensor, timed: bool = True) -> torch.Tensor:
        device = self.target.device
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        positions = torch.arange(len(tokens), device=device) + self.cache.length
        out = (self.step_layer if timed else self.drafter)(ids, features, positions, self.cache)
        self.cache.commit()
        return out

    @property
    def last_state(self) -> torch.Tensor:
        """The drafter's state after the last accepted token (read now if it was waiting)."""
        self.read_pending()
        return self._last_state

    @last_state.setter
    def last_state(self, state: torch.Tensor) -> None:
        self._last_state = state

    def read_pending(self) -> None:
        if self._unread:
            tokens = [t for read, _ in self._unread for t in read]
            rows = torch.cat([rows for _, rows in self._unread]) if len(self._unread) > 1 else self._unread[0][1]
            self._unread, self._unread_tokens = [], 0
            self.drafting.read(tokens, rows)

    def reset(self, prompt_ids: list[int], prompt_hidden: torch.Tensor, first_token: int) -> None:
        if self.sizing is not None:
            self.sizing.start()
        self._unread, self._unread_tokens = [], 0
        self.cache.reset()
        self.draft_vocab.see_tokens(prompt_ids + [first_token], reset=True)
        # Not timed: the pass over the prompt belongs with the prefill, outside the drafting
        # time ("total") that the breakdown's parts must add up to.
        read, rows = prompt_ids[1:] + [first_token], prompt_hidden
        if self._dormant():
            read, rows = read[-self.DORMANT_CONTEXT:], rows[-self.DORMANT_CONTEXT:]
        self.drafting.read(read, rows, timed=False)
        if self.cache is not self._host_cache:     # a captured step reads this very tensor
            if self._state_buffer is None:
                self._state_buffer = torch.empty_like(self.last_state)
            self.last_state = self._state_buffer.copy_(self.last_state)

    def observe(self, accepted: list[int], hidden: torch.Tensor | None, next_token: int) -> None:
        start = time.perf_counter()
        if self.live_sizing() is not None:
            self.sizing.observe(accepted)
        self.draft_vocab.see_tokens(accepted + [next_token])
        if hidden is None:      # rows it did not ask for (`reads_rows`): its context restarts after them
            self._unread, self._unread_tokens = [], 0
        else:
            self._unread.append((accepted[1:] + [next_token], hidden))
            self._unread_tokens += len(accepted)
            if self._dormant():
                self._forget_unread_beyond(self.DORMANT_CONTEXT)
            if self._unread_tokens >= self.READ_AFTER:
                self.read_pending()
        self.timings["total"] += time.perf_counter() - start

    def reads_rows(self) -> bool:
        """Every step's, but where dormant: then the last DORMANT_CONTEXT before a probe only."""
        if not self._dormant():
            return True
        return self.sizing.plain_steps + self.DORMANT_CONTEXT >= self.sizing.probe_every

    def _dormant(self) -> bool:
        live = self.live_sizing()
        return live is not None and live.dormant

    def _forget_unread_beyond(self, keep: int) -> None:
        """Keep only the last `keep` unread tokens (and their rows)."""
        excess = self._unread_tokens - keep
        while excess > 0:
            read, rows = self._unread[0]
            if len(read) <= excess:
                self._unread.pop(0)
                excess -= len(read)
                self._unread_tokens -= len(read)
            else:
                self._unread[0] = (read[excess:], rows[excess:])
                self._unread_tokens -= excess
                excess = 0

    def features(self, rows: torch.Tensor) -> torch.Tensor:
        """The drafter's input features from the target's rows (see generate.Proposer)."""
        return self.drafter.input_rows(rows)

    def top_tokens(self, states: torch.Tensor, tokens: list[int], level: int):
        """Each row's top tokens; `tokens`: the token each row has just read, `level`: the
        rows' tree level (0: the root)."""
        return self.draft_vocab.top_k(self.drafter.head_input(states), self.top_k, tokens, level)

    def propose(self, root_token: int) -> Tree:
        start = time.perf_counter()
        sizing = self.live_sizing()
        if sizing is None:
            tree = self.drafting.grow(root_token, self.depth, self.total_tokens)
        else:
            depth, total = sizing.plan()
            if depth:
                tokens = sum(len(read) for read, _ in self._unread)
                self.read_pending()             # timed apart: see live_tree.LiveSizing.choose
                grown = time.perf_counter()
                tree = self.drafting.grow(root_token, depth, total, sizing.stop)
                tree = sizing.choose(tree, sizing.stop.levels, time.perf_counter() - grown, grown - start, tokens, start)
            else:
                tree = chain(root_token, [], device=self.target.device)
        self.timings["total"] += time.perf_counter() - start
        return tree

    @property
    def graphs(self) -> bool:
        """Whether its graph form can draft without reading the device back."""
        return drafts_in_graphs(self.draft_vocab)

    def graph_form(self, max_len: int | None) -> "EagleGraphDrafting | None":
        self.read_pending()             # into the cache it was meant for
        if max_len is None:
            self.cache = self._host_cache
            return None
        if self.drafter.runtime.packed:
            raise ValueError("graph steps run on torch's kernels: this drafter drafts natively")
        if max_len not in self._graph_forms:
            cache = self.drafter.new_cache(max_len + self.depth * self.top_k + 1, on_device=True)
            self._graph_forms[max_len] = EagleGraphDrafting(self, cache)
        form = self._graph_forms[max_len]
        self.cache = form.cache
        return form


class TorchEagleDrafting:
    """EAGLE-2 on torch's kernels, any device: the drafter reads the committed tokens in one
    forward, and grows the tree level by level from Python (`TreeBuilder`)."""

    def __init__(self, proposer: EagleProposer):
        self.proposer = proposer

    def read(self, tokens: list[int], hidden: torch.Tensor, timed: bool = True) -> None:
        p = self.proposer
        p.last_state = p.read_forward(tokens, p.features(hidden), timed)[-1:]

    def grow(self, root_token: int, depth: int, total_tokens: int, stop=None) -> Tree:
        """EAGLE-2's tree (the native drafter's `vs_eagle_tree` follows it node for node);
        `stop`: where it may stop growing (TreeBuilder.grow)."""
        p = self.proposer
        p.read_pending()                 # the accepted tokens since the last tree, first
        builder = TreeBuilder(root_token, p.top_k, total_tokens)
        tokens, log_probs = p.top_tokens(p.last_state, [root_token], 0)
        builder.add_children([0], tokens, log_probs)
        # Each expanded node's drafter state feeds its children; its pending KV slot lets
        # descendants attend to it.
        state_of = {0: p.last_state[0]}
        base = p.cache.length
        device = p.target.device

        def expand(level, frontier, mask):
            read = [builder.token[n] for n in frontier]
            ids = torch.tensor(read, dtype=torch.long, device=device)
            features = torch.stack([state_of[builder.parent[n]] for n in frontier])
            positions = torch.tensor([base - 1 + builder.depth[n] for n in frontier], device=device)
            states = p.step_layer(ids, features, positions, p.cache, tree_mask=mask)
            state_of.update(zip(frontier, states))
            return p.top_tokens(states, read, level)

        builder.grow(depth, expand, lambda: p.cache.pending, device, stop)
        p.cache.discard()
        return builder.build(device)


class NativeEagleDrafting:
    """EAGLE-2 on the native engine: a read of committed tokens and a whole tree are one native
    call each (native.NativeDrafter), over the proposer's cache."""

    def __init__(self, proposer: EagleProposer, native):
        self.proposer, self.native = proposer, native

    def read(self, tokens: list[int], hidden: torch.Tensor, timed: bool = True) -> None:
        p, start = self.proposer, time.perf_counter()
        cache = p.cache
        self.native.read(cache.keys, cache.values, cache.length, tokens, hidden)
        cache.length += len(tokens)
        cache.pending = 0
        p.last_state = self.native.state[None]
        if timed:
            p.timings["native"] += time.perf_counter() - start

    def grow(self, root_token: int, depth: int, total_tokens: int, stop=None) -> Tree:
        self.proposer.read_pending()     # the accepted tokens since the last tree, first
        p, start = self.proposer, time.perf_counter()
        cache = p.cache
        tokens, parents, ranks, values = self.native.tree(cache.keys, cache.values, cache.length, root_token,
                                                          p.top_k, depth, total_tokens, stop)
        p.timings["native"] += time.perf_counter() - start
        return Tree.from_parents(tokens, parents, ranks, values, p.target.device)


def graph_tree_rows(depth: int, top_k: int, total_tokens: int) -> int:
    """Rows of EAGLE-2's graph tree, the root included: the kept nodes, at most what `top_k`
    rows a level draft."""
    return min(total_tokens, top_k + depth * top_k * top_k) + 1


class EagleGraphDrafting(GraphDrafting):
    """EAGLE-2 in graph steps (graph_step.py): the drafter's cache on the device, its reads
    and its tree as device work of fixed shapes; the proposer's head, drafter and state."""

    def __init__(self, proposer: EagleProposer, cache: DeviceKVCache):
        self.proposer, self.cache = proposer, cache

    @property
    def rows(self) -> int:
        p = self.proposer
        return graph_tree_rows(p.depth, p.top_k, p.total_tokens)

    def buffers(self) -> list[torch.Tensor]:
        return [self.cache.length, self.proposer.last_state]

    def observe(self, reads: torch.Tensor, rows: torch.Tensor, count: torch.Tensor) -> None:
        """The drafter reads the step's accepted tokens; all m rows run, those past `count`
        are left past the committed slots."""
        cache, p = self.cache, self.proposer
        positions = torch.arange(reads.numel(), device=reads.device) + cache.length
        states = p.drafter(reads, p.features(rows), positions, cache)
        cache.keep(torch.arange(reads.numel(), device=reads.device), count)
        p.last_state.copy_(states.index_select(0, (count - 1).view(1)))

    def after(self, accepted: list[int], next_token: int, length: int) -> None:
        self.proposer.draft_vocab.see_tokens(accepted + [next_token])
        self.cache.settle(length)

    def propose(self, root: torch.Tensor) -> Tree:
        """EAGLE-2's tree with fixed shapes and no read-back: `top_k` rows a level, no frontier
        pruning, the same kept nodes as the proposer's `propose`."""
        p, cache = self.proposer, self.cache
        start = time.perf_counter()
        k, device = p.top_k, p.target.device
        ids, log_probs = p.top_tokens(p.last_state, None, 0)
        tokens, values = [ids[0]], [log_probs[0]]
        parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
        depths = [torch.ones(k, dtype=torch.long, device=device)]
        front = torch.argsort(-log_probs[0], stable=True)          # node indices, best first
        front_values = log_probs[0][front]
        features = p.last_state.expand(k, -1)
        visible = torch.zeros(k, 0, dtype=torch.bool, device=device)   # earlier levels' slots
        eye = torch.eye(k, dtype=torch.bool, device=device)
        drafted = k
        for level in range(1, p.depth + 1):
            read = torch.cat(tokens)[front]
            positions = torch.full((k,), level - 1, dtype=torch.long, device=device) + cache.length
            states = p.step_layer(read, features, positions, cache, tree_mask=torch.cat([visible, eye], dim=1))
            ids, log_probs = p.top_tokens(states, None, level)            # (k, k)
            layer_values = (front_values[:, None] + log_probs).flatten()
            tokens.append(ids.flatten())
            values.append(layer_values)
            parents.append(front[:, None].expand(-1, k).flatten())     # each frontier node k times
            depths.append(torch.full((k * k,), level + 1, dtype=torch.long, device=device))
            # The next frontier: the level's k most valuable nodes (ties: drafted earlier).
            order = torch.argsort(-layer_values, stable=True)[:k]
            rows = order // k
            front, front_values = drafted + order, layer_values[order]
            features, visible = states[rows], torch.cat([visible[rows], eye[rows]], dim=1)
            drafted += k * k
        cache.discard()
        tree = flatten(root, torch.cat(tokens), torch.cat(values), torch.cat(parents),
                       torch.cat(depths), self.rows - 1, p.depth + 1)
        p.timings["total"] += time.perf_counter() - start
        return tree
