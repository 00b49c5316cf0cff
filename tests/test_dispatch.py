"""The kernel dispatch and the translation units come from one list (dash.config renders
both): compile csrc/{fwd,bwd}_dispatch.cpp on the host against a rendered dispatch.h with
stand-in kernels (tests/cpp/dispatch_probe.cpp) and check that every (pass, head dim, dtype)
runs its own unit, and that a build with a subset refuses the rest with "not built"."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from dash import config
from dash._build import resolve_cuda_home, toolkit_headers

ROOT = Path(__file__).resolve().parents[1]
DTYPE_CODES = {"bfloat16": 0, "float16": 1}


def _build_probe(tmp: Path, head_dims, dtypes) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    home, why = resolve_cuda_home()
    if cxx is None or home is None or toolkit_headers(home) is None:
        pytest.skip(f"needs a host C++ compiler and the CUDA runtime headers ({why or 'no C++ compiler'})")
    # The dispatch sources sit beside their own generated/ folder, so that their
    # #include "generated/..." finds this rendering, not the checkout's.
    config.write_generated(str(tmp / "generated"), head_dims, dtypes)
    for src in ("bwd_dispatch.cpp", "fwd_dispatch.cpp"):
        shutil.copy(ROOT / "csrc" / src, tmp / src)
    lib = tmp / "dispatch_probe.so"
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(ROOT / "csrc"),
                    "-I", str(toolkit_headers(home)), str(tmp / "bwd_dispatch.cpp"), str(tmp / "fwd_dispatch.cpp"),
                    str(ROOT / "tests" / "cpp" / "dispatch_probe.cpp"), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def _expected(pass_code: int, head_dim: int, dtype: str) -> int:
    return pass_code * 1000 + head_dim * 10 + (1 if dtype == "bfloat16" else 2)


def test_every_unit_is_dispatched_to_itself(tmp_path):
    probe = _build_probe(tmp_path, config.SUPPORTED_HEAD_DIMS, config.SUPPORTED_DTYPES)
    for pass_code in (1, 2):
        for d in config.SUPPORTED_HEAD_DIMS:
            for dt in config.SUPPORTED_DTYPES:
                assert probe.probe_dispatch(pass_code, d, DTYPE_CODES[dt]) == _expected(pass_code, d, dt)
    assert probe.probe_dispatch(1, 96, 0) == -1 and probe.probe_dispatch(2, 256, 1) == -1


def test_a_subset_build_refuses_the_units_it_left_out(tmp_path):
    probe = _build_probe(tmp_path, (128,), ("bfloat16",))
    for pass_code in (1, 2):
        assert probe.probe_dispatch(pass_code, 128, 0) == _expected(pass_code, 128, "bfloat16")
        assert probe.probe_dispatch(pass_code, 128, 1) == -1
        assert probe.probe_dispatch(pass_code, 64, 0) == -1
    assert probe.probe_is_built(128, 0) == 1 and probe.probe_is_built(64, 0) == 0


def test_rendered_units_name_their_instantiation():
    units = config.render_instantiations((64,), ("float16",))
    assert set(units) == {"fwd_hdim64_fp16.cu", "bwd_hdim64_fp16.cu"}
    assert "template void run_fwd_hdim<64, cutlass::half_t>(FwdParams const&, cudaStream_t);" in units[
        "fwd_hdim64_fp16.cu"]
    assert '#include "kernels/bwd_launch.h"' in units["bwd_hdim64_fp16.cu"]
    # The 80-row backward tile needs CuTe's extended WGMMA widths, defined before any CuTe header.
    for text in units.values():
        define = text.index("#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED")
        assert define < text.index("#include")


def test_write_generated_removes_units_of_another_choice(tmp_path):
    config.write_generated(str(tmp_path), (64, 128), ("bfloat16",))
    config.write_generated(str(tmp_path), (128,), ("bfloat16",))
    names = sorted(p.name for p in (tmp_path / "instantiations").iterdir())
    assert names == ["bwd_hdim128_bf16.cu", "fwd_hdim128_bf16.cu"]
    with pytest.raises(ValueError, match="head_dim 96"):
        config.write_generated(str(tmp_path), (96,), ("bfloat16",))


def test_host_sizing_follows_the_config_table(tmp_path):
    """bwd_block_n (GQA semaphore sizing) and bwd_trace_steps take the tile of the head dim *and
    mask* from the table, for every head dim it lists, and refuse one it does not list."""
    from dash.schedules import Problem, tile_problem

    probe = _build_probe(tmp_path, config.SUPPORTED_HEAD_DIMS, config.SUPPORTED_DTYPES)
    probe.probe_trace_steps.restype = ctypes.c_longlong
    for d in config.SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            assert probe.probe_block_n(d, int(causal)) == config.bwd_tile_config(d, causal).block_n
            for sq, sk in ((1000, 1000), (300, 1300), (1300, 300)):
                steps = tile_problem(Problem(1, 1, sq, sk, head_dim=d, causal=causal)).total_steps
                assert probe.probe_trace_steps(d, int(causal), sq, sk) == steps
    assert probe.probe_block_n(96, 0) == -1 and probe.probe_trace_steps(256, 1, 128, 128) == -1
