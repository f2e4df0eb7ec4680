"""τ's sampling error and the measurement loop's sequential stopping rule (specsim.tau_error)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specsim.tau_error import (
    MIN_PROMPTS,
    by_cluster,
    precise_enough,
    tau_prompt_standard_error,
    tau_relative_standard_error,
)


def test_relative_error_is_the_larger_of_the_step_and_prompt_errors():
    # two prompts of τ 1 and 3 (5 steps each): prompt-wise s.e. 1 (their half-difference), step-wise
    # std(ddof=1) of five 1s and five 3s / sqrt(10) = 1.054 / 3.162 = 0.333; τ = 2
    per_prompt = [[1] * 5, [3] * 5]
    assert tau_relative_standard_error(per_prompt) == pytest.approx(tau_prompt_standard_error(per_prompt) / 2)
    mixed = [[1, 3] * 5, [3, 1] * 5]  # every prompt alike, the steps spread: the step-wise error wins
    steps = np.array([1, 3] * 10, dtype=float)
    assert tau_relative_standard_error(mixed) == pytest.approx(steps.std(ddof=1) / math.sqrt(20) / 2)
    assert math.isnan(tau_relative_standard_error([[2, 2, 2]]))  # one prompt: no prompt-wise error


def test_prompts_of_one_module_are_one_sampled_unit():
    """Two modules, each prompt of a module alike (τ 1 and 3): eight prompts read a prompt-wise error as if
    eight draws, the module-wise one is that of two draws, and it is the one taken."""
    per_prompt = [[1] * 5] * 4 + [[3] * 5] * 4
    modules = ["a"] * 4 + ["b"] * 4
    assert by_cluster(per_prompt, modules) == [[1] * 20, [3] * 20]
    prompt_wise = tau_relative_standard_error(per_prompt)
    clustered = tau_relative_standard_error(per_prompt, modules)
    assert clustered == pytest.approx(tau_prompt_standard_error([[1] * 20, [3] * 20]) / 2)
    assert clustered > 2 * prompt_wise
    # one prompt per module: the module-wise error is the prompt-wise one
    assert tau_relative_standard_error(per_prompt, list("abcdefgh")) == pytest.approx(prompt_wise)
    # one module: no module-wise error (NaN), the others stand
    assert tau_relative_standard_error(per_prompt, ["a"] * 8) == pytest.approx(prompt_wise)
    assert not precise_enough(per_prompt * 2, prompt_wise, clusters=modules * 2, min_prompts=2)
    assert precise_enough(per_prompt * 2, prompt_wise, min_prompts=2)
    with pytest.raises(ValueError):
        by_cluster(per_prompt, modules[:-1])


def test_the_rule_waits_for_min_prompts_then_stops_at_the_target():
    steady = [[2, 2, 2, 2]] * (MIN_PROMPTS - 1)
    assert not precise_enough(steady, 0.5)  # too few prompts, however precise
    assert precise_enough([*steady, [2, 2, 2, 2]], 0.012)  # no spread at all: s.e. 0
    noisy = [[1] * 5, [3] * 5] * (MIN_PROMPTS // 2 + 1)
    se = tau_relative_standard_error(noisy)
    assert not precise_enough(noisy, se * 0.99) and precise_enough(noisy, se * 1.01)
    # more prompts of the same spread: the error falls as 1/sqrt(n) and the rule stops
    many = noisy * 8
    assert tau_relative_standard_error(many) < se / 2.5 and precise_enough(many, se / 2.5)
