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
