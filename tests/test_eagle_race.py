"""benchmarks/eagle_race.py: its paths compose to the configurations their names say."""

from __future__ import annotations

import argparse

from run import compose_run_config


def test_eagle_race_paths_compose_to_what_their_names_say():
    from benchmarks.eagle_race import AR, specs

    args = argparse.Namespace(chains=[3, 4], kary_depths=[2], dynamic=["6/3/2"], eagle3_chains=[4],
                              no_eagle3=False, vocab=[1024], no_trees=False)
    base = ("model=zoo", "workload=code", "task=measure")
    paths = specs(args, base)
    names = [p[0] for p in paths]
    assert len(set(names)) == len(names) and names[0] == AR
    by = {p[0]: p for p in paths}
    for name, overrides, tree, params, f32 in paths:
        cfg = compose_run_config(*base, *overrides)
        if "dynamic" in name:
            assert tree is None and cfg.tree.kind.value == "dynamic"
            assert (cfg.tree.total_tokens, cfg.tree.depth, cfg.tree.top_k) == (6, 3, 2)
        if name.startswith("eagle3"):
            assert cfg.method.name == "eagle3"
        elif name.startswith("eagle"):
            assert cfg.method.drafter == "eagle"
        if " chain g=" in name:
            assert tree.depth == tree.size - 1 == int(name.split("g=")[1].split()[0].rstrip(","))
        assert params.get("draft_vocab") == (1024 if "vocab 1024" in name else None)
        assert f32 == name.endswith("float32 K/V")
    assert by["eagle 2-ary depth 2"][2].size == 7
    assert "eagle3 chain g=4 vocab 1024" in by and "eagle chain g=3 vocab 1024" in by
    args.no_trees = True
    assert not any("dynamic" in p[0] or "ary" in p[0] or "static" in p[0] for p in specs(args, base))
