"""Shared pytest setup: GPU skipping and markers.

Tests import the *installed* dash (pytest runs with --import-mode=importlib, see
pyproject.toml), so GPU tests exercise the compiled extension that was installed. To test
an uninstalled source tree, set PYTHONPATH to the repository root and build in place
(python setup.py build_ext --inplace)."""

from __future__ import annotations

import os

import pytest


def sm90_skip_reason() -> str | None:
    """None when an sm_90 GPU and DASH's kernels are usable, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU (CPU-only machine)"
    cc = torch.cuda.get_device_capability(0)
    if cc != (9, 0):
        return f"GPU has compute capability {cc[0]}.{cc[1]}; DASH's kernels need 9.0"
    from dash._ext import kernels_available, manifest

    if not kernels_available():
        return f"DASH kernels not available: {manifest().get('reason_not_built') or 'dash._C failed to import'}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "gpu" in item.keywords:
            if not checked:
                reason = sm90_skip_reason()
                checked = True
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: {reason}"))
    run_slow = os.environ.get("DASH_RUN_SLOW") == "1" or "slow" in (config.getoption("-m") or "")
    if not run_slow:
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="slow test (run with -m slow or DASH_RUN_SLOW=1)"))
