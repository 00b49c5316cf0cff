"""The backward's FMA-pipe exponential (``detail::exp2_fma`` in csrc/kernels/mma_utils.h), checked
on the CPU: its constants are read from the header and its float32 arithmetic replayed step by
step, so an edit of the polynomial or the
shifter that loses accuracy, or the exact zero of masked scores, fails here without a GPU. The
kernel's gradients against the float64 reference are tests/test_bwd_gpu.py's."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "kernels" / "mma_utils.h"


def _body() -> str:
    text = HEADER.read_text()
    m = re.search(r"float exp2_fma\(float x\) \{(.*?)\n\}", text, re.S)
    assert m, "exp2_fma not found in mma_utils.h"
    return m.group(1)


def _constants() -> tuple[float, float, list[float]]:
    body = _body()
    clamp = float(re.search(r"fmaxf\(x, (-?[0-9.]+)f\)", body).group(1))
    shifter = float(re.search(r"shifter = ([0-9.]+)f", body).group(1))
    poly = re.search(r"p = (fmaf\(.*\));", body).group(1)
    coeffs = [float(c) for c in re.findall(r"(-?[0-9]+\.[0-9]+)f", poly)]
    return clamp, shifter, coeffs


def _f32(x) -> np.float32:
    return np.float32(x)


def _fmaf(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """fmaf: a * b is exact in float64 (two 24-bit significands); the sum is rounded to float64
    and then float32, which differs from fmaf's single rounding at most by one float32 ulp in
    rare ties, far below the bounds checked here."""
    return np.float32(float(a) * float(b) + float(c))


def exp2_fma(x: float) -> np.float32:
    """The header's exp2_fma, one float32 operation at a time."""
    clamp, shifter, (c3, c2, c1) = _constants()
    x = _f32(x)
    x = np.maximum(x, _f32(clamp)) if not np.isnan(x) else _f32(clamp)
    t = _f32(x + _f32(shifter))
    f = _f32(x - _f32(t - _f32(shifter)))
    p = _fmaf(_fmaf(_fmaf(_f32(c3), f, _f32(c2)), f, _f32(c1)), f, _f32(1.0))
    bits = (int(p.view(np.int32)) + ((int(t.view(np.int32)) << 23) & 0xFFFFFFFF)) & 0xFFFFFFFF
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def test_constants_are_the_ones_analysed():
    clamp, shifter, coeffs = _constants()
    assert clamp == -127.0 and shifter == 1.5 * 2**23 and len(coeffs) == 3


@pytest.mark.parametrize("lo,hi,n", [(-1.0, 0.0, 4001), (-30.0, -1.0, 4001), (-126.0, -30.0, 2001)])
def test_relative_error_well_below_a_bf16_ulp(lo, hi, n):
    """P and dS are rounded to bf16 (relative spacing 2^-8) for their GEMMs; the polynomial's
    error must stay far below that: 2e-4 relative over the normal range."""
    xs = np.linspace(lo, hi, n)
    worst = max(abs(float(exp2_fma(x)) / 2.0 ** float(np.float32(x)) - 1.0) for x in xs)
    assert worst < 2e-4, worst


def test_masked_scores_give_exact_zero_and_zero_gives_one():
    """ex2.approx.ftz(-inf) = +0 is how masked scores vanish; the FMA twin must match it."""
    for x in (-np.inf, -1e30, -200.0, -127.0):
        y = exp2_fma(x)
        assert y == 0.0 and not np.signbit(y), (x, y)
    for x in (-126.9, -126.6, -126.4, -126.01):  # ex2.approx.ftz gives +0; this a subnormal below 2^-126
        y = exp2_fma(x)
        assert 0.0 <= float(y) < 2.0**-126, (x, y)
    assert exp2_fma(0.0) == 1.0
    assert exp2_fma(-1.0) == pytest.approx(0.5, rel=2e-4)


def test_monotone_across_integer_boundaries():
    """Where round(x) switches (x = k + 0.5), the two polynomial ends meet: no step backwards
    larger than the polynomial's error."""
    for k in range(-20, 0):
        below, above = exp2_fma(k + 0.5 - 1e-6), exp2_fma(k + 0.5 + 1e-6)
        assert float(above) >= float(below) * (1 - 3e-4), (k, below, above)
