"""A GGUF file's vocabulary, read from its `tokenizer.*` keys the way llama.cpp reads it.

Only the metadata is parsed (never the model's configuration or tensors), so a vocab-only file
or an architecture this project does not run still gives its tokenizer. Each token gets the
attributes llama.cpp's `llama_vocab::impl::load` gives it: the file's token type, then the
same corrections by token text (end-of-generation and fill-in-the-middle texts become control
tokens, Gemma 4's `</s>` a normal one, Phi-3's special tokens strip the spaces after them).
Those attributes decide which texts are special tokens and how each id is decoded.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# llama.cpp's token types (the file's tokenizer.ggml.token_type) and attributes (llama.h).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL = 1, 2, 4, 8
ATTR_USER_DEFINED, ATTR_BYTE, ATTR_LSTRIP, ATTR_RSTRIP = 16, 32, 128, 256
ATTR_OF_TYPE = {NORMAL: ATTR_NORMAL, UNKNOWN: ATTR_UNKNOWN, CONTROL: ATTR_CONTROL,
                USER_DEFINED: ATTR_USER_DEFINED, UNUSED: ATTR_UNUSED, BYTE: ATTR_BYTE}
SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN    # split out of text first
PARSED_ONLY_ON_REQUEST = ATTR_CONTROL | ATTR_UNKNOWN               # the rest always are

# tokenizer.ggml.model -> the kind of tokenizer llama.cpp runs for it.
KINDS = {"llama": "spm", "gpt2": "bpe", "gemma4": "bpe", "bert": "wpm"}
# llama.cpp's special tokens where the file names none, per tokenizer.ggml.model:
# (bos, eos, unknown, separator, padding).
DEFAULT_IDS = {"llama": (1, 2, 0, None, None), "gpt2": (11, 11, None, None, None),
               "gemma4": (None, None, None, None, None), "bert": (101, None, 100, 102, 0)}

# Texts llama.cpp makes control tokens whatever the file says (end of generation), and the
# fill-in-the-middle texts it looks for when the file names no such token (key, texts).
END_OF_GENERATION = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[")
FILL_IN_THE_MIDDLE = (
    ("fim_pre", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                 "▁<PRE>", "<|code_prefix|>", "<|prefix|>")),
    ("fim_suf", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                 "▁<SUF>", "<|code_suffix|>", "<|suffix|>")),
    ("fim_mid", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                 "▁<MID>", "<|code_middle|>", "<|middle|>")),
    ("fim_pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    ("fim_rep", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    ("fim_sep", ("<|file_sep|>",)))
DEPRECATED_KEYS = {"fim_pre": ("prefix",), "fim_suf": ("suffix",), "fim_mid": ("middle",)}
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")   # gpt-oss


class VocabError(ValueError):
    """A file whose vocabulary cannot be read or is of a kind this project does not tokenize."""


@dataclass
class Vocab:
    """What tokenizing and decoding need, as llama.cpp reads it from a GGUF file."""
    source: str
    model: str                      # tokenizer.ggml.model
    pre: str                        # tokenizer.ggml.pre ("default" where absent)
    tokens: list[str]
    attrs: list[int]
    scores: list[float] | None
    merges: list[tuple[str, str]] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    sep_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    lowercase: bool                 # WordPiece's normalizer (tokenizer.ggml.normalizer.*)
    strip_accents: bool
    chat_template: str | None
    chat_templates: dict[str, str] = field(default_factory=dict)   # named ones (tool_use, rag)

    @property
    def kind(self) -> str:
        return KINDS[self.model]

    def special_around(self) -> tuple[list[int], list[int]]:
        """The ids llama.cpp puts before and after a text it tokenizes with add_special: the
        BOS and EOS tokens where the vocabulary adds them; WordPiece's always, and its separator."""
        if self.kind == "wpm":
            return [t for t in (self.bos_id,) if t is not None], [t for t in (self.sep_id,) if t is not None]
        return ([self.bos_id] if self.add_bos and self.bos_id is not None else [],
                [self.eos_id] if self.add_eos and self.eos_id is not None else [])


# ---------------------------------------------------------------- the file's metadata

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
          11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


