"""llama.cpp's own tokenizer test files and chat templates, and tiny random models around them.

They are the `models/` folder of the llama.cpp source that the llama-cpp-python 0.3.36 sdist
vendors: `ggml-vocab-NAME.gguf` (vocabulary-only files) with `.gguf.inp` strings and
`.gguf.out` ids (llama.cpp's tests/test-tokenizer-0), and `templates/*.jinja`, real models'
chat templates. The first test that needs them fetches them from PyPI
(`scripts/fetch_llamacpp_models.sh`, into ~/.lcpp, where scripts/build_llamacpp.sh unpacks the
whole source); VOCABSPEC_LLAMACPP_MODELS names another folder. Where they cannot be had (no
network), the tests that read them are skipped, unless VOCABSPEC_REQUIRE_LLAMACPP=1 (CI sets
it): then they fail.
"""

import fcntl
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

VERSION = "0.3.36"
DEFAULT = Path.home() / ".lcpp" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp" / "models"
SEPARATOR = "\n__ggml_vocab_test__\n"


FETCH = Path(__file__).resolve().parents[1] / "scripts" / "fetch_llamacpp_models.sh"


def _present(path: Path) -> bool:
    return (path / "ggml-vocab-llama-spm.gguf.out").is_file() and (path / "templates").is_dir()


def models_dir() -> Path:
    named = os.environ.get("VOCABSPEC_LLAMACPP_MODELS")
    path = Path(named) if named else DEFAULT
    if not _present(path) and not named:
        # One fetch for every test worker: the others wait on the lock, then find the folder.
        DEFAULT.parents[3].mkdir(parents=True, exist_ok=True)
        with open(DEFAULT.parents[3] / ".fetch.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _present(path):
                subprocess.run(["bash", str(FETCH)], capture_output=True, text=True, timeout=600)
    if _present(path):
        return path
    message = f"llama.cpp's models folder is not at {path} (bash scripts/fetch_llamacpp_models.sh)"
    if named or os.environ.get("VOCABSPEC_REQUIRE_LLAMACPP") == "1":
        pytest.fail(message)
    pytest.skip(message)


def vocab_file(name: str) -> Path:
    return models_dir() / f"ggml-vocab-{name}.gguf"


def template(name: str) -> str:
    return (models_dir() / "templates" / name).read_text(encoding="utf-8")


def vectors(name: str) -> dict[str, list[int]]:
    """test-tokenizer-0's cases for a vocabulary: each string (split at the separator line, as
    its read_tests does; a repeated string keeps its last ids) -> llama.cpp's ids."""
    raw = (models_dir() / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8", errors="strict")
    strings, pos = [], 0
    while pos < len(raw):
        end = raw.find(SEPARATOR, pos)
        if end < 0:
            strings.append(raw[pos:])
            break
        strings.append(raw[pos:end])
        pos = end + len(SEPARATOR)
    lines = (models_dir() / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    assert len(lines) >= len(strings), name
    return {s: [int(t) for t in line.split()] for s, line in zip(strings, lines)}


# ---------------------------------------------------------------- tiny models around real vocabularies

def write_tiny_gguf(path: Path, vocab: Path, arch: str, chat_template: str | None = None, seed: int = 0) -> Path:
    """A one-layer random model of `arch` (64 wide, two heads of 32) whose tokenizer keys are
    the vocabulary file's own, its embedding one row a token; `chat_template` replaces the
    file's template where given."""
    import gguf
    from vocabspec.runtime.vocab import read_metadata

    meta = read_metadata(vocab)
    n = len(meta["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(str(path), arch)
    dim, heads, head_dim, hidden = 64, 2, 32, 64
    writer.add_context_length(512)
    writer.add_embedding_length(dim)
    writer.add_block_count(1)
    writer.add_feed_forward_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    for key, value in meta.items():
        if key.startswith("tokenizer.") and not (chat_template and key == "tokenizer.chat_template"):
            _copy_key(writer, key, value)
    if chat_template:
        writer.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)

    def add(name, *shape, ones=False):
        writer.add_tensor(name, np.ones(shape, np.float32) if ones else
                          (rng.standard_normal(shape) * 0.05).astype(np.float32))

    add("token_embd.weight", n, dim)
    add("output_norm.weight", dim, ones=True)
    p = "blk.0."
    for name, shape in (("attn_q", (heads * head_dim, dim)), ("attn_k", (heads * head_dim, dim)),
                        ("attn_v", (heads * head_dim, dim)), ("attn_output", (dim, heads * head_dim)),
                        ("ffn_gate", (hidden, dim)), ("ffn_up", (hidden, dim)), ("ffn_down", (dim, hidden))):
        add(p + name + ".weight", *shape)
    for name in ("attn_norm", "ffn_norm") + (("post_attention_norm", "post_ffw_norm") if arch == "gemma3" else ()):
        add(p + name + ".weight", dim, ones=True)
    if arch in ("qwen3", "gemma3"):
        add(p + "attn_q_norm.weight", head_dim, ones=True)
        add(p + "attn_k_norm.weight", head_dim, ones=True)
    if arch == "qwen2":
        for name in ("attn_q", "attn_k", "attn_v"):
            add(p + name + ".bias", heads * head_dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _copy_key(writer, key: str, value) -> None:
    import gguf

    kinds = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_key_value(key, value, kinds.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, kinds.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, kinds.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, kinds.STRING)
    elif isinstance(value, list):
        writer.add_key_value(key, value, kinds.ARRAY, sub_type=kinds.STRING)
    else:
        sub = {np.dtype("<i4"): kinds.INT32, np.dtype("<f4"): kinds.FLOAT32, np.dtype("<u4"): kinds.UINT32,
               np.dtype("<u1"): kinds.UINT8, np.dtype("<i1"): kinds.INT8}[value.dtype]
        writer.add_key_value(key, value.tolist(), kinds.ARRAY, sub_type=sub)
