"""Backward-pass benchmark shared by ``python -m dash bench`` and ``benchmarks/bench_bwd.py``.

One timer: the GPU time of each call with the host ahead of the GPU, as in a training step
where the host queues work while the GPU runs: CUDA events around a burst of ``burst``
back-to-back calls, behind a GPU sleep long enough for the host to issue the whole burst (the
same sleep before every mode), median over ``iters`` rounds after ``warmup`` calls, rotating
among several input sets so that repeated calls do not measure L2. Before c54945f each sample
was one synced call, which added the host's issue latency to every mode (100-450 us per
backward call on the H200 host, more for torch's cuDNN path and FA3's/FA4's Python paths than
for DASH's; the GPU time of DASH's kernels through autograd equals that of the kernels alone:
``benchmarks/results/logs/2026-11-30-NVIDIA-H200-user-path-timing-c5e0c94.log``). Host work
per call is measured on its own (``wall_us_per_call``, at a tiny shape where the GPU waits
for the host). The modes of a row are timed in rounds (every mode one burst per round, in the
orders of ``round_orders``), so that clock or thermal drift during the row does not favour the
mode measured first: two modes running the same kernel differed by up to 4 % when each was
timed in one block. The orders also vary which mode runs just before each one: a burst's clock
depends on the power drawn just before it, and the cyclic rotation used until 2026-12-06 kept
every mode behind the same neighbour in every round but the one it opened.
FLOPs are counted FA3's way: forward 4*b*h*sq*sk*d, backward 2.5x forward, halved for a
causal mask.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from dash.config import KERNEL_SCHEDULES

#: The paper grid (anchors.md): 16k tokens, hidden 2048.
PAPER_TOKENS = 16384
PAPER_HIDDEN = 2048
PAPER_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    heads_kv: Optional[int] = None
    dtype: str = "bfloat16"

    @staticmethod
    def paper(seqlen: int, head_dim: int, causal: bool) -> "Shape":
        return Shape(max(PAPER_TOKENS // seqlen, 1), seqlen, PAPER_HIDDEN // head_dim, head_dim, causal)

    def fwd_flops(self) -> float:
        """FA3's count: 4*b*h*s*s*d, halved under a causal mask."""
        return 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim / (2.0 if self.causal else 1.0)

    def bwd_flops(self) -> float:
        return 2.5 * self.fwd_flops()

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        kv = f"/{self.heads_kv}" if self.heads_kv and self.heads_kv != self.heads else ""
        return f"hd{self.head_dim} {mask} s{self.seqlen} b{self.batch} h{self.heads}{kv}"


#: GQA/MQA rows (issue 8's target row first: a LLaMA3-8B layer, 32 query heads on 8 KV heads),
#: with the same row as MHA and as MQA for contrast; ``benchmarks/bench_bwd.py --gqa``.
GQA_SHAPES = (
    Shape(2, 8192, 32, 128, True, heads_kv=8),
    Shape(1, 16384, 32, 128, True, heads_kv=8),
    Shape(4, 4096, 32, 128, True, heads_kv=8),
    Shape(2, 8192, 32, 128, False, heads_kv=8),
    Shape(2, 8192, 16, 128, True),
    Shape(2, 8192, 8, 128, True, heads_kv=1),
    Shape(2, 8192, 6, 128, True, heads_kv=1),
)


@dataclass
class Row:
    shape: Shape
    ms: dict[str, float] = field(default_factory=dict)  # mode -> median ms
    bitwise: dict[str, bool] = field(default_factory=dict)  # mode -> repeated calls identical
    errors: dict[str, str] = field(default_factory=dict)

    def tflops(self, mode: str) -> float:
        return self.shape.bwd_flops() / (self.ms[mode] * 1e-3) / 1e12


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def make_input_sets(shape: Shape, n_sets: int, device: torch.device, seed: int = 0) -> list[dict]:
    """Fresh randn inputs plus the DASH forward's out/lse and a random dout, per set."""
    from dash.ops import forward_impl

    gen = torch.Generator(device=device).manual_seed(seed)
    dt = _dtype(shape.dtype)
    hk = shape.heads_kv or shape.heads
    sets = []
    for _ in range(n_sets):
        q = torch.randn(shape.batch, shape.seqlen, shape.heads, shape.head_dim, device=device, dtype=dt, generator=gen)
        k = torch.randn(shape.batch, shape.seqlen, hk, shape.head_dim, device=device, dtype=dt, generator=gen)
        # Every tensor from ``gen`` (randn_like draws from the global generator): the same seed
        # gives the same inputs in every process, so outputs of two builds can be compared bit for bit.
        v = torch.randn(k.shape, device=device, dtype=dt, generator=gen)
        dout = torch.randn(q.shape, device=device, dtype=dt, generator=gen)
        scale = shape.head_dim ** -0.5
        with torch.no_grad():
            out, lse = forward_impl(q, k, v, scale, shape.causal)
        sets.append(dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, scale=scale))
    return sets


