"""specsim.io: atomic JSON / JSON-lines writers (temp file in the same directory + os.replace)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specsim.config import Verifier
from specsim.io import atomic_write_json, atomic_write_jsonl, read_json, read_jsonl

JSONABLE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(JSONABLE)
def test_json_roundtrip(tmp_path_factory, obj):
    path = tmp_path_factory.mktemp("io") / "m.json"
    atomic_write_json(path, obj)
    assert read_json(path) == obj
    assert [p.name for p in path.parent.iterdir()] == ["m.json"]  # no temporary file left


@given(st.lists(st.dictionaries(st.text(), JSONABLE, max_size=3), max_size=5))
def test_jsonl_roundtrip(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("io") / "s.jsonl"
    atomic_write_jsonl(path, rows)
    assert read_jsonl(path) == rows
    assert path.read_text().count("\n") == len(rows)


def test_numpy_enums_and_order(tmp_path):
    obj = {"task": "simulate", "tau": np.float64(2.5), "hist": np.arange(3), "n": np.int64(7),
           "verifier": Verifier.greedy}
    atomic_write_json(tmp_path / "m.json", obj)
    text = (tmp_path / "m.json").read_text()
    expected = {"task": "simulate", "tau": 2.5, "hist": [0, 1, 2], "n": 7, "verifier": "greedy"}
    assert json.loads(text) == expected
    assert text.index('"task"') < text.index('"tau"')  # insertion order kept


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "metrics.json"
    atomic_write_json(path, {"ok": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"bad": object()})
    with pytest.raises(TypeError):
        atomic_write_jsonl(tmp_path / "s.jsonl", [{"a": 1}, {"b": object()}])
    assert read_json(path) == {"ok": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_creates_parent_dirs(tmp_path):
    path = atomic_write_json(tmp_path / "a" / "b" / "m.json", [1, 2])
    assert read_json(path) == [1, 2]
