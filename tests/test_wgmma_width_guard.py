"""The kernels' guard against CuTe's silent narrow-WGMMA fallback (csrc/kernels/mma_utils.h,
kOneWgmmaWide), compiled for sm_90a (no GPU): a 64 x 176 GEMM tile is one instruction wide only
when CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED is defined; without it CuTe picks 64 x 16 instructions,
which is what cost a 128 x 176 forward tile 28 % (docs/kernel-notes.md, eighth pass). The test
proves the guard sees that fallback and passes the widths of dash/config.py's tiles (64, 128,
192); the kernels' own tiles are checked where they are built (fwd_traits.h, bwd_traits.h).
Skips when tools/check_kernels.py finds no nvcc or no CUTLASS headers."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "check_kernels.py"

PROBE = r"""
#include "kernels/mma_utils.h"
using namespace cute;
template <int N>
using QK = decltype(make_tiled_mma(GMMA::ss_op_selector<cutlass::bfloat16_t, cutlass::bfloat16_t, float,
                                                        Shape<_64, Int<N>, _128>, GMMA::Major::K, GMMA::Major::K>()));
// The widths the kernels use (dash/config.py: 64, 128 and 192) are one instruction wide either way.
static_assert(dash::kOneWgmmaWide<QK<64>, 64> && dash::kOneWgmmaWide<QK<128>, 128> &&
              dash::kOneWgmmaWide<QK<192>, 192>, "power-of-two-sized tiles");
#ifdef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
static_assert(dash::kOneWgmmaWide<QK<176>, 176>, "176 is one instruction with the extended shapes");
#else
static_assert(!dash::kOneWgmmaWide<QK<176>, 176>, "176 falls back to narrow instructions without them");
#endif
"""


def _toolchain():
    spec = importlib.util.spec_from_file_location("check_kernels", SCRIPT)
    ck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ck)
    try:
        return ck.find_nvcc(), ck.find_cutlass()
    except SystemExit as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("extended", [False, True], ids=["default-shapes", "extended-shapes"])
def test_guard_detects_the_narrow_fallback(tmp_path, extended):
    nvcc, cutlass = _toolchain()
    src = tmp_path / "probe.cu"
    src.write_text(PROBE)
    cmd = [nvcc, "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
           "-I", str(ROOT / "csrc"), "-I", str(cutlass), "-c", str(src), "-o", str(tmp_path / "probe.o")]
    if extended:
        cmd.insert(1, "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail("nvcc did not finish compiling the probe in 900 s (a loaded machine?); not a guard failure")
    assert proc.returncode == 0, proc.stderr[-3000:]
