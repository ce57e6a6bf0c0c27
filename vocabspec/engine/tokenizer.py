"""Tokenizer and chat template, from the same source as the model.

A GGUF tokenizer is converted once through transformers and cached as tokenizer.json; later
runs load it with the fast `tokenizers` library alone. The chat template (when the model has
one) is rendered with jinja2 the way transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import cache_dir, file_key, write_atomically
from .loading import ModelLoadError


class Tokenizer:
    def __init__(self, directory: Path):
        from tokenizers import Tokenizer as FastTokenizer

        self.backend = FastTokenizer.from_file(str(directory / "tokenizer.json"))
        meta = json.loads((directory / "vocabspec_tokenizer.json").read_text())
        self.bos_token = meta.get("bos_token")
        self.eos_token = meta.get("eos_token")
        self.add_bos = meta.get("add_bos", False)
        self.chat_template = meta.get("chat_template")
        self.bos_token_id = self.backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.backend.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template (it is a base model): "
                             "use a plain continuation prompt")
        import jinja2

        def raise_exception(message):
            raise ValueError(message)

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                               raise_exception=raise_exception)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The rendered template already carries its own special tokens.
        return self.encode(self.apply_chat_template(messages), add_bos=False)


def _convert(source: Path, out: Path) -> None:
    """Write tokenizer.json + our metadata for a GGUF file or HF directory."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        if source.is_dir():
            hf = AutoTokenizer.from_pretrained(str(source))
        else:
            hf = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as exc:
        raise ModelLoadError(f"{source}: cannot build its tokenizer ({exc})") from exc
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "tokenizer.json", lambda tmp: hf.backend_tokenizer.save(str(tmp)))
    add_bos = bool(getattr(hf, "add_bos_token", False))
    probe = hf("a").input_ids
    if hf.bos_token_id is not None and probe and probe[0] == hf.bos_token_id:
        add_bos = True
    meta = {"bos_token": hf.bos_token, "eos_token": hf.eos_token, "add_bos": add_bos,
            "chat_template": hf.chat_template if isinstance(hf.chat_template, str) else None}
    write_atomically(out / "vocabspec_tokenizer.json", lambda tmp: tmp.write_text(json.dumps(meta)))


def load_tokenizer(model_path: Path) -> Tokenizer:
    directory = cache_dir() / f"tokenizer-{model_path.stem}-{file_key(model_path)}"
    if not (directory / "vocabspec_tokenizer.json").exists():
        _convert(model_path, directory)
    return Tokenizer(directory)