def wall_us_per_call(fn: Callable[[], object], calls: int = 200, warmup: int = 20) -> float:
    """Wall time per call of ``fn`` over ``calls`` back-to-back calls (one sync at the end): on
    a problem small enough that the GPU waits for the host, this is the host work per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def back_to_back(fn: Callable[[], object], seconds: float) -> tuple[float, float, int]:
    """Calls ``fn`` back to back for ``seconds`` of wall time (one batch of 8 at least), the
    host far ahead of the GPU with a sync every 64 calls, so the GPU stays loaded as in a
    training step (and reaches its power cap). Returns (start, end, calls): time.time() before
    the first call and after the last one finished."""
    torch.cuda.synchronize()
    t0, n = time.time(), 0
    while n == 0 or time.time() - t0 < seconds:
        for _ in range(8):
            fn()
        n += 8
        if n % 64 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return t0, time.time(), n


#: Clock rate used to turn a host time into a ``torch.cuda._sleep`` cycle count: the H200's boost
#: clock. At a lower clock the sleep lasts longer, which only gives the host more head start.
SLEEP_CLOCK_HZ = 2.0e9


#: How cuda_time_ms_interleaved orders the modes of a round, recorded in every results file
#: (``environment()["round_orders"]``, bench_varlen's ``meta``). Files written before it was
#: recorded (before 6490478) were timed with a cyclic rotation, which kept each mode behind the
#: same neighbour (see round_orders), except
#: benchmarks/results/2026-12-06-NVIDIA-H100-80GB-HBM3-fwd-round-orders.json (field added by hand).
ROUND_ORDERS = "williams"


def round_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` modes for successive rounds of ``cuda_time_ms_interleaved`` (a Williams
    design). Over one cycle of the returned orders every mode opens a round equally often and
    runs directly after every other mode equally often: once each for an even ``n`` (n orders),
    twice for an odd one (2n orders: the n orders and their reverses). A cyclic rotation of one
    order would keep each mode behind the same neighbour in every round it does not open.

    The balance is exact over whole cycles only; a run of fewer rounds (the benchmarks' default
    10-12 rounds for 7-13 modes) leaves some ordered pairs out, though each mode still follows
    several different neighbours. Across rounds, the last mode of one round precedes the first
    of the next (for odd n after a reversed order, the same mode), with a GPU sync and sleep
    between them as between any two modes."""
    if n < 1:
        return []
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        if len(first) % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    orders = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2 and n > 1:
        orders += [order[::-1] for order in orders]
    return orders


def in_round_order(items: list, round_index: int) -> list:
    """``items`` in the order ``round_orders`` gives round ``round_index`` (cycling)."""
    orders = round_orders(len(items))
    return [items[j] for j in orders[round_index % len(orders)]] if orders else []


