"""benchmarks/bench_varlen.py on the CPU: its mixes and FLOP count, and a clean refusal without a GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_varlen.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_varlen", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mix", ["uniform", "skewed"])
def test_mixes_are_fixed_and_fill_the_tokens(mix):
    b = _module()
    lengths = b.lengths_of(mix)
    assert sum(lengths) == b.TOKENS and min(lengths) >= 1
    assert lengths == b.lengths_of(mix)  # a fixed function of the mix
    if mix == "skewed":
        assert max(lengths) >= 0.45 * b.TOKENS and len(lengths) > 10
    with pytest.raises(ValueError, match="unknown mix"):
        b.lengths_of("other")


def test_flops_are_the_sum_over_sequences():
    b = _module()
    assert b.attention_flops([3, 5], 2, 64, False) == 4.0 * 2 * 64 * (9 + 25)
    assert b.attention_flops([3, 5], 2, 64, True) == 0.5 * b.attention_flops([3, 5], 2, 64, False)


def test_refuses_cleanly_without_a_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: the benchmark would run")
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 1 and "needs an sm_90 GPU" in p.stderr and "Traceback" not in p.stderr
    assert not any(tmp_path.iterdir())


def test_results_meta_names_the_kernels_commit_and_the_code():
    b = _module()
    from dash._ext import manifest

    meta = b.results_meta("GPU X", "2026-12-06T00:00:00+00:00", "2.x", 10)
    assert meta["kind"] == "varlen" and meta["device"] == "GPU X" and meta["iters"] == 10
    assert meta["commit"] == manifest().get("git_commit") and meta["build"] == manifest()
    assert meta["round_orders"] == "williams"  # which timer ordering produced the file
    assert len(meta["code_sha256"]) == 16 and "checkout_describe" in meta
