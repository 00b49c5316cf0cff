"""The kernel's schedule (csrc/schedule/schedule.h, compiled here for the host) must follow
the scheduling model (dash.schedules, the specification) exactly: item order, Q-tile visit
order and every turn. CPU-only; needs a C++ compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dash.schedules import Problem, make_plan
from dash.schedules.tiling import tile_problem

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    lib = tmp_path_factory.mktemp("probe") / "schedule_probe.so"
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(ROOT / "csrc"),
                    str(ROOT / "tests" / "cpp" / "schedule_probe.cpp"), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def _kernel_fa3(probe, sq, sk, bm, bn, causal, H, B, det):
    N, M = -(-sk // bn), -(-sq // bm)
    cols = np.zeros(3 * N * H * B, dtype=np.int32)
    steps = np.zeros(N, dtype=np.int32)
    visit = np.zeros(N * M, dtype=np.int32)
    turns = np.zeros(M * N, dtype=np.int32)
    ptr = lambda a: a.ctypes.data_as(ctypes.POINTER(ctypes.c_int))  # noqa: E731
    count = probe.dash_fa3_probe(sq, sk, bm, bn, int(causal), H, B, int(det), ptr(cols), ptr(steps), ptr(visit),
                                 ptr(turns))
    return count, cols.reshape(-1, 3), steps, visit.reshape(N, M), turns.reshape(M, N)


def _check(probe, B, H, sq, sk, bm, bn, causal):
    p = Problem(B, H, sq, sk, causal=causal, block_m=bm, block_n=bn)
    plan = make_plan(p, "fa3", 7)
    t = tile_problem(p)
    count, cols, steps, visit, turns = _kernel_fa3(probe, sq, sk, bm, bn, causal, H, B, det=True)
    # Item order: the model's claim order (item L = k + N*(h + H*b), causal reversed per head).
    N = t.nmax
    assert count == B * H * N
    for L in range(count):
        k, h, b = L % N, (L // N) % H, L // (N * H)
        assert tuple(cols[L]) == ((N - 1 - k) if causal else k, h, b)
    # Visits and turns of every column (identical for every head).
    for n in range(N):
        want = plan.visit(0, 0, n)
        assert steps[n] == len(want)
        assert list(visit[n, : steps[n]]) == list(want)
    assert np.array_equal(turns, plan.turn[0, 0])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(1, 1), (239, 1), (113, 203), (1023, 1024), (4224, 4224), (1000, 777),
                                    (128, 4096), (4096, 128)])
@pytest.mark.parametrize("bm, bn", [(64, 128), (128, 128)])
def test_fa3_kernel_schedule_equals_model(probe, sq, sk, bm, bn, causal):
    _check(probe, 2, 3, sq, sk, bm, bn, causal)


@settings(max_examples=60, deadline=None)
@given(sq=st.integers(1, 3000), sk=st.integers(1, 3000), causal=st.booleans(), tiles=st.sampled_from([(64, 128), (128, 128)]))
def test_fa3_kernel_schedule_equals_model_random_shapes(probe, sq, sk, causal, tiles):
    _check(probe, 1, 2, sq, sk, tiles[0], tiles[1], causal)


@settings(max_examples=80, deadline=None)
@given(sq=st.integers(1, 700), sk=st.integers(1, 700), causal=st.booleans(), tiles=st.sampled_from([(64, 128), (128, 128)]))
def test_kernel_masks_exactly_the_tiles_with_masked_pairs(probe, sq, sk, causal, tiles):
    """needs_mask(m, n) is true iff the tile holds a (query, key) pair the mask hides
    (keys past seqlen_k, or right of the bottom-right diagonal), computed by brute force."""
    bm, bn = tiles
    i = np.arange(-(-sq // bm) * bm)[:, None]
    j = np.arange(-(-sk // bn) * bn)[None, :]
    hidden = (j >= sk) | ((j > i + sk - sq) if causal else np.zeros_like(i, dtype=bool))
    for m in range(-(-sq // bm)):
        for n in range(-(-sk // bn)):
            want = bool(hidden[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn].any())
            assert probe.dash_needs_mask(sq, sk, bm, bn, int(causal), m, n) == int(want), (m, n)
