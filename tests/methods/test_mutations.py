"""The mutation check (tests/mutations.py) stays applicable: every mutation's edit occurs exactly once in
today's source, changes it, and a copy of the repository with it applied still imports. Running the check
itself takes minutes (python tests/mutations.py); this keeps its list from rotting as the code moves."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mutations", REPO / "tests" / "mutations.py")
mutations = importlib.util.module_from_spec(spec)
sys.modules.setdefault("mutations", mutations)  # dataclasses look their module up while being built
spec.loader.exec_module(mutations)


def test_the_list_names_the_issue_mutations_and_more():
    names = {m.name for m in mutations.MUTATIONS}
    assert {"token_drawn_with_the_acceptance_coin", "chain_bonus_from_the_first_position"} <= names
    assert len(names) == len(mutations.MUTATIONS) >= 6


@pytest.mark.parametrize("mutation", mutations.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_once_and_compiles(tmp_path, mutation):
    src = REPO / mutation.path
    assert src.read_text().count(mutation.before) == 1
    dst = tmp_path / mutation.path
    dst.parent.mkdir(parents=True)
    dst.write_text(src.read_text())
    mutations.apply(mutation, tmp_path)
    assert dst.read_text() != src.read_text()
    subprocess.run([sys.executable, "-m", "py_compile", str(dst)], check=True)
