"""Tokenizer and chat template, from the same source as the model, tokenizing as llama.cpp does.

A GGUF file's vocabulary (its tokenizer keys alone: vocab.py) is converted once into a
`tokenizers` pipeline for raw text (vocab_conversion.py) and cached with the tokens and their
attributes; later runs load the cache. Encoding cuts special tokens out first
(special_tokens.py), runs the pipeline on the text between, and puts the file's BOS token first
where llama.cpp would (tokenizer.ggml.add_bos_token, else the family's default). Decoding gives
each token's text as llama.cpp's detokenizer does.

A chat is rendered by its template in a sandbox (chat_template.py), and its messages' text
stays text: a control token's text inside a message is tokenized as the characters it is, so
only the template's own markup becomes control tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .chat_template import ChatTemplate, ChatTemplateError, mark_control_texts
from .files import cache_dir, file_key, write_atomically
from .loading import ModelLoadError
from .special_tokens import SpecialTokens
from .vocab import (ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED,
                    PARSED_ONLY_ON_REQUEST, VocabError, read_vocab)

# Bumped whenever conversion changes what a cached tokenizer holds: stale caches are rebuilt.
CONVERSION_VERSION = 3
META = "vocabspec_tokenizer.json"


class Tokenizer:
    def __init__(self, directory: Path, source: Path | None = None):
        """The tokenizer cached in `directory`; `source`: the model file it was made from, as
        errors name it (default: where it was when converted)."""
        from tokenizers import Tokenizer as FastTokenizer

        meta = json.loads((directory / META).read_text(encoding="utf-8"))
        self.source = str(source) if source is not None else meta["source"]
        self.backend = FastTokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokens: list[str] = meta["tokens"]
        self.attrs: list[int] = meta["attrs"]
        self.bos_token_id, self.eos_token_id = meta["bos_id"], meta["eos_id"]
        self.bos_token = self._text(self.bos_token_id)
        self.eos_token = self._text(self.eos_token_id)
        # The special tokens a template may name, as transformers passes them to it.
        self.template_tokens = {f"{name}_token": self._text(meta[f"{name}_id"])
                                for name in ("bos", "eos", "unk", "pad") if meta.get(f"{name}_id") is not None}
        self.before, self.after = meta["around"]      # what add_special puts around a text
        self.add_bos = self.bos_token_id is not None and self.before == [self.bos_token_id]
        self.add_space_prefix = meta["add_space_prefix"]
        self.special = SpecialTokens(self.tokens, self.attrs)
        self._pieces = token_pieces(self.tokens, self.attrs, meta["byte_level"])
        self._hidden = {i for i, a in enumerate(self.attrs) if a & PARSED_ONLY_ON_REQUEST}
        source = meta.get("chat_template")
        # A hostile template is refused here, when the model loads: it is never rendered.
        self.template = ChatTemplate(source, self.source) if source else None

    def _text(self, token: int | None) -> str | None:
        return self.tokens[token] if token is not None else None

    @property
    def chat_template(self) -> str | None:
        return self.template.source if self.template else None

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. parse_special: a special token's text becomes that token (as
        llama.cpp's completion does), else control tokens' texts are text (user-defined tokens
        are always tokens, as in llama.cpp). add_bos: None for the file's choice, llama.cpp's
        add_special (its BOS where it adds one: a text that starts with the BOS token's own text
        then starts with two, as in llama.cpp; an EOS or separator where it adds one), True for
        a BOS whatever the file says, False for neither."""
        return self.encode_batch([text], add_bos, parse_special)[0]

    def encode_batch(self, texts: list[str], add_bos: bool | None = None,
                     parse_special: bool = True) -> list[list[int]]:
        """`encode` of each text, the pipeline run once over all of them."""
        if not isinstance(parse_special, bool):
            raise ValueError(f"parse_special must be true or false, not {parse_special!r}")
        if add_bos is False:
            before, after = [], []
        else:
            before = [self.bos_token_id] if add_bos and self.bos_token_id is not None else self.before
            after = self.after
        return [before + ids + after for ids in self._encode([self.special.split(t, parse_special) for t in texts])]

    def _encode(self, splits: list[list], restore: dict | None = None) -> list[list[int]]:
        """Each split text's ids: its special tokens as they are, its text through the pipeline
        (after `restore`, str.translate's table, puts back what a chat's rendering stood in for)."""
        texts = [p.translate(restore) if restore else p for pieces in splits for p in pieces
                 if isinstance(p, str)]
        encoded = iter(self.backend.encode_batch(texts, add_special_tokens=False)) if texts else iter(())
        out = []
        for pieces in splits:
            ids: list[int] = []
            for piece in pieces:
                if isinstance(piece, str):
                    ids.extend(next(encoded).ids)
                else:
                    ids.append(piece)
            out.append(ids)
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` as llama.cpp's detokenizer gives it: control tokens' text only when
        not skipped, the first token's leading space dropped where the vocabulary adds one."""
        pieces, n = self._pieces, len(self._pieces)
        parts = [b"" if not 0 <= i < n or (skip_special_tokens and i in self._hidden) else pieces[i]
                 for i in ids]
        if self.add_space_prefix and parts and parts[0].startswith(b" "):
            parts[0] = parts[0][1:]
        return b"".join(parts).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat as its template renders it (what transformers' apply_chat_template gives)."""
        return self._chat_template().render(messages, add_generation_prompt, self.template_tokens)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """A chat's token ids: the template's markup parsed for special tokens, every message's
        text tokenized as text (a control token's text in a message is its characters)."""
        template = self._chat_template()
        marked, restore = mark_control_texts(messages, self.special, avoid=(template.source,))
        text = template.render(marked, add_generation_prompt, self.template_tokens)
        # The template writes its own BOS where it wants one: none is added.
        return self._encode([self.special.split(text, parse_special=True)], restore)[0]

    def _chat_template(self) -> ChatTemplate:
        if self.template is None:
            raise ValueError("this model has no chat template (it is a base model): "
                             "use a plain continuation prompt")
        return self.template


def token_pieces(tokens: list[str], attrs: list[int], byte_level: bool) -> list[bytes]:
    """Each token's bytes as llama.cpp's token_to_piece renders it (special tokens included)."""
    byte_of = _gpt2_bytes() if byte_level else None
    # A byte-level token's characters to their bytes through one translation table (a loop
    # over a 128k vocabulary's characters takes most of a second of every load).
    as_bytes = {ord(c): b for c, b in byte_of.items()} if byte_of is not None else None
    pieces = []
    for text, attr in zip(tokens, attrs):
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            pieces.append(text.encode("utf-8"))
        elif attr & ATTR_NORMAL and byte_of is not None:
            try:
                pieces.append(text.translate(as_bytes).encode("latin-1"))
            except UnicodeEncodeError:      # a character outside GPT-2's map: its UTF-8
                pieces.append(b"".join(bytes((byte_of[c],)) if c in byte_of else c.encode("utf-8") for c in text))
        elif attr & ATTR_NORMAL:
            pieces.append(text.replace("▁", " ").encode("utf-8"))
        elif attr & ATTR_BYTE:
            pieces.append(bytes((int(text[3:5], 16),)))
        else:
            pieces.append(b"")             # unused and undefined tokens render as nothing
    return pieces


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's map from the characters of byte-level tokens back to bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


# ---------------------------------------------------------------- conversion and cache

def _convert_gguf(source: Path) -> tuple[str, dict]:
    from .vocab_conversion import pipeline_json

    try:
        vocab = read_vocab(source)
        pipeline = pipeline_json(vocab)
    except VocabError as exc:
        raise ModelLoadError(str(exc)) from exc
    return pipeline, {"tokens": vocab.tokens, "attrs": vocab.attrs, "bos_id": vocab.bos_id,
                      "eos_id": vocab.eos_id, "unk_id": vocab.unk_id, "pad_id": vocab.pad_id,
                      "around": vocab.special_around(), "add_space_prefix": vocab.add_space_prefix,
                      "byte_level": vocab.kind == "bpe" and vocab.model == "gpt2",
                      "chat_template": vocab.chat_template}


def _write(out: Path, source: Path, pipeline: str, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "tokenizer.json", lambda tmp: tmp.write_text(pipeline, encoding="utf-8"))
    meta = {"version": CONVERSION_VERSION, "source": str(source), **meta}
    write_atomically(out / META, lambda tmp: tmp.write_text(json.dumps(meta, ensure_ascii=False),
                                                            encoding="utf-8"))


def _directory_key(path: Path) -> str:
    """A model directory's identity: its tokenizer files' contents."""
    digest = hashlib.sha256()
    names = ("tokenizer", "special_tokens", "added_tokens", "chat_template", "vocab", "merges")
    for name in sorted(p.name for p in path.iterdir() if p.is_file() and p.name.startswith(names)):
        digest.update(name.encode() + b"\0" + file_key(path / name).encode())
    return digest.hexdigest()[:16]


def _cached_version(directory: Path) -> int | None:
    """The conversion version a cached tokenizer was written by (None: none, or unreadable)."""
    try:
        return json.loads((directory / META).read_text(encoding="utf-8")).get("version")
    except (OSError, ValueError):
        return None


def load_tokenizer(model_path: Path) -> Tokenizer:
    model_path = Path(model_path)
    key = _directory_key(model_path) if model_path.is_dir() else file_key(model_path)
    directory = cache_dir() / f"tokenizer-v{CONVERSION_VERSION}-{model_path.stem}-{key}"
    if _cached_version(directory) != CONVERSION_VERSION:
        if model_path.is_dir():
            from .hf_tokenizer import convert_hf_directory
            pipeline, meta = convert_hf_directory(model_path)
        else:
            pipeline, meta = _convert_gguf(model_path)
        _write(directory, model_path, pipeline, meta)
    try:
        return Tokenizer(directory, model_path)
    except ChatTemplateError as exc:
        raise ModelLoadError(str(exc)) from exc
