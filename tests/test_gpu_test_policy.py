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
