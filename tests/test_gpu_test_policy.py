"""The GPU-test policy of tests/conftest.py: skip without an sm_90 GPU, fail (never skip) on a
machine with one whose DASH kernels cannot be loaded, run otherwise."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("dash_tests_conftest", Path(__file__).with_name("conftest.py"))
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)
policy = conftest.gpu_test_policy


def test_no_gpu_or_another_gpu_skips_with_the_reason():
    assert policy(False, False, None, (False, None)) == ("skip", "torch is not installed")
    assert policy(True, False, None, (True, None))[0] == "skip"
    state, why = policy(True, True, (8, 0), (True, None))
    assert state == "skip" and "8.0" in why and "9.0" in why


def test_an_sm90_machine_without_loadable_kernels_fails_with_the_reason():
    state, why = policy(True, True, (9, 0), (False, "the kernels were built for Python 3.12, this is Python 3.11"))
    assert state == "fail" and "sm_90 GPU" in why and "Python 3.12" in why


def test_an_sm90_machine_with_kernels_runs():
    assert policy(True, True, (9, 0), (True, None)) == ("run", None)


def test_the_grid_independence_shapes_still_let_the_model_choose_per_grid():
    """The GPU tests that auto's bits do not depend on the grid need shapes where the model, were
    it free to rank for the launched grid, would pick differently on some grid (their own
    precondition, else they could not see a per-grid choice). A model change can take that away:
    checked here, on the CPU."""
    import pytest

    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("dash_tests_schedules_gpu",
                                                  Path(__file__).with_name("test_schedules_gpu.py"))
    gpu_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_tests)
    from dash.schedules.auto import rank_kernel_schedules

    cases = [(hd, causal, shape) for (hd, causal), shape in gpu_tests.AUTO_PER_GRID_SHAPES.items()]
    cases.append((128, True, gpu_tests.AUTO_GRID_SHAPE))
    for head_dim, causal, (batch, seqlen, heads, heads_kv) in cases:
        # Each sm_margin must launch its own grid: the grid is min(SMs - margin, columns), so a
        # shape with fewer columns than a 132-SM part's SMs runs two margins on one grid.
        columns = gpu_tests._columns(batch, heads, seqlen, head_dim, causal)
        assert columns >= 132, (head_dim, causal, (batch, seqlen, heads, heads_kv), columns)
        picks = {ctas: rank_kernel_schedules(batch, heads, heads_kv, seqlen, seqlen, head_dim, causal, ctas)[0][0]
                 for ctas in (132, 131, 114, 78)}
        assert len(set(picks.values())) > 1, (head_dim, causal, (batch, seqlen, heads, heads_kv), picks)
