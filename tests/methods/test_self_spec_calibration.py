"""Self-drafting's calibrated pricing (methods.measurement.calibrate, .profiles): LayerSkip's shared-cache
verify is timed and its saving replaces ρ_v = E / L; Draft & Verify's draft step is priced per draft forward
(its exit pays a forward beyond a stop) and its τ comes from the draft-exit law over its confidence table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from methods.drafters.draft_verify import DraftVerifyParams
from methods.measurement.calibrate import _forwards_per_step, ensure_profile, missing_self_draft
from methods.measurement.profiles import apply_profile, exit_prediction, to_measured_cost, tree_predictions
from specsim.adaptive_exit import ConfidenceTable, ExitRule, replay_path, threshold_path
from specsim.cost import CostModel
from specsim.tree import Tree

SMALL = ("model=random_tiny", "workload.prompt_tokens=16", "calibration.prompts=2",
         "calibration.new_tokens=6", "calibration.depth_prompts=1", "calibration.reps=2",
         "calibration.max_reps=0", "calibration.warmup=0", "calibration.width=4", "tree.budgets=[1,2,4,8]")


def test_forwards_per_step_from_the_drafters_counters():
    assert _forwards_per_step((10, 4), (25, 9)) == 3.0
    assert _forwards_per_step(None, (25, 9)) == 0.0 and _forwards_per_step((3, 2), (3, 2)) == 0.0


@pytest.mark.slow
def test_layerskip_profile_times_the_shared_verify(run_config, tiny_models, cache):
    cfg = run_config(*SMALL, "method=layerskip", "method.params.exit_layer=1", "method.params.variant=none",
                     "tree=chain", "tree.gamma=3")
    prof = ensure_profile(cfg, tiny_models, show_progress=False)
    shared = prof.extra["shared_verify"]
    assert shared["tokens"] == 4 and shared["ratio"] > 0
    assert shared["saving_ratio"] == pytest.approx(shared["full_ratio"] - shared["ratio"])
    priced = apply_profile(cfg, prof)
    assert priced.method.verify_reuse_ratio == 0  # the arithmetic E / L is replaced by the timed saving
    assert priced.method.verify_saving_ratio == pytest.approx(min(0.99, max(0.0, shared["saving_ratio"])))
    chain = Tree.chain(3)
    cost = CostModel.from_config(priced, to_measured_cost(prof, chain=True))  # a chain
    expected = max(0.0, float(cost.verify_time(4)) - priced.method.verify_saving_ratio * cost.ar_time)
    assert cost.tree_verify_time(chain) == pytest.approx(expected)
    here, _ = tree_predictions(cfg, prof, chain)
    assert here["t_step_s"] == pytest.approx(cost.draft_time(chain) + expected)


@pytest.mark.slow
def test_draft_verify_profile_prices_its_adaptive_exit(run_config, tiny_models, cache):
    cfg = run_config(*SMALL, "method=draft_verify", "method.params.skip=config", "method.params.skip_mlp=[0]",
                     "method.params.gamma=4", "tree=chain", "tree.gamma=4")
    prof = ensure_profile(cfg, tiny_models, show_progress=False)
    table = prof.extra["exit_confidence"]
    assert sum(table["mass"]) == pytest.approx(1.0) and table["positions"] == 2 * 6
    assert 1 <= prof.extra["loop_draft_forwards_per_step"] <= 4  # at most γ forwards per step
    # the loop's verification overhead beside the forward the exit let run (1 + its mean draft length)
    forward = prof.extra["loop_verify_forward_tokens"]
    assert forward == max(1, min(5, round(1 + prof.extra["loop_mean_draft_length"])))
    assert forward in prof.t_n and missing_self_draft(prof, cfg) == ""
    whole = SimpleNamespace(extra={k: v for k, v in prof.extra.items() if k != "self_draft_law"})
    assert "whole sequence" in missing_self_draft(whole, cfg)  # q of the former law: measured again
    longest = SimpleNamespace(extra={**prof.extra, "loop_verify_forward_tokens": 5,
                                     "loop_mean_draft_length": 1.2})
    assert "longest draft" in missing_self_draft(longest, cfg)  # profiles made before: measured again
    # at T = 0 the rule is replayed on the calibration's trajectories (each position's (c, a) in order)
    runs = table["runs"]  # per root the drafter's chain of up to 4 (cut at the trajectory's end)
    assert [[len(c) for c in confs] for confs, _ in runs] == [[4, 4, 4, 3, 2, 1]] * 2
    assert all(0 <= j <= len(c) for confs, acc in runs for c, j in zip(confs, acc))
    bare = {k: v for k, v in table.items() if k != "runs"}
    older = SimpleNamespace(extra={**prof.extra, "exit_confidence": bare})
    assert "trajectories" in missing_self_draft(older, cfg)  # profiles made before: measured again
    chain = Tree.chain(4)
    run = exit_prediction(cfg, prof, chain)
    w = cfg.workload
    dp = DraftVerifyParams.from_method(cfg.method)
    rule = ExitRule(dp.exit_threshold, dp.adaptive, dp.target_acceptance)
    replayed = replay_path([(c, a) for c, a in runs], rule, 4, (cfg.warmup + w.num_prompts)
                           * w.max_new_tokens, cfg.warmup * w.max_new_tokens)
    assert run.thresholds == replayed.thresholds and run.tau == pytest.approx(replayed.tau)
    deeper = exit_prediction(cfg, prof, Tree.chain(6))  # chains recorded 4 deep: the table prices 6
    conf = ConfidenceTable(tuple(table["edges"]), tuple(table["mass"]), tuple(table["accept"]))
    assert deeper.tau == pytest.approx(threshold_path(conf, rule, 6, (cfg.warmup + w.num_prompts)
                                                      * w.max_new_tokens, cfg.warmup * w.max_new_tokens,
                                                      generation=w.max_new_tokens).tau)
    here, preset = tree_predictions(cfg, prof, chain)
    assert here["predicted_tau"] == pytest.approx(run.tau) == pytest.approx(preset["predicted_tau"])
    assert 1 <= here["predicted_mean_draft_length"] <= 4
    assert 1 <= here["predicted_draft_forwards_per_step"] <= 4
    assert here["predicted_tau"] <= 1 + here["predicted_mean_draft_length"]
    cost = CostModel.from_config(apply_profile(cfg, prof), to_measured_cost(prof, chain=True))  # chains
    assert here["predicted_speedup"] == pytest.approx(run.tau * cost.ar_time / run.step_time(cost))
    n = cfg.workload.max_new_tokens  # the finite run is cut on the exit law, not on the chain of 4's
    assert here["tokens_per_forward"] == pytest.approx(run.tokens_per_forward(n))
    assert here["tokens_per_forward"] <= here["predicted_tau"]
    assert here["predicted_decode_speedup"] == pytest.approx(run.decode_speedup(cost, n))
    # the run's step: its cut steps (fewer tokens left than γ) draft and verify no further than their room
    assert here["t_draft_run_s"] == pytest.approx(run.draft_time(cost, run=True))
    assert here["t_draft_run_s"] <= here["t_draft_s"]
    assert len(run.cut) > 0 and all(law.drafted.argmax() <= 3 for law in run.cut)


def test_prediction_at_the_runs_own_costs():
    from methods.measurement.measure import at_run_costs

    m = {"baseline_time_s": 11.0, "baseline_time_prefill_s": 1.0, "baseline_n_target_forwards": 100,
         "time_draft_s": 6.0, "time_verify_s": 4.0, "n_target_forwards": 40, "predicted_tau": 2.5}
    t_ar, draft, verify = 0.1, 0.15, 0.1  # per token / per step
    assert at_run_costs(m) == pytest.approx(2.5 * t_ar / (draft + verify))
    # an adaptive draft length: the run's cost per draft forward at the predicted forwards per step
    m.update(draft_forwards_per_step=3.0, predicted_draft_forwards_per_step=2.0)
    assert at_run_costs(m) == pytest.approx(2.5 * t_ar / (draft * 2 / 3 + verify))


def test_the_self_draft_law_is_the_loops_draft_over_the_full_prefix_kv(run_config, tiny_models):
    """Draft & Verify's first draft in the loop runs the root through its sub-layers over the target's full
    KV of the prefix; the calibration's law at every root is that q (a sub-layer forward over the whole
    sequence is not: its later kept layers would read a prefix KV the skipped layers never fed)."""
    import torch
    from tqdm import tqdm

    from methods.core.engine import ModelEngine
    from methods.measurement.calibrate import _self_draft_law, _setup

    cfg = run_config(*SMALL, "method=draft_verify", "method.params.skip=config", "method.params.skip_mlp=[0]",
                     "method.params.gamma=4", "tree=chain", "tree.gamma=4")
    run = _setup(cfg, tiny_models, tqdm(disable=True))
    seq = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(3))
    roots = torch.arange(5, 11)
    law = _self_draft_law(run, seq, None, roots)
    engine, sub = ModelEngine(run.target.model), run.drafter.sub
    for i, r in enumerate(roots.tolist()):
        engine.reset()
        engine.prefill(seq[:r])
        loop = engine.extend(seq[r : r + 1], [-1], sub=sub).logits[-1]
        assert torch.allclose(law[i], loop, atol=1e-4), r
    engine.reset()
    whole = engine.extend(seq, list(range(-1, seq.numel() - 1)), sub=sub).logits[roots]
    assert not torch.allclose(whole, law, atol=1e-3)  # the former law: a different q


def _logged(drafter) -> list[list]:
    """Wrap a Draft & Verify drafter so that each step logs [threshold, drafts k, accepted j or None]."""
    log: list[list] = []
    propose, feedback = drafter.propose, drafter.feedback

    def logged_propose(ctx):
        th = drafter.threshold
        draft = propose(ctx)
        log.append([th, draft.tree.depth, None, ctx.max_new])
        return draft

    def logged_feedback(fb):
        log[-1][2] = len(fb.accepted) - 1
        feedback(fb)

    drafter.propose, drafter.feedback = logged_propose, logged_feedback
    return log


def test_the_exit_replay_is_the_loops_every_step(run_config, tiny_models):
    """Temperature 0: the calibration's chains (_exit_chains) replayed under the rule (replay_path) are the
    loop's steps on the same prompts — every kept step's threshold, draft length and accepted count, the
    rule carried from generation to generation with no update after a generation's last step (the loop gives
    it no feedback). A fast rule (ε = 0.1, no smoothing) makes a missed or extra update show."""
    import torch
    from tqdm import tqdm

    from methods.core.engine import ModelEngine
    from methods.core.loop import DecodeOptions, decode
    from methods.drafters.draft_verify import DraftVerifyDrafter
    from methods.measurement.calibrate import _exit_chains, _setup, _trajectories
    from specsim.config import Verifier

    cfg = run_config(*SMALL, "calibration.new_tokens=14", "calibration.prompts=3", "method=draft_verify",
                     "method.params.skip=config", "method.params.skip_mlp=[0]", "method.params.skip_attn=[1]",
                     "method.params.gamma=3", "tree=chain", "tree.gamma=3")
    run = _setup(cfg, tiny_models, tqdm(disable=True))
    seqs = _trajectories(run)
    runs = [_exit_chains(run, ids, seq) for ids, seq in zip(run.prompts, seqs)]
    rule = ExitRule(threshold=0.5, target_acceptance=0.6, step=0.1, beta1=0.0, beta2=0.0)
    drafter = DraftVerifyDrafter(run.drafter.sub, 3, run.sampling, rule)
    target = ModelEngine(run.target.model)
    drafter.attach(target)
    log = _logged(drafter)
    opts = DecodeOptions(Verifier.greedy, run.sampling, cfg.calibration.new_tokens)
    for ids, seq in zip(run.prompts, seqs):
        out = decode(target, drafter, ids, opts, torch.Generator().manual_seed(0))
        assert out.token_ids == seq[ids.numel():].tolist()  # the loop walks the calibration's trajectory
    tokens = sum(seq.numel() - ids.numel() for ids, seq in zip(run.prompts, seqs))
    replay = replay_path(runs, rule, 3, tokens)
    kept = [(th, k, j) for th, k, j, room in log if room >= 3]
    assert len({round(th, 6) for th, _, _ in kept}) > 2  # the rule moved
    assert len(replay.laws) == len(kept)
    assert replay.thresholds == pytest.approx([th for th, _, _ in kept])
    assert [law.drafted.argmax() for law in replay.laws] == [k for _, k, _ in kept]
    # a kept step that ended its generation got no feedback: its j is the replay's (steps are point laws)
    assert [int(law.joint.sum(0).argmax()) for law in replay.laws] == [
        j if j is not None else int(law.joint.sum(0).argmax()) for (_, _, j), law in zip(kept, replay.laws)]
    assert drafter.run_stats()["draft_steps"] == len(log)
    threshold = drafter.threshold
    drafter.clear_records()  # measure's after the warm-up: the counters restart, the rule's state carries
    assert drafter.run_stats()["draft_steps"] == 0 and drafter.threshold == threshold


def test_sampled_exit_chains_record_each_drafts_acceptance(run_config, tiny_models):
    """Sampled drafts (T = 1, the chain verifier): per root the drawn chain's confidences q(x_d) and the
    rejection rule's min(1, p(x_d)/q(x_d)); a draft skipping nothing is the target itself (every a_d = 1)."""
    from tqdm import tqdm

    from methods.measurement.calibrate import _exit_chains, _setup, _trajectories

    for skip, exact in (("[]", True), ("[0]", False)):
        cfg = run_config(*SMALL, "workload.temperature=1", "method=draft_verify", "method.verifier=chain",
                         "method.params.skip=config", f"method.params.skip_mlp={skip}",
                         "method.params.gamma=3", "tree=chain", "tree.gamma=3")
        run = _setup(cfg, tiny_models, tqdm(disable=True))
        assert run.drafter.sample
        seqs = _trajectories(run)
        confs, acc = _exit_chains(run, run.prompts[0], seqs[0], sampled=True)
        assert len(confs) == len(acc) == seqs[0].numel() - run.prompts[0].numel()
        assert [len(c) for c in confs] == [len(a) for a in acc] == [3, 3, 3, 3, 2, 1]
        flat = [x for a in acc for x in a]
        assert all(0 < c <= 1 for cc in confs for c in cc) and all(0 <= x <= 1 for x in flat)
        if exact:
            assert flat == pytest.approx([1.0] * len(flat), abs=1e-4)
        else:
            assert min(flat) < 0.999
