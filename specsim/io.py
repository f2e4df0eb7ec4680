"""Atomic writers for run outputs (metrics.json, samples.jsonl).

A sweep may be killed at any moment: a file is written to a temporary name in the same directory, flushed
to disk, then renamed over the target with ``os.replace`` (atomic on POSIX), so a reader sees either the
old file, nothing, or the complete new one — never half a JSON object.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any


def _jsonable(obj: Any) -> Any:
    """``json.dumps`` fallback: NumPy scalars/arrays, enums, paths, tuples-as-keys are common in results."""
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy scalar or array (no numpy import needed)
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def _atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # interrupted or failed: leave no temporary file behind
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def dumps(obj: Any) -> str:
    """One JSON document; keys keep their insertion order (metrics.json lists identity keys first)."""
    return json.dumps(obj, default=_jsonable, ensure_ascii=False)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as one indented JSON document to ``path`` atomically."""
    return _atomic_write_text(path, json.dumps(obj, default=_jsonable, ensure_ascii=False, indent=1) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[Any]) -> Path:
    """Write one JSON object per line to ``path`` atomically (all rows or nothing)."""
    return _atomic_write_text(path, "".join(dumps(row) + "\n" for row in rows))


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def cache_root() -> Path:
    """The cache every run reads and writes (zoo, heads, profiles): $SPECSIM_CACHE, else ~/.cache/specsim."""
    return Path(os.environ.get("SPECSIM_CACHE") or Path.home() / ".cache" / "specsim")