def cuda_time_ms_interleaved(fns: dict[str, Callable[[dict], object]], sets: list[dict], warmup: int, iters: int,
                             errors: Optional[dict[str, str]] = None, burst: int = 3) -> dict[str, float]:
    """Median GPU time per call of each of ``fns`` with the host ahead of the GPU, as in a
    training step: per round, one burst of ``burst`` back-to-back calls of every function in
    turn, each behind the same GPU sleep, long enough for the slowest function's host to
    issue its whole burst (1.5x its burst's host time, measured on the warm-up calls, +
    0.2 ms). Rounds make clock and thermal drift during a row hit every mode alike, and the
    order of the functions changes from round to round (``round_orders``) so that each opens
    rounds and follows every other equally often over a cycle of orders (two runs of one kernel
    placed first and second in every round differed by up to 5 % at 16k tokens; a burst after a
    power-hungry neighbour runs at a lower clock). ``burst=1`` is one synced call per sample with
    no sleep: it adds the host's issue latency to every call. A function that raises is dropped (its error goes to
    ``errors``) and the others go on."""
    if burst < 1:
        raise ValueError(f"burst must be >= 1, got {burst}")
    live, host_s = {}, {}
    for name, fn in fns.items():
        try:
            # Every set once first: what a mode builds lazily per set (a user-path mode's forward
            # graph) must not land in a warm-up call that is timed for the host lead, nor in the
            # first timed burst (with fewer warm-ups than sets).
            for s in sets:
                fn(s)
            torch.cuda.synchronize()
            host = []
            for i in range(max(warmup, 2)):
                t0 = time.perf_counter()
                fn(sets[i % len(sets)])
                host.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
            live[name] = fn
            host_s[name] = statistics.median(host[1:])
        except Exception as e:  # a backend may not support a shape; record it, keep going
            if errors is not None:
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    lead_cycles = int(SLEEP_CLOCK_HZ * (1.5 * burst * max(host_s.values(), default=0.0) + 2e-4))
    times: dict[str, list[float]] = {name: [] for name in live}
    names = list(live)
    for i in range(iters if names else 0):
        for name in in_round_order(names, i):
            fn = live.get(name)
            if fn is None:  # dropped after raising in an earlier round
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            try:
                if burst > 1:
                    torch.cuda._sleep(lead_cycles)
                start.record()
                for j in range(burst):
                    fn(sets[(i * burst + j) % len(sets)])
                end.record()
                end.synchronize()
            except Exception as e:
                if errors is not None:
                    errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                del live[name], times[name]
                continue
            times[name].append(start.elapsed_time(end) / burst)
    return {name: statistics.median(t) for name, t in times.items() if t}


def _dash_backward(deterministic: bool, schedule: str = "fa3") -> Callable[[dict], tuple]:
    """DASH's backward kernels alone (``attention_backward`` on a precomputed out/lse)."""
    from dash.api import attention_backward

    def run(s: dict):
        return attention_backward(s["dout"], s["q"], s["k"], s["v"], s["out"], s["lse"], softmax_scale=s["scale"],
                                  causal=s["causal"], deterministic=deterministic, schedule=schedule)

    return run


def _autograd_backward(key: str, forward: Callable[[dict, tuple], torch.Tensor]) -> Callable[[dict], tuple]:
    """The path users call: ``torch.autograd.grad`` through a library's own forward (run once,
    untimed, its graph kept), so that each timed call is one backward with all its host work."""

    def run(s: dict):
        if key not in s:
            inputs = tuple(s[n].detach().requires_grad_() for n in ("q", "k", "v"))
            s[key] = (forward(s, inputs), inputs)
        out, inputs = s[key]
        return torch.autograd.grad(out, inputs, s["dout"], retain_graph=True)

    return run


def _dash_user_path(deterministic: bool, schedule: str = "auto") -> Callable[[dict], tuple]:
    from dash.api import flash_attn_func

    def forward(s, qkv):
        return flash_attn_func(*qkv, softmax_scale=s["scale"], causal=s["causal"], deterministic=deterministic,
                               schedule=schedule)

    return _autograd_backward(f"_graph_dash_{deterministic}_{schedule}", forward)


def _torch_sdpa_backward(backend) -> Callable[[dict], tuple]:
    """Time only the backward of torch SDPA with one backend (forward run untimed, graph kept)."""
    from torch.nn.attention import sdpa_kernel

    key = f"_graph_sdpa_{backend}"  # the forward graph lives with its input set

    def run(s: dict):
        if key not in s:
            q, k, v = (s[n].detach().transpose(1, 2).requires_grad_() for n in ("q", "k", "v"))
            with sdpa_kernel(backend):
                gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=s["causal"], scale=s["scale"],
                                                                       **gqa)
            s[key] = (out, (q, k, v), s["dout"].transpose(1, 2))
        out, inputs, dout = s[key]
        with sdpa_kernel(backend):
            return torch.autograd.grad(out, inputs, dout, retain_graph=True)

    return run


