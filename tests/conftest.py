"""Shared pytest setup: GPU tests, slow tests.

GPU tests (marked ``gpu``) need an sm_90 GPU and DASH's compiled kernels:

* on a machine without an sm_90 GPU they are skipped, with the reason;
* on a machine WITH an sm_90 GPU they fail, with the reason, when the kernels cannot be
  loaded (not built, built for another Python or torch, built from other sources than this
  checkout): a GPU run that silently skipped every GPU test would prove nothing.

Slow tests (marked ``slow``: 1000-repeat determinism runs) run with ``-m slow`` or
``DASH_RUN_SLOW=1`` and are skipped otherwise.

Random draws are fresh every session and reproducible from a failure: ``DASH_TEST_SALT`` (set
here unless given, printed in pytest's header) is added to every seed the GPU test modules
derive (their failure messages name seed and salt), and PyTorch's global generators are
seeded per test from its node id and the salt, so that a draw without an explicit generator
(``torch.randn_like``) is reproducible too: rerun with the printed ``DASH_TEST_SALT``.

``cpu_as_sm90``: CPU tensors pass the entry points' checks as if on an sm_90 device, and the
ops they would launch are recorders, so CPU tests can assert what reaches the kernels.

``pytest`` imports the *installed* dash (--import-mode=importlib, see pyproject.toml);
``python -m pytest`` from the repository root imports the checkout's dash/, which holds the
same kernels after ``pip install --no-build-isolation .`` (setup.py places them there too).
"""

from __future__ import annotations

import os
import sys

import pytest

# One salt per session, shared by every module that reads DASH_TEST_SALT at import
# (tests/seeding.py): fixed here, before any of them is imported, unless the caller set it.
os.environ.setdefault("DASH_TEST_SALT", str(int.from_bytes(os.urandom(2), "little")))

# The test modules share tests/seeding.py; importlib mode (pyproject.toml) leaves sys.path alone,
# so this folder goes on it here, before they are imported. (Nothing in it is named like a
# package the tests import, so the installed dash is still the one imported.)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seeding import SALT, seed_of


def pytest_report_header(config):
    return f"DASH_TEST_SALT={SALT} (set it to rerun a failure on the same random draws)"


@pytest.fixture(autouse=True)
def _seed_global_generators(request):
    """PyTorch's global generators (CPU and every CUDA device), seeded from the test's node id
    and the salt before each test."""
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(seed_of(request.node.nodeid))

_GPU_STATE: tuple[str, str | None] | None = None  # ("skip" | "fail" | "run", reason)


def gpu_test_policy(has_torch: bool, cuda_available: bool, capability: tuple[int, int] | None,
                    kernels: tuple[bool, str | None]) -> tuple[str, str | None]:
    """What GPU tests do on a machine: ("run", None), ("skip", why) or ("fail", why)."""
    if not has_torch:
        return "skip", "torch is not installed"
    if not cuda_available:
        return "skip", "no CUDA GPU (CPU-only machine)"
    if capability != (9, 0):
        return "skip", f"GPU has compute capability {capability[0]}.{capability[1]}; DASH's kernels need 9.0"
    ok, why = kernels
    return ("run", None) if ok else ("fail", f"this machine has an sm_90 GPU but DASH's kernels are not usable: {why}")


def sm90_state() -> tuple[str, str | None]:
    """gpu_test_policy for this machine (computed once)."""
    global _GPU_STATE
    if _GPU_STATE is None:
        try:
            import torch
        except ImportError:
            _GPU_STATE = gpu_test_policy(False, False, None, (False, None))
            return _GPU_STATE
        available = torch.cuda.is_available()
        cc = torch.cuda.get_device_capability(0) if available else None
        kernels = (False, None)
        if available and cc == (9, 0):
            from dash._ext import kernels_status

            kernels = kernels_status()
        _GPU_STATE = gpu_test_policy(True, available, cc, kernels)
    return _GPU_STATE


def sm90_skip_reason() -> str | None:
    """Why GPU tests cannot run here (None when they can)."""
    state, why = sm90_state()
    return None if state == "run" else why


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items):
        state, why = sm90_state()
        if state == "skip":
            for item in items:
                if "gpu" in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: {why}"))
    run_slow = os.environ.get("DASH_RUN_SLOW") == "1" or "slow" in (config.getoption("-m") or "")
    if not run_slow:
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="slow test (run with -m slow or DASH_RUN_SLOW=1)"))


def pytest_runtest_setup(item):
    if "gpu" in item.keywords:
        state, why = sm90_state()
        if state == "fail":
            pytest.fail(why, pytrace=False)


@pytest.fixture
def cpu_as_sm90(monkeypatch):
    """CPU tensors validated as on an sm_90 device (only the device checks are patched), with
    the ops that dash.api's and dash.flash_attn_interface's entry points launch replaced by
    recorders: yields the list of calls, each a dict of the op's arguments by name."""
    import torch

    from dash import _ext, api, validation
    from dash import flash_attn_interface as fai

    monkeypatch.setattr(validation, "check_cuda_devices", lambda q, k, v: None)
    monkeypatch.setattr(validation, "cuda_device_info", lambda index: ((9, 0), 132))
    monkeypatch.setattr(validation, "_check_built", lambda head_dim, dtype: None)
    monkeypatch.setattr(_ext, "require_kernels", lambda: None)
    calls = []

    def run_forward(q, k, v, softmax_scale, causal, deterministic, schedule, sm_margin):
        calls.append(dict(q=q, k=k, v=v, softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                          schedule=schedule, sm_margin=sm_margin))
        return torch.zeros(q.shape, dtype=q.dtype), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def run_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, schedule, sm_margin):
        calls.append(dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse, softmax_scale=softmax_scale,
                          causal=causal, deterministic=deterministic, schedule=schedule, sm_margin=sm_margin))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def run_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                           deterministic, schedule, sm_margin):
        calls.append(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                          causal=causal, deterministic=deterministic, schedule=schedule, sm_margin=sm_margin))
        return torch.zeros(q.shape, dtype=q.dtype), torch.zeros(q.shape[1], q.shape[0])

    for module in (api, fai):
        monkeypatch.setattr(module, "run_forward", run_forward)
        monkeypatch.setattr(module, "run_backward", run_backward)
    def run_backward_varlen(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, deterministic, schedule, sm_margin):
        calls.append(dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                          softmax_scale=softmax_scale, causal=causal, deterministic=deterministic, schedule=schedule,
                          sm_margin=sm_margin))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(api, "run_forward_varlen", run_forward_varlen)
    monkeypatch.setattr(fai, "run_backward_varlen", run_backward_varlen)
    validation._VALID_CALLS.clear()  # CPU keys must not outlive the patched device checks
    yield calls
    validation._VALID_CALLS.clear()