def read_metadata(path: Path) -> dict:
    """Every key of a GGUF file's metadata, its tensors left unread. String arrays become lists
    of str, numeric arrays numpy arrays."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse_metadata(data)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise VocabError(f"{path}: cannot read its GGUF metadata ({exc})") from exc


def _parse_metadata(data: mmap.mmap) -> dict:
    if bytes(data[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    version, = struct.unpack_from("<I", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    _, count = struct.unpack_from("<QQ", data, 8)
    offset, out = 24, {}
    for _ in range(count):
        key, offset = _string(data, offset)
        kind, = struct.unpack_from("<I", data, offset)
        out[key], offset = _value(data, offset + 4, kind)
    return out


def _string(data: mmap.mmap, offset: int) -> tuple[str, int]:
    (text,), end = _strings(data, offset, 1)
    return text, end


def _strings(data: mmap.mmap, offset: int, n: int) -> tuple[list[str], int]:
    # A vocabulary's hundreds of thousands of tokens and merges: the loop kept tight.
    unpack, values, total = struct.Struct("<Q").unpack_from, [], len(data)
    for _ in range(n):
        size, = unpack(data, offset)
        offset += 8
        if offset + size > total:
            raise ValueError("metadata runs past the end of the file")
        values.append(data[offset:offset + size].decode("utf-8"))
        offset += size
    return values, offset


def _value(data: mmap.mmap, offset: int, kind: int):
    if kind in _SCALARS:
        return struct.unpack_from(_SCALARS[kind], data, offset)[0], offset + struct.calcsize(_SCALARS[kind])
    if kind == STRING:
        return _string(data, offset)
    if kind != ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    item, n = struct.unpack_from("<IQ", data, offset)
    offset += 12
    if item in _NUMPY:
        width = np.dtype(_NUMPY[item]).itemsize
        return np.frombuffer(data, _NUMPY[item], n, offset).copy(), offset + n * width
    if item == STRING:
        return _strings(data, offset, n)
    values = []
    for _ in range(n):
        value, offset = _value(data, offset, item)
        values.append(value)
    return values, offset


# ---------------------------------------------------------------- the vocabulary

# add_bos where the file does not say: llama.cpp's default per tokenizer and pre-tokenizer.
BOS_BY_DEFAULT = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                  "lfm2", "jina-v5-nano", "tekken", "chameleon"}


def read_vocab(path: Path) -> Vocab:
    """The vocabulary of a GGUF file, from its tokenizer keys alone."""
    meta = read_metadata(path)
    key = lambda name, default=None: meta.get(f"tokenizer.ggml.{name}", default)  # noqa: E731
    model = key("model")
    if model is None:
        raise VocabError(f"{path}: the file has no tokenizer (no tokenizer.ggml.model key)")
    if model not in KINDS:
        raise VocabError(f"{path}: tokenizer model {model!r} is not supported (llama: "
                         "SentencePiece, gpt2: byte-level BPE, gemma4, bert: WordPiece)")
    tokens = _token_texts(path, key("tokens"))
    n = len(tokens)
    types = _per_token(path, key("token_type"), n, "token_type")
    scores = _per_token(path, key("scores"), n, "scores")
    kind = KINDS[model]
    merges = _merges(path, key("merges")) if kind == "bpe" else None
    pre = "gemma4" if model == "gemma4" else str(key("pre") or "default")   # (a BPE's regular expressions)
    bos, eos, unk, sep, pad = (_token_id(meta, name, default, n) for name, default in zip(
        ("bos_token_id", "eos_token_id", "unknown_token_id", "seperator_token_id", "padding_token_id"),
        DEFAULT_IDS[model]))
    add_bos = bool(key("add_bos_token", kind in ("spm", "wpm") or pre in BOS_BY_DEFAULT))
    if model == "gemma4":
        add_bos = True           # llama.cpp overrides the file here (its PR 21500)
    lowercase = bool(key("normalizer.lowercase", True))
    template = meta.get("tokenizer.chat_template")
    named = {name: meta[f"tokenizer.chat_template.{name}"]
             for name in meta.get("tokenizer.chat_templates", []) or []
             if isinstance(meta.get(f"tokenizer.chat_template.{name}"), str)}
    return Vocab(source=str(path), model=model, pre=pre, tokens=tokens,
                 attrs=token_attributes(tokens, [int(t) for t in types] if types is not None else None,
                                        meta, eos),
                 scores=[float(s) for s in scores] if scores is not None else None, merges=merges,
                 bos_id=bos, eos_id=eos, unk_id=unk, sep_id=sep, pad_id=pad, add_bos=add_bos,
                 add_eos=bool(key("add_eos_token", False)),
                 add_space_prefix=bool(key("add_space_prefix", kind == "spm")),
                 lowercase=lowercase, strip_accents=bool(key("normalizer.strip_accents", lowercase)),
                 chat_template=template if isinstance(template, str) else None, chat_templates=named)


def _token_texts(path: Path, tokens) -> list[str]:
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise VocabError(f"{path}: tokenizer.ggml.tokens is missing or not a list of strings")
    # llama.cpp names empty tokens so that every text is a distinct token.
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    if len(set(tokens)) != len(tokens):
        seen, twice = set(), None
        for t in tokens:
            if t in seen:
                twice = t
                break
            seen.add(t)
        raise VocabError(f"{path}: the token {twice!r} appears twice in tokenizer.ggml.tokens "
                         "(llama.cpp refuses such a vocabulary too)")
    return tokens


def _per_token(path: Path, values, n: int, name: str):
    if values is None:
        return None
    if not isinstance(values, np.ndarray) or len(values) < n:
        raise VocabError(f"{path}: tokenizer.ggml.{name} has {len(values)} entries for {n} tokens"
                         if isinstance(values, np.ndarray) else
                         f"{path}: tokenizer.ggml.{name} is not a numeric array")
    return values[:n].tolist()


def _merges(path: Path, merges) -> list[tuple[str, str]]:
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise VocabError(f"{path}: a BPE vocabulary needs tokenizer.ggml.merges (a list of strings)")
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)      # as llama.cpp splits them: the first space after the start
        pairs.append((merge[:cut], merge[cut + 1:]) if cut > 0 else ("", ""))
    return pairs


def _token_id(meta: dict, name: str, default: int | None, n: int) -> int | None:
    """A special token's id: the file's where it is in range, else llama.cpp's default."""
    if default is not None and default >= n:
        default = None
    value = meta.get(f"tokenizer.ggml.{name}")
    if value is None or not 0 <= int(value) < n:
        return default
    return int(value)