def _fa3_modes() -> dict[str, Callable[[dict], tuple]]:
    """Upstream FA3 (``flash_attn_interface`` from flash-attention's hopper/), if importable."""
    try:
        import flash_attn_interface as fa3
    except ImportError:
        return {}

    def mode(det: bool):
        return _autograd_backward(f"_graph_fa3_{det}", lambda s, qkv: fa3.flash_attn_func(
            *qkv, causal=s["causal"], softmax_scale=s["scale"], deterministic=det))

    return {"fa3_nondet": mode(False), "fa3_det": mode(True)}


def _fa4_modes() -> dict[str, Callable[[dict], tuple]]:
    """FlashAttention-4 (``flash_attn.cute``, pip flash-attn-4), if importable."""
    try:
        from flash_attn.cute import flash_attn_func as fa4_func
    except ImportError:
        return {}

    def mode(det: bool):
        def forward(s, qkv):
            out = fa4_func(*qkv, causal=s["causal"], softmax_scale=s["scale"], deterministic=det)
            return out[0] if isinstance(out, tuple) else out

        return _autograd_backward(f"_graph_fa4_{det}", forward)

    return {"fa4_nondet": mode(False), "fa4_det": mode(True)}


#: DASH's kernel schedules measured one by one (deterministic), beside auto.
KERNEL_SCHEDULE_MODES = KERNEL_SCHEDULES


#: DASH's kernel schedules measured one by one without determinism (fa3's order is the default
#: column ``dash_nondet_fa3``), for choosing non-deterministic auto's rule; opt-in.
NONDET_SCHEDULE_MODES: dict[str, str] = {f"dash_nondet_{s}": s for s in KERNEL_SCHEDULE_MODES if s != "fa3"}


def available_modes() -> dict[str, Callable[[dict], tuple]]:
    """Every mode this machine can run. ``dash_*``: the kernels alone; ``user_dash_*``: through
    ``flash_attn_func`` + ``torch.autograd.grad`` (the path users call); anchors: torch SDPA
    (cuDNN, flash), and upstream FA3 / FA4 through their own forward when importable."""
    from torch.nn.attention import SDPBackend

    modes = {
        "dash_nondet": _dash_backward(False, "auto"),
        # Non-det auto: a measured rule per mask, head dim and length
        # (dash.schedules.auto.nondeterministic_kernel_schedule); the fa3 order beside it.
        "dash_nondet_fa3": _dash_backward(False, "fa3"),
        "dash_auto_det": _dash_backward(True, "auto"),
    }
    for sched in KERNEL_SCHEDULE_MODES:
        modes[f"dash_{sched}_det"] = _dash_backward(True, sched)
    for name, sched in NONDET_SCHEDULE_MODES.items():  # opt-in (OPT_IN_MODES)
        modes[name] = _dash_backward(False, sched)
    modes["user_dash_auto_det"] = _dash_user_path(True, "auto")
    modes["user_dash_nondet"] = _dash_user_path(False, "auto")
    modes["torch_cudnn"] = _torch_sdpa_backward(SDPBackend.CUDNN_ATTENTION)
    modes["torch_flash"] = _torch_sdpa_backward(SDPBackend.FLASH_ATTENTION)
    modes.update(_fa3_modes())
    modes.update(_fa4_modes())
    return modes


#: Modes that run only when named (``run_rows(modes=...)``, ``bench_bwd.py --modes``).
OPT_IN_MODES: frozenset[str] = frozenset(NONDET_SCHEDULE_MODES)


def default_modes(all_modes: Optional[dict] = None) -> list[str]:
    """The modes a run without ``modes`` measures: every available one but ``OPT_IN_MODES``."""
    return [m for m in (all_modes if all_modes is not None else available_modes()) if m not in OPT_IN_MODES]


def is_deterministic_mode(name: str) -> bool:
    return name.endswith("_det") or "_det_" in name


def bitwise_repeatable(fn: Callable[[dict], tuple], s: dict, repeats: int) -> bool:
    ref = [t.clone() for t in fn(s)]
    for _ in range(repeats - 1):
        if not all(torch.equal(a, b) for a, b in zip(ref, fn(s))):
            return False
    return True


