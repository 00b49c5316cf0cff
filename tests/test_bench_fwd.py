"""benchmarks/bench_fwd.py as far as a CPU can check it: the modes it times per library and
its refusal without a GPU (the timings themselves need an sm_90 GPU)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_fwd.py"


def _load():
    if not SCRIPT.is_file():
        pytest.skip("no benchmarks/ beside the tests (not a source checkout)")
    spec = importlib.util.spec_from_file_location("bench_fwd", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_modes_per_library():
    mod = _load()
    libs = {name: None for name in ("dash", "dash_op", "torch_cudnn", "fa3")}
    modes = mod.modes_for(libs)
    assert modes["dash_fwd_op"] == ("dash_op", "fwd", False)
    assert modes["dash_det_fwdbwd"] == ("dash", "fwdbwd", True)
    assert modes["dash_nondet_fwdbwd"] == ("dash", "fwdbwd", False)
    assert modes["fa3_det_fwdbwd"] == ("fa3", "fwdbwd", True)
    assert modes["torch_cudnn_fwdbwd"] == ("torch_cudnn", "fwdbwd", False)
    assert "dash_op_fwd" not in modes and "dash_op_fwdbwd" not in modes
    assert {m for m, (_, kind, _) in modes.items() if kind == "fwd"} == {
        "dash_fwd_op", "dash_fwd", "torch_cudnn_fwd", "fa3_fwd"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the benchmark would run")
def test_refuses_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert "needs a CUDA GPU" in proc.stderr
    assert not any(tmp_path.iterdir())