def token_attributes(tokens: list[str], types: list[int] | None, meta: dict,
                     eos_id: int | None) -> list[int]:
    """llama.cpp's attributes of every token: its type's, corrected by text as llama.cpp does."""
    attrs = [ATTR_OF_TYPE.get(t, 0) for t in types] if types is not None else [ATTR_NORMAL] * len(tokens)
    index = {text: i for i, text in enumerate(tokens)}
    end = {index[t] for t in END_OF_GENERATION if t in index}
    for i in end:
        attrs[i] |= ATTR_CONTROL
    for name, texts in FILL_IN_THE_MIDDLE:
        found = any(f"tokenizer.ggml.{k}_token_id" in meta for k in (name,) + DEPRECATED_KEYS.get(name, ()))
        for text in texts:
            # llama.cpp marks the first such text it meets; a file holds one of each kind.
            if not found and text in index:
                attrs[index[text]] |= ATTR_CONTROL
                found = True
                if name in ("fim_pad", "fim_rep", "fim_sep"):
                    end.add(index[text])
        if name in ("fim_pad", "fim_rep", "fim_sep") and meta.get(f"tokenizer.ggml.{name}_token_id") is not None:
            end.add(int(meta[f"tokenizer.ggml.{name}_token_id"]))
    for i, text in enumerate(tokens):
        if attrs[i] & ATTR_CONTROL and "unused" in text:
            attrs[i] |= ATTR_UNUSED
    for text in ALWAYS_RENDERED:
        if text in index:
            attrs[index[text]] = ATTR_USER_DEFINED
    end |= {int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if meta.get(k) is not None}
    if eos_id is not None:
        end.add(eos_id)
    ending = {tokens[i] for i in end if 0 <= i < len(tokens)}
    if "<|end|>" in ending and ({"<|return|>", "<|call|>"} <= ending or {"<|calls|>", "<|flush|>"} <= ending):
        attrs[index["<|end|>"]] = ATTR_USER_DEFINED       # o200k_harmony's and solar-open's
    if "</s>" in ending and ending & {"<|tool_response>", "<|plamo:eos|>"}:
        attrs[index["</s>"]] = ATTR_NORMAL                 # Gemma 4's and PLaMo's </s> is text
    _strip_attributes(attrs, index, meta)
    return attrs


def _strip_attributes(attrs: list[int], index: dict[str, int], meta: dict) -> None:
    """The spaces some models' special tokens swallow, set by model name as llama.cpp does."""
    name = str(meta.get("general.name", "")).lower()
    pre = str(meta.get("tokenizer.ggml.pre", ""))
    arch = str(meta.get("general.architecture", ""))
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
            any(a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in index:
            attrs[index["<mask>"]] |= ATTR_LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for i, attr in enumerate(attrs):
            if attr & SPECIAL_ATTRS:
                attrs[i] |= ATTR_RSTRIP
        for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if text in index:
                attrs[index[text]] = attrs[index[text]] | ATTR_RSTRIP if on else attrs[index[text]] & ~ATTR_RSTRIP
    elif "modern-bert" in name and "[MASK]" in index:
        attrs[index["[MASK]"]] |= ATTR_LSTRIP