def mode_applies(name: str, shape: Shape) -> bool:
    """Whether a mode is defined for a shape: the shift schedule exists for full masks only
    (DASH refuses it under a causal mask), so its column is left empty on causal rows rather
    than recorded as an error."""
    return not (shape.causal and name in ("dash_shift_det", "dash_nondet_shift"))


def run_rows(shapes: list[Shape], modes: Optional[list[str]] = None, warmup: int = 5, iters: int = 20,
             n_sets: int = 3, bitwise_repeats: int = 3, log: Callable[[str], None] = print,
             burst: int = 3) -> list[Row]:
    device = torch.device("cuda")
    all_modes = available_modes()
    chosen = {m: all_modes[m] for m in (modes or default_modes(all_modes)) if m in all_modes}
    rows = []
    for shape in shapes:
        sets = make_input_sets(shape, n_sets, device)
        for s in sets:
            s["causal"] = shape.causal
        row = Row(shape)
        applicable = {m: fn for m, fn in chosen.items() if mode_applies(m, shape)}
        row.ms = cuda_time_ms_interleaved(applicable, sets, warmup, iters, row.errors, burst=burst)
        for name, fn in applicable.items():
            if name in row.ms and is_deterministic_mode(name):
                try:
                    row.bitwise[name] = bitwise_repeatable(fn, sets[0], bitwise_repeats)
                except Exception as e:
                    row.errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        log(format_row(row, list(chosen)))
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    return rows


def format_header(modes: list[str]) -> str:
    cols = "".join(f"{m:>14}" for m in modes)
    return f"{'shape':<34}{cols}   (TFLOP/s; ratio to torch_cudnn)"


def format_row(row: Row, modes: list[str]) -> str:
    cells = []
    base = row.ms.get("torch_cudnn")
    for m in modes:
        if m in row.ms:
            ratio = f" {base / row.ms[m]:.2f}x" if base else ""
            mark = "" if row.bitwise.get(m, True) else "!"
            cells.append(f"{row.tflops(m):7.1f}{ratio}{mark}".rjust(14))
        elif m in row.errors:
            cells.append("err".rjust(14))
        else:
            cells.append("-".rjust(14))  # not defined for this shape (mode_applies)
    return f"{row.shape.label():<34}" + "".join(cells)


def geomean(values: list[float]) -> float:
    import math

    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summary(rows: list[Row], modes: list[str], anchor: str = "torch_cudnn") -> dict[str, dict[str, float]]:
    out = {}
    for m in modes:
        ratios = [r.ms[anchor] / r.ms[m] for r in rows if m in r.ms and anchor in r.ms]
        if ratios:
            out[m] = {"geomean_vs_" + anchor: geomean(ratios), "min_vs_" + anchor: min(ratios), "rows": len(ratios)}
    return out


def paired_ratios(rows: list[Row]) -> dict[str, dict[str, float]]:
    """The ratios the targets are stated in, over the rows that have both modes (time ratios,
    > 1 means the first mode is faster): det(auto) / non-det and non-det against the faster of
    FA3's and FA4's non-deterministic backward, both through the path users call (the
    headline) and for the kernels alone; det(auto) / det(fa3 order) (kernels: the fa3 order has
    no user-path mode); the path users call vs the kernel alone; det(auto) against the faster
    of FA3's and FA4's deterministic backward when they ran (FA3 and FA4 are always timed
    through their own forward + torch.autograd.grad, the path their users call)."""
    def pair(fast: str, slow_of: tuple[str, ...]) -> Optional[dict[str, float]]:
        vals = []
        for r in rows:
            slows = [r.ms[m] for m in slow_of if m in r.ms]
            if fast in r.ms and slows:
                vals.append(min(slows) / r.ms[fast])
        return {"geomean": geomean(vals), "worst": min(vals), "rows": len(vals)} if vals else None

    out = {
        "user path det(auto) / user path non-det": pair("user_dash_auto_det", ("user_dash_nondet",)),
        "user path non-det / faster of FA3, FA4 non-det": pair("user_dash_nondet", ("fa3_nondet", "fa4_nondet")),
        "dash det(auto) / dash non-det": pair("dash_auto_det", ("dash_nondet",)),
        "dash det(auto) / dash det(fa3)": pair("dash_auto_det", ("dash_fa3_det",)),
        "user path det(auto) / kernel det(auto)": pair("user_dash_auto_det", ("dash_auto_det",)),
        "dash det(auto) / faster of FA3 det, FA4 det": pair("dash_auto_det", ("fa3_det", "fa4_det")),
        "user path det(auto) / faster of FA3 det, FA4 det": pair("user_dash_auto_det", ("fa3_det", "fa4_det")),
        "dash non-det / faster of FA3, FA4 non-det": pair("dash_nondet", ("fa3_nondet", "fa4_nondet")),
    }
    return {k: v for k, v in out.items() if v is not None}


