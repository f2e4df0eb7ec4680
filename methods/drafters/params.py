"""A drafter's ``method.params`` read into its own parameter dataclass: an unknown key is a clear error naming
the allowed ones (never swallowed), Hydra's containers become plain dicts and integer tuples."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def checked_params(schema: type, params: Mapping[str, Any], name: str, dicts: Iterable[str] = ("train",),
                   int_tuples: Iterable[str] = ()) -> dict[str, Any]:
    """``params`` as keyword arguments of the dataclass ``schema``; ``name`` is the drafter in messages."""
    known = set(schema.__dataclass_fields__)
    unknown = set(params) - known
    if unknown:
        raise ValueError(f"method.params: unknown {name} keys {sorted(unknown)}; allowed {sorted(known)}")
    mine = dict(params)
    for key in dicts:  # Hydra hands over DictConfigs
        if key in mine:
            mine[key] = dict(mine[key])
    for key in int_tuples:
        if key in mine:
            mine[key] = tuple(int(i) for i in mine[key])
    return mine
