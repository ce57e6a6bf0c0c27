"""A Hugging Face model directory's tokenizer, in the form a GGUF vocabulary takes here.

transformers reads the directory (tokenizer.json, or a SentencePiece model it converts); its
added tokens become the special tokens (special ones control tokens, the others
user-defined, each with its own lstrip and rstrip), and its pipeline, without them and
without its post-processor, tokenizes the text between. Encoding, decoding and chat then work
as for a GGUF file (tokenizer.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .loading import ModelLoadError
from .vocab import (ATTR_BYTE, ATTR_CONTROL, ATTR_LSTRIP, ATTR_NORMAL, ATTR_RSTRIP,
                    ATTR_USER_DEFINED)

BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def convert_hf_directory(path: Path) -> tuple[str, dict]:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        hf = AutoTokenizer.from_pretrained(str(path))
        data = json.loads(hf.backend_tokenizer.to_str())
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad directory
        raise ModelLoadError(f"{path}: cannot build its tokenizer ({exc})") from exc
    model = data["model"]
    vocab = model.get("vocab", {})
    pieces = dict(enumerate(p[0] for p in vocab)) if isinstance(vocab, list) else \
        {i: t for t, i in vocab.items()}
    added = data.get("added_tokens") or []
    size = 1 + max(list(pieces) + [t["id"] for t in added])
    tokens = [pieces.get(i, f"[EMPTY_{i}]") for i in range(size)]
    attrs = [ATTR_BYTE if model.get("byte_fallback") and BYTE_TOKEN.fullmatch(t) else ATTR_NORMAL
             for t in tokens]
    for token in added:
        tokens[token["id"]] = token["content"]
        attrs[token["id"]] = (ATTR_CONTROL if token.get("special") else ATTR_USER_DEFINED) \
            | (ATTR_LSTRIP if token.get("lstrip") else 0) | (ATTR_RSTRIP if token.get("rstrip") else 0)
    data["added_tokens"], data["post_processor"] = [], None
    decoders = _steps(data.get("decoder"))
    probe = hf("a", add_special_tokens=True).input_ids
    meta = {"tokens": tokens, "attrs": attrs, "bos_id": hf.bos_token_id, "eos_id": hf.eos_token_id,
            "unk_id": hf.unk_token_id, "pad_id": hf.pad_token_id,
            "around": ([hf.bos_token_id] if hf.bos_token_id is not None and probe[:1] == [hf.bos_token_id] else [],
                       [hf.eos_token_id] if hf.eos_token_id is not None and probe[-1:] == [hf.eos_token_id]
                       and len(probe) > 1 else []),
            "add_space_prefix": any(d.get("type") == "Strip" and d.get("start", 0) > 0 or
                                    d.get("type") == "Metaspace" and d.get("prepend_scheme") != "never"
                                    for d in decoders),
            "byte_level": any(d.get("type") == "ByteLevel" for d in decoders),
            "chat_template": hf.chat_template if isinstance(hf.chat_template, str) else None}
    return json.dumps(data, ensure_ascii=False), meta


def _steps(decoder: dict | None) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for d in decoder.get("decoders", []) for step in _steps(d)]
    return [decoder]