def model_ranking_agreement(rows: list[Row], sms: Optional[int] = None) -> dict:
    """Does ``auto`` (the calibrated model) pick the measured-fastest portable schedule?

    Per row: the measured fastest of ``dash_{fa3,interleaved,descending}_det``, the model's
    choice (``choose_kernel_schedule`` for a grid of ``sms`` CTAs, default this GPU's), and how
    far auto's pick is from the best measured one. Counts: ``best_agrees`` (the pick is the
    measured fastest), ``best_in_model_top`` (the measured fastest is among the schedules the
    model ranks first: the model can predict exactly equal makespans, e.g. ``interleaved`` and
    ``descending`` under a full mask are mirror images of each other, and ``auto`` then takes
    the earlier name, which says nothing about which of the two a timer sees faster),
    ``auto_within_1pct`` (within 1 %, about the timer's resolution: the same kernel timed as two
    modes of one run differed by up to 1 % at <= 4k tokens) and ``auto_within_3pct``.
    ``tools/model_agreement.py`` recomputes this for stored results."""
    from dash.schedules.auto import (AUTO_REFERENCE_CTAS, PORTABLE_KERNEL_SCHEDULES, choose_kernel_schedule,
                                     rank_kernel_schedules)

    if sms is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_row, agree, in_top, within1, within3, worst = [], 0, 0, 0, 0, 1.0
    for r in rows:
        ms = {s: r.ms[f"dash_{s}_det"] for s in PORTABLE_KERNEL_SCHEDULES if f"dash_{s}_det" in r.ms}
        if len(ms) < 2:
            continue
        sh = r.shape
        pick = choose_kernel_schedule(sh.batch, sh.heads, sh.heads_kv or sh.heads, sh.seqlen, sh.seqlen, sh.head_dim,
                                      sh.causal, sms)
        best = min(ms, key=ms.get)
        ratio = ms[best] / ms[pick] if pick in ms else float("nan")
        # The model's first rank: auto ranks for the reference grid whatever ``sms`` is.
        ranked = rank_kernel_schedules(sh.batch, sh.heads, sh.heads_kv or sh.heads, sh.seqlen, sh.seqlen,
                                       sh.head_dim, sh.causal, AUTO_REFERENCE_CTAS)
        top = sorted(n for n, t in ranked if t <= ranked[0][1] * (1 + 1e-9)) if ranked else [pick]
        agree += pick == best
        in_top += best in top
        within1 += ratio >= 0.99
        within3 += ratio >= 0.97
        worst = min(worst, ratio)
        per_row.append({"shape": sh.label(), "measured_best": best, "model_pick": pick, "model_top": top,
                        "pick_vs_best": ratio, "measured_ms": ms})
    return {"rows": len(per_row), "best_agrees": agree, "best_in_model_top": in_top, "auto_within_1pct": within1,
            "auto_within_3pct": within3, "worst_auto_vs_best": worst, "per_row": per_row}


def rows_from_results(payload: dict) -> list[Row]:
    """The ``Row``s of a results file written by ``write_results`` (timings and checks)."""
    rows = []
    for r in payload["rows"]:
        rows.append(Row(Shape(**r["shape"]), dict(r["ms"]), dict(r.get("bitwise_repeatable", {})),
                        dict(r.get("errors", {}))))
    return rows


