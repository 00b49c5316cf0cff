"""``python -m dash profile``: forward + backward iterations of one shape, marked for Nsight.

Runs ``dash.flash_attn_func`` and ``torch.autograd.grad`` (the path users call) ``--warmup``
times, then ``--iters`` more times between ``torch.cuda.profiler.start()`` and ``stop()``
(cudaProfilerStart/Stop), each iteration in an NVTX range ``dash.profile iter <i>``. So

* ``nsys profile --capture-range=cudaProfilerApi`` records just the profiled iterations, and
* ``ncu --profile-from-start off`` profiles kernels of those iterations only, never a warm-up
  (module load, first-call attribute setting, cold clocks).

Afterwards it prints what ran (device, shape, dtype, mode, the schedule ``auto`` resolved to,
the median time of an iteration) and command lines that profile this very run with nsys and
ncu, filtered to DASH's kernels (``DASH_KERNELS``).

Without an sm_90 GPU and DASH's kernels it fails with one line (exit 1): there is nothing to
profile. ``tools/runner/bwd_runner.cu`` (CMake target ``dash_bwd_runner``) profiles the
backward kernels without Python.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass

#: DASH's CUDA kernels, by ``__global__`` name, in launch order within one forward + backward
#: iteration. tests/test_profile_cli.py checks this against the ``__global__`` functions in
#: csrc/. Where the forward runs PyTorch's SDPA instead of ``fwd_main_kernel`` (a checkout
#: from before DASH's forward kernel), only the three backward kernels match.
DASH_KERNELS: tuple[str, ...] = ("fwd_main_kernel", "bwd_preprocess_kernel", "bwd_varlen_live_columns_kernel",
                                 "bwd_main_kernel", "bwd_convert_dq_kernel")
#: The kernel that does the backward's work: the one to read first in ncu.
BWD_MAIN_KERNEL = "bwd_main_kernel"
#: NVTX range name of profiled iteration ``i`` (ncu's --nvtx-include needs the exact name).
#: DASH's profile ranges are start/end ranges, not push/pop ones: push/pop ranges belong to
#: the thread that pushed them, and autograd launches the backward's kernels from its own
#: device thread, so a push/pop iteration range would not contain them (ncu's
#: ``--nvtx-include 'dash.profile iter 0/'`` found only the forward's kernels). Start/end
#: ranges span the process.
ITERATION_RANGE = "dash.profile iter {}"
#: Inside each iteration's range, around the two halves of the user path.
FORWARD_RANGE = "dash.profile forward"
BACKWARD_RANGE = "dash.profile backward"

#: What the command line accepts for --dtype, and the torch dtype name each one means.
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


# ---------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``profile`` options to ``p`` (sizes and names are checked while parsing)."""
    from dash.cli import attention_dtype, head_dim, kernel_schedule, nonnegative_int, positive_int
    from dash.config import KERNEL_SCHEDULES, SUPPORTED_HEAD_DIMS

    p.add_argument("--seqlen", type=positive_int, default=4096, help="seqlen_q = seqlen_k (default 4096)")
    p.add_argument("--hdim", type=head_dim, default=128, help=f"head dim: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False,
                   help="bottom-right aligned causal mask (default: full)")
    p.add_argument("--batch", type=positive_int, default=None, help="default: 16384 // seqlen (16k tokens)")
    p.add_argument("--heads", type=positive_int, default=None, help="default: 2048 // hdim (hidden 2048)")
    p.add_argument("--heads-kv", type=positive_int, default=None,
                   help="key/value heads for GQA/MQA (default: --heads); must divide --heads")
    p.add_argument("--dtype", type=attention_dtype, default="bf16", metavar="{bf16,fp16}", help="default bf16")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="bitwise reproducible backward (default: on)")
    p.add_argument("--schedule", type=kernel_schedule, default="auto", metavar="NAME",
                   help=f"auto (default) or a kernel schedule: {', '.join(KERNEL_SCHEDULES)}")
    p.add_argument("--iters", type=positive_int, default=10, help="profiled iterations (default 10)")
    p.add_argument("--warmup", type=nonnegative_int, default=3, help="iterations before profiling starts (default 3)")


