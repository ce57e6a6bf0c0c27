"""GGUF files of real models' shapes with random weights, for measuring and testing at real sizes.

No model larger than the bundled 270M ships in a package, and speed, memory and exactness do
not depend on the weights' values. So this writes a model file of a real model's shape (Llama
3.2 1B and 3B, Llama 3.1 8B, Qwen2.5 7B, or any shape given), every matrix in the GGUF type
that llama-quantize's mix gives it (Q4_K_M, Q5_K_M, Q8_0, ...; the rules of llama.cpp's
`llama_tensor_get_type`), with random blocks that are valid (finite float16 scales of a sane
size, random codes), and the real tokenizer of the family copied from llama.cpp's vocab-only
files (`models/ggml-vocab-*.gguf` in the llama.cpp source the llama-cpp-python sdist vendors,
unpacked by ../shared/tools/build-llamacpp under ~/.lcpp).

    python scripts/gguf_shapes.py --shape llama-3.1-8b --mix Q4_K_M --out /tmp/llama8b-q4km.gguf
    python scripts/gguf_shapes.py --shape tiny --mix every --layers 2 --out /tmp/every.gguf

`--layers N` keeps the real widths with fewer layers (tests); `--mix every` gives the layers'
matrices every type the engine runs, in turn, so one small file covers them all. Its files
are never committed: they are made where they are used.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

LCPP_MODELS = Path(os.environ.get("LCPP_DIR", Path.home() / ".lcpp")) / "llama_cpp_python-0.3.36" / \
    "vendor" / "llama.cpp" / "models"


@dataclass(frozen=True)
class Shape:
    arch: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    tied: bool
    rope_base: float
    vocab_file: str           # llama.cpp's vocab-only file of the family
    qkv_bias: bool = False
    llama3_rope: bool = False  # Llama 3.1+'s rope_freqs
    context: int = 131072


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, "llama-bpe", llama3_rope=True),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0, "llama-bpe", llama3_rope=True),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, "llama-bpe", llama3_rope=True),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, False, 1000000.0, "qwen2", qkv_bias=True,
                        context=32768),
    # Small widths, Llama 3's tokenizer: tests of every type, fast.
    "tiny": Shape("llama", 256, 2, 4, 2, 64, 512, 128256, True, 500000.0, "llama-bpe", llama3_rope=True, context=4096),
}

# GGUF types: (block inputs, block bytes, byte offsets of the float16 scales in a block).
BLOCKS = {
    "Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)),
    "Q8_0": (32, 34, (0,)), "Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)),
    "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)),
    "IQ4_NL": (32, 18, (0,)), "IQ4_XS": (256, 136, (0,)),
}
# A scale's size per type, so that weights come out about N(0, 0.02)-sized: larger codes, smaller d.
SCALE = {"Q4_0": 5e-3, "Q4_1": 3e-3, "Q5_0": 2.5e-3, "Q5_1": 1.5e-3, "Q8_0": 3e-4, "Q2_K": 1e-3, "Q3_K": 4e-4,
         "Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 2e-5, "IQ4_NL": 3e-4, "IQ4_XS": 1e-5}
FILE_TYPES = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12,
              "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "every": 0}
EVERY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def more_bits(i: int, n: int) -> bool:
    """llama-quantize's layers that get a larger type in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(mix: str, name: str, layer: int, layers: int, tied: bool, index: int) -> str:
    """The GGUF type llama-quantize gives tensor `name` (of `layer`) in `mix` (Q4_K_M etc., a
    single type, or `every`: the matrices of the model take every type in turn, by `index`)."""
    if mix == "every":
        if name in ("output", "token_embd"):
            return "Q6_K" if name == "output" or tied else "Q4_K"
        return EVERY[index % len(EVERY)]
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q3_K_M": "Q3_K"}.get(mix, mix)
    if name == "output" or (tied and name == "token_embd"):
        return base if base == "Q8_0" else "Q6_K"
    if name == "token_embd":
        return base
    if mix in ("Q4_K_M", "Q5_K_M") and name in ("attn_v", "ffn_down") and more_bits(layer, layers):
        return "Q6_K"
    return base


