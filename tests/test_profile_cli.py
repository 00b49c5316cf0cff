"""``python -m dash profile`` without a GPU, its argument checks and suggested command lines,
and the standalone backward runner (tools/runner/bwd_runner.cu) as far as a CPU can check it.

What needs a GPU (the profiled run itself, ncu and nsys capturing it, the runner's timings)
is run by hand on an H200: see the 'Profiling' section of the README.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import dash
from dash import profile
from dash.config import KERNEL_SCHEDULES

#: Folder holding the dash package under test; subprocesses import the same dash.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dash.__file__)))
#: The repository checkout these tests live in (csrc/ and tools/ are read from it, not from
#: an installed package, which has neither).
CHECKOUT = Path(__file__).resolve().parents[1]
RUNNER_SOURCE = CHECKOUT / "tools" / "runner" / "bwd_runner.cu"


def _sm90_usable() -> bool:
    """What ``profile`` itself checks before running: an sm_90 GPU and loadable kernels."""
    from dash._bench import _gpu_ok

    try:
        return _gpu_ok()[0]
    except ImportError:
        return False


def _assert_one_line(err: str) -> None:
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, f"expected one line on stderr, got:\n{err}"


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    from dash.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------------------------------
# Without a GPU
# ---------------------------------------------------------------------------------------
def test_without_gpu_fails_with_one_line_subprocess(tmp_path):
    if _sm90_usable():
        pytest.skip("an sm_90 GPU with DASH's kernels is present: profile runs")
    p = subprocess.run([sys.executable, "-m", "dash", "profile", "--seqlen", "1024", "--hdim", "64", "--causal"],
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and p.stdout == ""
    _assert_one_line(p.stderr)
    assert p.stderr.startswith("python -m dash profile: error: needs an sm_90 GPU with DASH's kernels (")
    assert "python -m dash simulate" in p.stderr  # what to do instead


def test_without_gpu_fails_in_process(capsys):
    if _sm90_usable():
        pytest.skip("an sm_90 GPU with DASH's kernels is present: profile runs")
    rc, out, err = _main(["profile"], capsys)
    assert rc == 1 and out == ""
    _assert_one_line(err)
    assert "needs an sm_90 GPU" in err


# ---------------------------------------------------------------------------------------
# Bad input: one line naming the argument and the value, exit 2, before any GPU work
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["--seqlen", "0"], "argument --seqlen: 0 is not a positive integer"),
    (["--seqlen", "4k"], "argument --seqlen: 4k is not a positive integer"),
    (["--hdim", "96"], "argument --hdim: head_dim=96 is not supported"),
    (["--batch", "0"], "argument --batch: 0 is not a positive integer"),
    (["--heads", "-1"], "argument --heads: -1 is not a positive integer"),
    (["--heads-kv", "0"], "argument --heads-kv: 0 is not a positive integer"),
    (["--iters", "0"], "argument --iters: 0 is not a positive integer"),
    (["--warmup", "-1"], "argument --warmup: -1 is not a non-negative integer"),
    (["--dtype", "fp32"], "argument --dtype: 'fp32' is not supported; choose bf16 or fp16"),
    (["--schedule", "bogus"], "argument --schedule: 'bogus' is not a kernel schedule; choose auto, "
                              + ", ".join(KERNEL_SCHEDULES)),
    (["--schedule", "symmetric_shift"], "argument --schedule: 'symmetric_shift' is modelled (python -m dash "
                                        "simulate) but not implemented by the kernel yet"),
    (["--causal=yes"], "argument --causal/--no-causal: ignored explicit argument 'yes'"),
    # Combinations: checked after parsing, still before the GPU is looked at.
    (["--heads", "32", "--heads-kv", "3"], "argument --heads-kv: 3 does not divide the 32 query heads"),
    (["--hdim", "128", "--heads-kv", "5"], "argument --heads-kv: 5 does not divide the 16 query heads"),
    (["--schedule", "shift", "--causal"], "argument --schedule: 'shift' is for full masks; with --causal use auto"),
])
def test_bad_arguments_are_one_line_usage_errors(argv, expected, capsys):
    rc, out, err = _main(["profile", *argv], capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    assert err.startswith("python -m dash profile: error: "), err
    assert expected in err, err


@pytest.mark.parametrize("argv, expected", [
    (["--hdim", "64"], "argument --hdim: 64 is not built in this install; built: 128 (rebuild with DASH_HDIMS)"),
    (["--dtype", "fp16"], "argument --dtype: fp16 is not built in this install; built: bfloat16 "
                          "(rebuild with DASH_DTYPES)"),
])
def test_what_the_install_did_not_build_is_a_usage_error(argv, expected, capsys, monkeypatch):
    """With a GPU but kernels built for fewer head dims / dtypes, the line says what was built."""
    import dash._bench
    import dash._ext

    monkeypatch.setattr(dash._bench, "_gpu_ok", lambda: (True, ""))
    monkeypatch.setattr(dash._ext, "manifest", lambda: {"kernels_built": True, "head_dims": [128],
                                                        "dtypes": ["bfloat16"]})
    rc, out, err = _main(["profile", *argv], capsys)
    assert rc == 2 and out == ""
    _assert_one_line(err)
    assert expected in err, err


def test_modelled_schedules_are_refused_by_name():
    """Every schedule the model has but the kernel does not is refused as 'modelled'."""
    import argparse

    from dash.cli import kernel_schedule
    from dash.schedules.orders import SCHEDULE_NAMES

    for name in ("auto", *KERNEL_SCHEDULES):
        assert kernel_schedule(name) == name
    for name in set(SCHEDULE_NAMES) - set(KERNEL_SCHEDULES):
        with pytest.raises(argparse.ArgumentTypeError, match="modelled"):
            kernel_schedule(name)


def test_defaults_and_dtype_spellings():
    from dash.cli import build_parser

    args = build_parser().parse_args(["profile"])
    assert (args.seqlen, args.hdim, args.causal, args.dtype, args.deterministic, args.schedule) == (
        4096, 128, False, "bf16", True, "auto")
    assert profile.ProfileShape.from_args(args) == profile.ProfileShape(
        batch=4, seqlen=4096, heads=16, heads_kv=16, head_dim=128, causal=False, dtype="bf16")
    for text, want in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16"), ("float16", "fp16")):
        assert build_parser().parse_args(["profile", "--dtype", text]).dtype == want
    args = build_parser().parse_args(["profile", "--no-deterministic", "--causal", "--seqlen", "2048", "--hdim", "64"])
    assert args.deterministic is False and args.causal is True
    assert profile.ProfileShape.from_args(args) == profile.ProfileShape(
        batch=8, seqlen=2048, heads=32, heads_kv=32, head_dim=64, causal=True, dtype="bf16")


def test_help_lists_the_options(capsys):
    rc, out, _ = _main(["profile", "--help"], capsys)
    assert rc == 0
    for option in ("--seqlen", "--hdim", "--causal", "--batch", "--heads", "--heads-kv", "--dtype",
                   "--deterministic", "--no-deterministic", "--schedule", "--iters", "--warmup"):
        assert option in out, option


def test_profile_is_listed_among_the_commands(capsys):
    rc, out, _ = _main(["--help"], capsys)
    assert rc == 0 and "profile" in out


# ---------------------------------------------------------------------------------------
# The printed profiler command lines
# ---------------------------------------------------------------------------------------
def _commands(argv: list[str]) -> list[list[str]]:
    return [shlex.split(cmd) for _, cmd in profile.profiler_commands(argv, python="/opt/py/bin/python3")]


def test_commands_capture_only_the_profiled_iterations():
    argv = profile.ProfileShape(2, 8192, 16, 8, 128, True, "fp16").argv() + ["--schedule", "descending"]
    nsys, ncu_main, ncu_iter = _commands(argv)
    target = ["/opt/py/bin/python3", "-m", "dash", "profile", *argv]
    for cmd in (nsys, ncu_main, ncu_iter):
        assert cmd[-len(target):] == target  # the same run, every option spelled out
    assert nsys[:2] == ["nsys", "profile"] and "--capture-range=cudaProfilerApi" in nsys
    assert "--trace=cuda,nvtx" in nsys
    for ncu in (ncu_main, ncu_iter):
        assert ncu[0] == "ncu"
        assert ncu[ncu.index("--profile-from-start") + 1] == "off"
        assert ncu[ncu.index("--clock-control") + 1] == "none"
    assert ncu_main[ncu_main.index("--kernel-name") + 1] == "regex:^(bwd_main_kernel)$"
    assert ncu_main[ncu_main.index("--launch-count") + 1] == "1"
    assert "--nvtx" in ncu_iter and ncu_iter[ncu_iter.index("--nvtx-include") + 1] == "dash.profile iter 0"


def test_shape_argv_reparses_to_the_same_shape():
    from dash.cli import build_parser

    shape = profile.ProfileShape(3, 1536, 12, 4, 64, True, "fp16")
    args = build_parser().parse_args(["profile", *shape.argv()])
    assert profile.ProfileShape.from_args(args) == shape


def _global_kernel_names(root: Path) -> set[str]:
    """Names of the ``__global__`` functions under ``root`` (templates and __launch_bounds__ allowed)."""
    pattern = re.compile(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\s*\([^)]*\)\s*)?(?:void\s+)?(\w+)\s*\(")
    names = set()
    for path in root.rglob("*"):
        if path.suffix in (".h", ".hpp", ".cu", ".cuh"):
            names.update(pattern.findall(path.read_text()))
    return names


def test_kernel_table_matches_the_kernels_in_csrc():
    csrc = CHECKOUT / "csrc"
    if not csrc.is_dir():
        pytest.skip("no csrc/ beside the tests (not a source checkout)")
    in_csrc = _global_kernel_names(csrc)
    assert {"bwd_preprocess_kernel", "bwd_main_kernel", "bwd_convert_dq_kernel"} <= in_csrc, in_csrc
    unlisted = in_csrc - set(profile.DASH_KERNELS)
    assert not unlisted, f"add {sorted(unlisted)} to dash.profile.DASH_KERNELS (the profiler filters use it)"
    assert set(profile.DASH_KERNELS) <= in_csrc


def test_kernel_regex_matches_dash_kernels_only():
    pattern = re.compile(profile.kernel_name_regex())
    for name in profile.DASH_KERNELS:
        assert pattern.search(name), name
    for other in ("flash_bwd_main_kernel", "bwd_main_kernel_v2", "cudnn_bwd", "fill_pseudo_random_kernel"):
        assert not pattern.search(other), other


def test_run_description_counts_flops_as_bench():
    pytest.importorskip("torch")
    from dash.bench import Shape

    shape = profile.ProfileShape(4, 4096, 16, 16, 128, True, "bf16")
    report = profile.ProfileReport(device="NVIDIA H200", sm_count=132, schedule="descending",
                                   iteration_ms=[2.0, 1.0, 3.0])
    lines = profile.describe_run(shape, report, deterministic=True, schedule="auto", warmup=3, iters=3)
    assert lines[0].startswith("NVIDIA H200 (132 SMs): dash.flash_attn_func + torch.autograd.grad, ")
    assert "hd128 causal s4096 b4 h16" in lines[0] and "schedule auto -> descending" in lines[0]
    assert "'dash.profile iter 0' .. 'dash.profile iter 2'" in lines[1]
    bwd = Shape(4, 4096, 16, 128, True).bwd_flops()
    tflops = (bwd + bwd / 2.5) / 2.0e-3 / 1e12  # forward + backward over the 2 ms median
    assert f"median 2.000 ms per iteration, {tflops:.1f} TFLOP/s" in lines[2]


# ---------------------------------------------------------------------------------------
# tools/runner/bwd_runner.cu (dash_bwd_runner)
# ---------------------------------------------------------------------------------------
def test_runner_schedule_names_follow_the_config_table():
    if not RUNNER_SOURCE.exists():
        pytest.skip("no tools/runner/ beside the tests (not a source checkout)")
    m = re.search(r"kScheduleNames\[\]\s*=\s*\{([^}]*)\}", RUNNER_SOURCE.read_text())
    assert m, "kScheduleNames not found in the runner"
    assert tuple(re.findall(r'"(\w+)"', m.group(1))) == KERNEL_SCHEDULES


def test_runner_compiles_against_the_kernel_api(tmp_path):
    """The runner's host code against csrc/bwd_api.h and BwdParams (no kernels linked: that is
    the CMake target's job, minutes of compiling; this catches API drift in seconds)."""
    if not RUNNER_SOURCE.exists():
        pytest.skip("no tools/runner/ beside the tests (not a source checkout)")
    from dash._build import resolve_cuda_home

    cuda_home, why = resolve_cuda_home()
    if cuda_home is None:
        pytest.skip(f"no CUDA toolkit: {why}")
    cmd = [str(cuda_home / "bin" / "nvcc"), "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a",
           "-I", str(CHECKOUT / "csrc"), "-c", str(RUNNER_SOURCE), "-o", str(tmp_path / "bwd_runner.o")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "warning" not in p.stderr.lower(), p.stderr[-4000:]
