"""Where vocabspec keeps what it derives from model files (dequantized and re-encoded weights,
tokenizers, the compiled native engine, tree choices), and how a source file is identified."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """VOCABSPEC_CACHE, default ~/.cache/vocabspec (created on first use)."""
    path = Path(os.environ.get("VOCABSPEC_CACHE", Path.home() / ".cache" / "vocabspec"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_key(path: Path) -> str:
    """A file's identity for caching: its resolved path, size and modification time, hashed."""
    stat = path.stat()
    ident = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


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
