"""Where vocabspec keeps what it derives from model files (dequantized and re-encoded weights,
tokenizers, the compiled native engine, tree choices), and how a source file is identified."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_dir() -> Path:
    """VOCABSPEC_CACHE, default ~/.cache/vocabspec (created on first use)."""
    path = Path(os.environ.get("VOCABSPEC_CACHE", Path.home() / ".cache" / "vocabspec"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_key(path: Path) -> str:
    """A model's identity for caching: the hash of its contents (a file's bytes; a model
    directory's files, by name, each one's bytes). A model reinstalled (a new virtual
    environment, a package upgraded to the same file) or copied elsewhere keeps its cache
    entries, where a key of its path and modification time would rebuild them and leave the old
    ones on disk; a file rewritten in place gets a new key. Hashing takes a fraction of a second
    per GB, done once per path, size and modification time: the index in
    `cache_dir()/file-keys.json` remembers it for later processes."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    stats = [(p, p.stat()) for p in files]
    ident = f"{path.resolve()}\n" + ";".join(f"{p.name}:{st.st_size}:{st.st_mtime_ns}" for p, st in stats)
    index_path = cache_dir() / "file-keys.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if ident in index:
        return index[ident]
    digest = hashlib.sha256()
    for p, _ in stats:
        if path.is_dir():
            digest.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    key = digest.hexdigest()[:16]
    index[ident] = key
    # Entries of paths that are gone are dropped; a lost race with another writer only costs
    # a later process one more hash.
    index = {k: v for k, v in index.items() if Path(k.split("\n", 1)[0]).exists()}
    write_atomically(index_path, lambda tmp: tmp.write_text(json.dumps(index, indent=0)))
    return key


def load_torch_file(path: Path, **options):
    """torch.load of a file vocabspec wrote (feature shards, checkpoints); a truncated or foreign
    file raises ValueError naming it instead of torch's RuntimeError from deep in its reader."""
    import torch

    try:
        return torch.load(path, **options)
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: unreadable ({first})") from exc


def write_atomically(path: Path, write) -> None:
    """`write(tmp_path)` then rename it onto `path`: another process (a second server, a test
    worker) reading the cache meanwhile sees the old file or the whole new one, never half of
    one (a half-written safetensors file read through a memory map can even kill the reader)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