def anchor_versions() -> dict:
    """Which upstream FA3 and FA4 the run measured, when imported: FA4's distribution version;
    FA3's interface file's sha256 (it is built from a source tree, not installed) and the
    commit that tree came from when the caller names it in DASH_ANCHOR_FA3_COMMIT."""
    import hashlib
    import importlib.metadata
    import os
    import sys

    out = {}
    fa3 = sys.modules.get("flash_attn_interface")
    if fa3 is not None and getattr(fa3, "__file__", None):
        out["fa3"] = {"interface_sha256": hashlib.sha256(Path(fa3.__file__).read_bytes()).hexdigest()[:16],
                      "commit": os.environ.get("DASH_ANCHOR_FA3_COMMIT")}
    if "flash_attn.cute" in sys.modules:
        try:
            out["fa4"] = {"version": importlib.metadata.version("flash-attn-4")}
        except importlib.metadata.PackageNotFoundError:
            out["fa4"] = {"version": None}
    return out


def environment() -> dict:
    """The machine, the versions and the code of a run. ``commit`` is the kernels' (what the build
    recorded), ``checkout_head`` the checkout's HEAD; neither says whether the Python code was
    edited since, so ``checkout_describe`` (``git describe --always --dirty``) and
    ``code_sha256`` (dash/ and benchmarks/ Python files as run) do: ``dash._bench.code_identity``."""
    from dash._bench import code_identity
    from dash._ext import manifest

    props = torch.cuda.get_device_properties(0)
    commit = manifest().get("git_commit")
    try:
        head = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except Exception:
        head = None
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "commit": commit,
        "checkout_head": head,
        **code_identity(),
        "build": manifest(),
        "anchors": anchor_versions(),
        "round_orders": ROUND_ORDERS,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
    }


def rows_payload(rows: list[Row]) -> list[dict]:
    """The ``rows`` of a results file (``rows_from_results`` reads them back)."""
    return [
        {
            "shape": dataclasses.asdict(r.shape),
            "bwd_flops": r.shape.bwd_flops(),
            "ms": r.ms,
            "tflops": {m: r.tflops(m) for m in r.ms},
            "bitwise_repeatable": r.bitwise,
            "errors": r.errors,
        }
        for r in rows
    ]


def round_coverage(n_modes: int, rounds: Optional[int]) -> dict:
    """How much of round_orders' balance a run of ``rounds`` rounds over ``n_modes`` modes got:
    the orders of a full cycle, how many cycles ran, and how many of the n(n-1) ordered
    neighbour pairs and of the modes opening a round occurred (all of them over whole cycles)."""
    orders = round_orders(n_modes)
    if not orders or not rounds:
        return {"modes": n_modes, "rounds": rounds}
    ran = [orders[i % len(orders)] for i in range(rounds)]
    pairs = {(o[j], o[j + 1]) for o in ran for j in range(len(o) - 1)}
    return {"modes": n_modes, "rounds": rounds, "orders_per_cycle": len(orders),
            "whole_cycles": rounds // len(orders), "neighbour_pairs_seen": len(pairs),
            "neighbour_pairs": n_modes * (n_modes - 1), "modes_opening_a_round": len({o[0] for o in ran})}


def results_payload(rows: list[Row], modes: list[str], meta: dict) -> dict:
    # These rows are backward timings: say so, for readers (python -m dash plot) of other kinds' files.
    n_modes = max((len(r.ms) for r in rows), default=len(modes))  # a row's timed modes share its rounds
    return {
        "meta": {"kind": "bwd", "round_coverage": round_coverage(n_modes, meta.get("iters")), **meta},
        "environment": environment(),
        "summary": summary(rows, modes),
        "rows": rows_payload(rows),
    }


def write_results(payload: dict, directory: Path, tag: str) -> Path:
    """Write ``payload`` to a new ``directory/<day>-<gpu>-<tag>[-N].json`` and return its path.
    Never replaces a file: a second run the same day (a subset of the grid, say) gets -2, -3, ...
    (``dash._bench.results_path``, shared with bench_e2e.py), and the file is created exclusively
    so that two runs finishing together cannot pick the same name."""
    from dash._bench import results_path

    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2) + "\n"
    env = payload["environment"]
    while True:
        path = results_path(directory, env["device"], env["date"], tag)
        try:
            with open(path, "x", encoding="utf-8") as f:
                f.write(text)
            return path
        except FileExistsError:  # taken since results_path looked: take the next number
            continue