def random_blocks(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """Random valid blocks of a (rows, cols) matrix of GGUF type `kind`: (rows, row bytes) uint8."""
    inputs, size, halves = BLOCKS[kind]
    if cols % inputs:
        raise ValueError(f"{kind} needs a multiple of {inputs} columns, not {cols}")
    blocks = np.frombuffer(rng.bytes(rows * cols // inputs * size), dtype=np.uint8).reshape(rows, -1, size).copy()
    scale = SCALE[kind]
    for offset in halves:
        d = (rng.random(blocks.shape[:2], dtype=np.float32) * 1.5 + 0.5) * scale
        blocks[..., offset:offset + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """Llama 3.1's rope_freqs (what llama.cpp's converter writes): each frequency's divisor."""
    factor, low, high, old = 8.0, 1.0, 4.0, 8192
    freqs = 1.0 / shape.rope_base ** (np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def copy_tokenizer(writer, vocab_file: Path, vocab: int) -> None:
    """The vocab file's tokenizer.* keys, its tokens padded with unused ones to `vocab` rows (as
    llama.cpp's converter pads Qwen2.5's)."""
    import gguf

    reader = gguf.GGUFReader(str(vocab_file))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        if key == "tokenizer.ggml.tokens":
            value = list(value) + [f"[PAD{i}]" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        elif key == "tokenizer.ggml.scores":
            value = list(value) + [0.0] * (vocab - len(value))
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, kind)


def tensors(shape: Shape, mix: str):
    """(name, numpy shape (rows, cols), GGUF type) of every tensor, in llama.cpp's order."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (shape.vocab, shape.dim), tensor_type(mix, "token_embd", 0, shape.layers,
                                                                       shape.tied, 0))]
    if shape.llama3_rope:
        out.append(("rope_freqs.weight", (shape.head_dim // 2,), "F32"))
    index = 0
    for i in range(shape.layers):
        dims = {"attn_q": (q, shape.dim), "attn_k": (kv, shape.dim), "attn_v": (kv, shape.dim),
                "attn_output": (shape.dim, q), "ffn_gate": (shape.hidden, shape.dim),
                "ffn_up": (shape.hidden, shape.dim), "ffn_down": (shape.dim, shape.hidden)}
        out.append((f"blk.{i}.attn_norm.weight", (shape.dim,), "F32"))
        for name in MATRICES:
            out.append((f"blk.{i}.{name}.weight", dims[name], tensor_type(mix, name, i, shape.layers, shape.tied, index)))
            index += 1
            if shape.qkv_bias and name in ("attn_q", "attn_k", "attn_v"):
                out.append((f"blk.{i}.{name}.bias", (dims[name][0],), "F32"))
        out.append((f"blk.{i}.ffn_norm.weight", (shape.dim,), "F32"))
    out.append(("output_norm.weight", (shape.dim,), "F32"))
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, shape.dim), tensor_type(mix, "output", 0, shape.layers, False, 0)))
    return out


def tensor_data(rng: np.random.Generator, name: str, dims: tuple, kind: str, shape: Shape) -> np.ndarray:
    if kind != "F32":
        return random_blocks(rng, kind, *dims)
    if name == "rope_freqs.weight":
        return llama3_rope_factors(shape)
    if name.endswith(".bias"):
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)
    return (1.0 + rng.standard_normal(dims, dtype=np.float32) * 0.05).astype(np.float32)   # a norm


def write(path: Path, shape: Shape, mix: str, seed: int = 0, progress=None, vocab_dir: Path = LCPP_MODELS) -> Path:
    """Write the model file; returns its path. `progress(done, total)` hears each tensor;
    `vocab_dir`: where llama.cpp's vocab files are."""
    import gguf

    vocab_file = Path(vocab_dir) / f"ggml-vocab-{shape.vocab_file}.gguf"
    if not vocab_file.exists():
        raise FileNotFoundError(f"{vocab_file}: llama.cpp's vocab files are unpacked by "
                                "../shared/tools/build-llamacpp (the llama-cpp-python 0.3.36 sdist)")
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    arch = shape.arch
    writer.add_name(f"random {arch} {shape.dim}x{shape.layers} {mix}")
    writer.add_uint32(f"{arch}.block_count", shape.layers)
    writer.add_uint32(f"{arch}.context_length", shape.context)
    writer.add_uint32(f"{arch}.embedding_length", shape.dim)
    writer.add_uint32(f"{arch}.feed_forward_length", shape.hidden)
    writer.add_uint32(f"{arch}.attention.head_count", shape.heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", shape.kv_heads)
    writer.add_uint32(f"{arch}.attention.key_length", shape.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", shape.head_dim)
    writer.add_uint32(f"{arch}.rope.dimension_count", shape.head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", shape.rope_base)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5 if arch == "llama" else 1e-6)
    writer.add_uint32(f"{arch}.vocab_size", shape.vocab)
    writer.add_uint32("general.file_type", FILE_TYPES.get(mix, 0))
    writer.add_uint32("general.quantization_version", 2)
    copy_tokenizer(writer, vocab_file, shape.vocab)
    items = tensors(shape, mix)
    for name, dims, kind in items:
        if kind == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            inputs, size, _ = BLOCKS[kind]
            byte_shape = (dims[0], dims[1] // inputs * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                                   raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for done, (name, dims, kind) in enumerate(items):
        writer.write_tensor_data(tensor_data(rng, name, dims, kind, shape))
        if progress is not None:
            progress(done + 1, len(items))
    writer.close()
    os.replace(tmp, path)
    return path


def made(shape_name: str, mix: str, directory: Path, layers: int | None = None, seed: int = 0,
         vocab_dir: Path = LCPP_MODELS) -> Path:
    """The file of this shape and mix under `directory`, written once (tests and benchmarks)."""
    shape = SHAPES[shape_name]
    if layers is not None:
        shape = replace(shape, layers=layers)
    path = directory / f"{shape_name}-{shape.layers}l-{mix}-s{seed}.gguf"
    if not path.exists():
        write(path, shape, mix, seed, vocab_dir=vocab_dir)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--mix", default="Q4_K_M", choices=sorted(set(FILE_TYPES) | set(BLOCKS)),
                        help="llama-quantize's mix (Q4_K_M, Q5_K_M, ...), one type, or `every`")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers of the real widths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape] if args.layers is None else replace(SHAPES[args.shape], layers=args.layers)

    def progress(done, total):
        print(f"\r[{done}/{total} tensors]", end="", file=sys.stderr, flush=True)

    write(args.out, shape, args.mix, args.seed, progress)
    print(f"\n{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
