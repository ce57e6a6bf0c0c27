"""Ranked token lists for static draft vocabularies: counting, and the files they live in.

FR-Spec ranks tokens by their frequency in a corpus (here the ShareGPT conversations in the
target's own prompt format, plus any text files). VocabTrim ranks them by how often the target
itself produces them: we count the target's greedy next-token choice at every position of the
training conversations (teacher-forced generation, one token per context, already computed when
the drafter's features were extracted).
Tokens never counted follow in corpus order, so a list of any length can be cut from it.

Successor lists (for SpecVocab's candidates): for each token, the tokens that most often follow
it in the same corpus. A low-rank ranker cannot spell out a word's remaining sub-words ("Waik"
-> "iki") or a fixed pair ("San" -> " Francisco"); one row of a bigram table can. Stored as
`offsets` (|V| + 1) and `ids` in a safetensors file: token t's successors, most frequent first,
are ids[offsets[t]:offsets[t + 1]].

Formats, both read and written:
- SGLang / FR-Spec token map: `torch.save` of a list of token ids, most frequent first
  (SGLang's --speculative-token-map).
- EAGLE-3: `d2t` (draft id -> target id offset, target = draft + d2t[draft]) and `t2d`
  (bool mask over the target vocabulary), in a safetensors file; draft ids ascend.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ...runtime.files import load_torch_file


def rank(counts: Counter, vocab: int, fallback: Iterable[int] = ()) -> list[int]:
    """Token ids by descending count (ties: lower id first), then `fallback` order, then the
    rest of the vocabulary by id."""
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if 0 <= t < vocab]
    seen = set(ranked)
    for t in list(fallback) + list(range(vocab)):
        if t not in seen and 0 <= t < vocab:
            seen.add(t)
            ranked.append(t)
    return ranked


def file_ids(tokenizer, paths: Iterable[str | Path]) -> Iterator[list[int]]:
    """Each text file as token ids."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} does not exist")
        yield tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_bos=False)


def count_files(tokenizer, paths: Iterable[str | Path]) -> Counter:
    counts: Counter = Counter()
    for ids in file_ids(tokenizer, paths):
        counts.update(ids)
    return counts


def count_target_predictions(feature_dir: Path) -> Counter:
    """The target's greedy next token at every position of the extracted training data."""
    counts: Counter = Counter()
    shards = sorted(Path(feature_dir).glob("train-*.pt"))
    if not shards:
        raise FileNotFoundError(f"no feature shards under {feature_dir}: run "
                                "`vocabspec train --stages data,features` first")
    for path in shards:
        shard = load_torch_file(path)
        for candidates in shard["candidates"]:
            counts.update(candidates[:, 0].tolist())
    return counts


def successor_lists(texts: Iterable[list[int]], vocab: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, ids): each token's `width` most frequent next tokens in `texts` (ties: lower
    id first), as a compressed table; tokens never followed by anything get an empty list."""
    import numpy as np

    if width < 1:
        raise ValueError(f"successor lists need a width of at least 1, got {width}")
    pairs = []
    for ids in texts:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"text holds token ids outside the vocabulary [0, {vocab})")
        pairs.append(ids[:-1] * vocab + ids[1:])
    pairs = np.concatenate(pairs) if pairs else np.zeros(0, dtype=np.int64)
    keys, counts = np.unique(pairs, return_counts=True)
    previous, following = keys // vocab, keys % vocab
    order = np.lexsort((following, -counts, previous))   # by token, then count, then id
    previous, following = previous[order], following[order]
    starts = np.searchsorted(previous, np.arange(vocab + 1))
    # Rank of each pair among its token's successors; keep the first `width`.
    rank_in_row = np.arange(previous.size) - starts[previous]
    keep = rank_in_row < width
    kept_previous = previous[keep]
    offsets = np.searchsorted(kept_previous, np.arange(vocab + 1))
    return (torch.from_numpy(offsets.astype(np.int64)),
            torch.from_numpy(following[keep].astype(np.int32)))


# ---------------------------------------------------------------------------- files

def save_successors(offsets: torch.Tensor, ids: torch.Tensor, path: str | Path,
                    meta: dict | None = None) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Two bytes an id where the vocabulary allows it.
    ids = ids.to(torch.uint16) if offsets.numel() - 1 <= 65536 else ids.int()
    save_file({"offsets": offsets.int().contiguous(), "ids": ids.contiguous()}, str(path),
              metadata={k: str(v) for k, v in (meta or {}).items()})


def load_successors(path: str | Path, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, ids) of a successor table made for a vocabulary of `vocab` tokens."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"successor table {path} does not exist")
    try:
        tensors = load_file(str(path))
        offsets, ids = tensors["offsets"].long(), tensors["ids"].long()
    except Exception as exc:
        raise ValueError(f"successor table {path} is unreadable ({exc})") from exc
    if offsets.dim() != 1 or offsets.numel() != vocab + 1 or ids.dim() != 1:
        raise ValueError(f"successor table {path} has {offsets.numel() - 1} rows, not the target's "
                         f"{vocab}: was it made for another model?")
    if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool((offsets.diff() < 0).any()):
        raise ValueError(f"successor table {path} is corrupt (its offsets do not index its ids)")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"successor table {path} holds ids outside the vocabulary [0, {vocab})")
    return offsets, ids


def save_token_map(ids: list[int] | torch.Tensor, path: str | Path) -> None:
    """SGLang / FR-Spec format: a torch-saved list of ints, most frequent first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([int(t) for t in ids], path)


def eagle3_tensors(ids, vocab: int) -> dict[str, torch.Tensor]:
    used = sorted(int(t) for t in ids)
    d2t = torch.tensor([t - i for i, t in enumerate(used)], dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return {"d2t": d2t, "t2d": t2d}


def save_eagle3(ids, vocab: int, path: str | Path) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(eagle3_tensors(ids, vocab), str(path))


def load_token_map(path: str | Path, vocab: int | None = None) -> torch.Tensor:
    """Token ids from an SGLang token map (.pt list or tensor) or EAGLE-3 d2t/t2d (.safetensors)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token map {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
            if "d2t" not in tensors:
                raise ValueError("no d2t tensor")
            d2t = tensors["d2t"].long()
            ids = torch.arange(d2t.numel()) + d2t
        else:
            data = torch.load(path, weights_only=True)
            ids = torch.as_tensor(data, dtype=torch.long)
    except Exception as exc:
        raise ValueError(f"token map {path} is unreadable ({exc})") from exc
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"token map {path} must hold a non-empty list of token ids")
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token map {path} holds ids outside the target vocabulary [0, {vocab}): "
                         "was it made for another model?")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"token map {path} lists a token twice")
    return ids