@dataclass(frozen=True)
class ProfileShape:
    """The problem one ``profile`` run executes, defaults resolved as ``bench`` resolves them."""

    batch: int
    seqlen: int
    heads: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str  # a key of DTYPE_NAMES

    @staticmethod
    def from_args(args: argparse.Namespace) -> "ProfileShape":
        heads = args.heads or max(2048 // args.hdim, 1)
        return ProfileShape(batch=args.batch or max(16384 // args.seqlen, 1), seqlen=args.seqlen, heads=heads,
                            heads_kv=args.heads_kv or heads, head_dim=args.hdim, causal=args.causal,
                            dtype=args.dtype)

    def argv(self) -> list[str]:
        """The shape as ``profile`` options, every default spelled out (a printed command line
        then reruns this shape even if the defaults change)."""
        return ["--seqlen", str(self.seqlen), "--hdim", str(self.head_dim), "--batch", str(self.batch),
                "--heads", str(self.heads), "--heads-kv", str(self.heads_kv), "--dtype", self.dtype,
                "--causal" if self.causal else "--no-causal"]


def combination_problem(args: argparse.Namespace, shape: ProfileShape) -> str | None:
    """Why these options cannot run together (one line naming the argument), or None."""
    if shape.heads % shape.heads_kv:
        return (f"argument --heads-kv: {shape.heads_kv} does not divide the {shape.heads} query heads "
                f"(GQA needs heads % heads-kv == 0)")
    if args.schedule == "shift" and shape.causal:
        return "argument --schedule: 'shift' is for full masks; with --causal use auto, fa3, interleaved or descending"
    return None


def build_problem(shape: ProfileShape) -> str | None:
    """Why this install's kernels cannot run ``shape`` (head dim or dtype not compiled), or None."""
    from dash._ext import manifest

    info = manifest()
    if not info.get("kernels_built"):
        return None  # the GPU check reports missing kernels
    if shape.head_dim not in info.get("head_dims", []):
        built = ", ".join(map(str, info.get("head_dims", []))) or "none"
        return (f"argument --hdim: {shape.head_dim} is not built in this install; built: {built} "
                "(rebuild with DASH_HDIMS)")
    if DTYPE_NAMES[shape.dtype] not in info.get("dtypes", []):
        built = ", ".join(info.get("dtypes", [])) or "none"
        return (f"argument --dtype: {shape.dtype} is not built in this install; built: {built} "
                "(rebuild with DASH_DTYPES)")
    return None


# ---------------------------------------------------------------------------------------
# Suggested profiler command lines
# ---------------------------------------------------------------------------------------
def kernel_name_regex(names: tuple[str, ...] = DASH_KERNELS) -> str:
    """An ncu ``--kernel-name regex:`` pattern matching exactly ``names``.

    Unanchored alternatives would do too, but ``^...$`` keeps, say, another library's
    ``flash_bwd_main_kernel`` out."""
    return "^(" + "|".join(names) + ")$"


def profiler_commands(profile_argv: list[str], python: str | None = None) -> list[tuple[str, str]]:
    """(what it shows, command line) for nsys and ncu, each running
    ``python -m dash profile PROFILE_ARGV`` and capturing only its profiled iterations.

    ncu runs with ``--clock-control none`` so that kernels run at the clocks they run at
    without a profiler (ncu's default locks the base clock, which makes a kernel look
    slower and can change what limits it) and with ``--profile-from-start off`` so that only
    kernels between cudaProfilerStart/Stop are candidates.
    """
    target = shlex.join([python or sys.executable, "-m", "dash", "profile", *profile_argv])
    ncu = "ncu --profile-from-start off --clock-control none"
    first_iteration = ITERATION_RANGE.format(0)  # a start/end range: no trailing '/' (that means push/pop)
    return [
        ("timeline of the profiled iterations (NVTX ranges per iteration, forward, backward and DASH op)",
         f"nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop --trace=cuda,nvtx "
         f"--output=dash-profile {target}"),
        ("the backward main kernel of the first profiled iteration, every metric, with source lines",
         f"{ncu} --kernel-name regex:{shlex.quote(kernel_name_regex((BWD_MAIN_KERNEL,)))} --launch-count 1 "
         f"--set full --import-source yes --export dash-bwd-main {target}"),
        (f"every DASH kernel of the first profiled iteration ({', '.join(DASH_KERNELS)})",
         f"{ncu} --nvtx --nvtx-include {shlex.quote(first_iteration)} "
         f"--kernel-name regex:{shlex.quote(kernel_name_regex())} --export dash-iter0 {target}"),
    ]


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------
@dataclass
class ProfileReport:
    """What ``profile_iterations`` ran and measured."""

    device: str
    sm_count: int
    schedule: str  # the kernel schedule the backward ran (``auto`` resolved)
    iteration_ms: list[float]  # CUDA-event time of each profiled iteration (forward + backward)

    @property
    def median_ms(self) -> float:
        import statistics

        return statistics.median(self.iteration_ms)


def resolved_schedule(shape: ProfileShape, schedule: str, deterministic: bool, sm_count: int) -> str:
    """The kernel schedule ``flash_attn_func(schedule=...)`` runs for ``shape`` (sm_margin 0)."""
    if schedule != "auto":
        return schedule
    from dash.schedules.auto import choose_kernel_schedule

    return choose_kernel_schedule(shape.batch, shape.heads, shape.heads_kv, shape.seqlen, shape.seqlen,
                                  shape.head_dim, shape.causal, sm_count, deterministic)


def profile_iterations(shape: ProfileShape, *, deterministic: bool, schedule: str, warmup: int,
                       iters: int) -> ProfileReport:
    """Run ``warmup`` then ``iters`` forward + backward iterations; the latter between
    cudaProfilerStart/Stop, each in NVTX range ``ITERATION_RANGE.format(i)``."""
    import torch

    import dash

    dtype = getattr(torch, DTYPE_NAMES[shape.dtype])
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(seqlen: int, heads: int) -> torch.Tensor:
        return torch.randn(shape.batch, seqlen, heads, shape.head_dim, device="cuda", dtype=dtype, generator=gen)

    q = randn(shape.seqlen, shape.heads).requires_grad_()
    k = randn(shape.seqlen, shape.heads_kv).requires_grad_()
    v = randn(shape.seqlen, shape.heads_kv).requires_grad_()
    dout = randn(shape.seqlen, shape.heads)

    nvtx = torch.cuda.nvtx

    def iteration() -> None:
        forward = nvtx.range_start(FORWARD_RANGE)
        out = dash.flash_attn_func(q, k, v, causal=shape.causal, deterministic=deterministic, schedule=schedule)
        nvtx.range_end(forward)
        backward = nvtx.range_start(BACKWARD_RANGE)
        torch.autograd.grad(out, (q, k, v), dout)
        nvtx.range_end(backward)

    for _ in range(warmup):
        iteration()
    torch.cuda.synchronize()

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.profiler.start()
    try:
        for i, (start, end) in enumerate(events):
            marked = nvtx.range_start(ITERATION_RANGE.format(i))
            start.record()
            iteration()
            end.record()
            nvtx.range_end(marked)
        torch.cuda.synchronize()
    finally:
        torch.cuda.profiler.stop()  # also on an error: an open capture range would swallow whatever runs next

    props = torch.cuda.get_device_properties(0)
    return ProfileReport(device=props.name, sm_count=props.multi_processor_count,
                         schedule=resolved_schedule(shape, schedule, deterministic, props.multi_processor_count),
                         iteration_ms=[s.elapsed_time(e) for s, e in events])


def describe_run(shape: ProfileShape, report: ProfileReport, *, deterministic: bool, schedule: str, warmup: int,
                 iters: int) -> list[str]:
    """The lines ``profile`` prints about what it ran."""
    from dash.bench import Shape

    # FLOPs counted as python -m dash bench counts them (FA3's convention).
    bench_shape = Shape(shape.batch, shape.seqlen, shape.heads, shape.head_dim, shape.causal,
                        shape.heads_kv if shape.heads_kv != shape.heads else None, DTYPE_NAMES[shape.dtype])
    bwd_flops = bench_shape.bwd_flops()
    iteration_flops = bwd_flops + bwd_flops / 2.5  # + the forward (the backward counts 2.5 forwards)
    mode = "deterministic" if deterministic else "non-deterministic"
    picked = f"{schedule} -> {report.schedule}" if schedule == "auto" else report.schedule
    ms = report.median_ms
    return [
        f"{report.device} ({report.sm_count} SMs): dash.flash_attn_func + torch.autograd.grad, "
        f"{bench_shape.label()}, {shape.dtype}, {mode} backward, schedule {picked}",
        f"  {warmup} warm-up iterations, then {iters} profiled iterations between cudaProfilerStart/Stop, "
        f"NVTX ranges '{ITERATION_RANGE.format(0)}' .. '{ITERATION_RANGE.format(iters - 1)}'",
        f"  forward + backward: median {ms:.3f} ms per iteration, {iteration_flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s "
        f"(FLOPs as python -m dash bench counts them; meaningless under ncu, which replays the kernels it profiles)",
    ]


def run(args: argparse.Namespace) -> int:
    from dash._bench import _gpu_ok
    from dash.cli import usage_error

    shape = ProfileShape.from_args(args)
    why = combination_problem(args, shape)
    if why:
        return usage_error("profile", why)
    ok, why = _gpu_ok()
    if not ok:
        print(f"python -m dash profile: error: needs an sm_90 GPU with DASH's kernels ({why}); nothing to profile "
              "here (python -m dash simulate runs the scheduling model without a GPU)", file=sys.stderr)
        return 1
    why = build_problem(shape)
    if why:
        return usage_error("profile", why)

    import torch

    try:
        report = profile_iterations(shape, deterministic=args.deterministic, schedule=args.schedule,
                                    warmup=args.warmup, iters=args.iters)
    except (ValueError, NotImplementedError) as e:  # DASH's input checks (e.g. 'shift' on too short a seqlen)
        return usage_error("profile", str(e).splitlines()[0])
    except torch.cuda.OutOfMemoryError:
        print(f"python -m dash profile: error: out of GPU memory for batch {shape.batch} x seqlen {shape.seqlen} x "
              f"{shape.heads} heads; lower --batch or --seqlen", file=sys.stderr)
        return 1
    for line in describe_run(shape, report, deterministic=args.deterministic, schedule=args.schedule,
                             warmup=args.warmup, iters=args.iters):
        print(line)
    profile_argv = shape.argv() + ["--deterministic" if args.deterministic else "--no-deterministic",
                                   "--schedule", args.schedule, "--iters", str(args.iters),
                                   "--warmup", str(args.warmup)]
    print("Profile these iterations with:")
    for what, command in profiler_commands(profile_argv):
        print(f"  # {what}\n  {command}")
    return 0
