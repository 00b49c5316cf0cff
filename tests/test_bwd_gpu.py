"""GPU tests of DASH's Hopper backward against dash.reference (skipped without an sm_90 GPU).

Accuracy rule (FA3's): max |kernel - ref_f64| <= 2 * max |ref_lowp - ref_f64| + floor, where
ref_lowp is the same computation done by PyTorch in the input precision; over the whole tensor and
per kernel tile (reference.assert_within_bound_blocks).
Determinism: bitwise torch.equal over many repeated calls, fresh random inputs per test.
Seeds: every failure message names its seed and DASH_TEST_SALT; rerun with that DASH_TEST_SALT set
to get the same inputs.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from seeding import seed_of, seed_tag  # tests/seeding.py (conftest.py puts tests/ on sys.path)

from dash import reference
from dash.api import attention_backward, flash_attn_func
from dash.config import bwd_tile_config

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SEQLEN_PAIRS = [(1, 1), (239, 1), (113, 203), (64, 128), (128, 64), (1023, 1024), (1000, 777), (4224, 4224)]


def _inputs(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, dout


def _forward(q, k, v, causal):
    """Exact forward (float64 reference), O rounded to the input dtype as a kernel would store it."""
    out, lse = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float64)
    return out.to(q.dtype), lse.float()


def _check_against_reference(q, k, v, dout, out, lse, causal, grads, label):
    hi = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=torch.float64)
    lo = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=q.dtype)
    cfg = bwd_tile_config(q.shape[-1], causal)
    # dq rows come in Q tiles (kBlockM), dk/dv rows in columns (kBlockN)
    for name, g, h, l, rows in zip(("dq", "dk", "dv"), grads, hi, lo, (cfg.block_m, cfg.block_n, cfg.block_n)):
        assert g.shape == h.shape and g.dtype == q.dtype, f"{label} {name}: shape/dtype {g.shape} {g.dtype}"
        reference.assert_within_bound(g, h, l, f"{label} {name}")
        # The global max is set by the largest entries; one tile's lost dQ partial, or a column that lost
        # a Q tile, stays under it at long causal shapes, but not under that tile's own bound.
        reference.assert_within_bound_blocks(g, h, l, f"{label} {name}", rows)


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


# bf16 on every seqlen pair; fp16 (the same kernels with another element type) on two of them.
DTYPE_SEQLENS = [("bf16", s) for s in SEQLEN_PAIRS] + [("fp16", s) for s in [(113, 203), (1023, 1024)]]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype, seqlens", DTYPE_SEQLENS, ids=lambda x: x if isinstance(x, str) else f"{x[0]}x{x[1]}")
def test_backward_matches_reference(seqlens, deterministic, causal, head_dim, dtype):
    seqlen_q, seqlen_k = seqlens
    batch, heads = (1, 2) if seqlen_q * seqlen_k > 10**6 else (2, 3)
    seed = seed_of(seqlens, causal, head_dim, dtype)
    q, k, v, dout = _inputs(batch, seqlen_q, seqlen_k, heads, heads, head_dim, DTYPES[dtype], seed)
    out, lse = _forward(q, k, v, causal)
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    _check_against_reference(q, k, v, dout, out, lse, causal, grads,
                             f"{seqlens} causal={causal} d={head_dim} {dtype} det={deterministic} {seed_tag(seed)}")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_head_one_batch_and_gqa(head_dim):
    for heads, heads_k, causal in [(1, 1, False), (1, 1, True), (8, 2, True), (6, 1, False)]:
        seed = seed_of(heads, heads_k, causal, head_dim)
        q, k, v, dout = _inputs(1, 300, 333, heads, heads_k, head_dim, torch.bfloat16, seed)
        out, lse = _forward(q, k, v, causal)
        grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        _check_against_reference(q, k, v, dout, out, lse, causal, grads,
                                 f"H={heads} Hk={heads_k} causal={causal} d={head_dim} {seed_tag(seed)}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(333, 517), (1000, 100), (239, 1)])
@pytest.mark.parametrize("heads, heads_k", [(2, 2), (6, 2)], ids=["mha", "gqa_6_over_2"])
def test_every_output_element_written(seqlens, causal, head_dim, heads, heads_k, monkeypatch):
    """dq/dk/dv (and the fp32 dQ workspace) are filled with NaN before the launch
    (DASH_POISON_OUTPUTS); none may survive. Causal with seqlen_q > seqlen_k: the rows before
    seqlen_q - seqlen_k see no key, so whole Q tiles have no column contributing to them (1000x100:
    7 of 8 tiles of 128 rows at hdim 64, 14 of 16 of 64 rows at hdim 128; 239x1: 1 of 2, 3 of 4),
    and their dq rows must still be written, as 0. GQA 6/2 (three query heads per KV head, ordered
    in both modes, config.py nondet_dkv_chains_max_group): the kernel writes dk and dv from the
    group's last query head (two dK/dV chains before it)."""
    monkeypatch.setenv("DASH_POISON_OUTPUTS", "1")
    sq, sk = seqlens
    seed = seed_of("poison", seqlens, causal, head_dim, heads, heads_k)
    q, k, v, dout = _inputs(2, sq, sk, heads, heads_k, head_dim, torch.bfloat16, seed)
    out, lse = _forward(q, k, v, causal)
    for deterministic in (False, True):
        label = f"{seqlens} causal={causal} d={head_dim} det={deterministic} {seed_tag(seed)}"
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
        for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
            assert torch.isfinite(g).all(), f"{label}: {name} has unwritten (NaN) elements"
        if causal and sq > sk:
            assert torch.all(dq[:, : sq - sk] == 0), f"{label}: dq rows that see no key must be 0"


def test_poison_bytes_decode_as_nan():
    """The poison hook writes all-ones bytes; the test above relies on that being NaN."""
    for dt in (torch.bfloat16, torch.float16):
        assert torch.isnan(torch.full((8,), 255, dtype=torch.uint8, device="cuda").view(dt)).all()


def _bitwise_repeats(q, k, v, dout, out, lse, causal, repeats, label, side_stream_work=False, schedule="auto"):
    kw = dict(causal=causal, deterministic=True, schedule=schedule)
    ref = [t.clone() for t in attention_backward(dout, q, k, v, out, lse, **kw)]
    side = torch.cuda.Stream() if side_stream_work else None
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) if side_stream_work else None
    for i in range(repeats):
        if side is not None:
            with torch.cuda.stream(side):
                for _ in range(4):
                    a = (a @ a).clamp_(-1, 1)
        grads = attention_backward(dout, q, k, v, out, lse, **kw)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
            assert torch.equal(g, r), f"{label}: repeat {i}: {name} differs bitwise from the first call"
    torch.cuda.synchronize()


# (batch, seqlen, heads, head_dim); the last has 2 x 8 x 16 = 256 columns, about two waves of 132 SMs
# (its columns restart on CTAs that finished one; the others fit in one wave at hdim 64 / 128).
@pytest.mark.parametrize("shape", [(2, 1536, 4, 64), (2, 1536, 4, 128), (2, 2048, 8, 64)],
                         ids=lambda s: "b{}_s{}_h{}_d{}".format(*s))
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_bitwise_100_repeats(shape, causal):
    batch, seqlen, heads, head_dim = shape
    seed = seed_of("det", shape, causal)
    q, k, v, dout = _inputs(batch, seqlen, seqlen, heads, heads, head_dim, torch.bfloat16, seed)
    out, lse = _forward(q, k, v, causal)
    _bitwise_repeats(q, k, v, dout, out, lse, causal, 100, f"{shape} causal={causal} {seed_tag(seed)}")


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_bitwise_with_busy_side_stream(causal):
    seed = seed_of("busy", causal)
    q, k, v, dout = _inputs(1, 2048, 2048, 8, 8, 128, torch.bfloat16, seed)
    out, lse = _forward(q, k, v, causal)
    _bitwise_repeats(q, k, v, dout, out, lse, causal, 100, f"busy side stream causal={causal} {seed_tag(seed)}",
                     side_stream_work=True)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_bitwise_1000_repeats(head_dim, causal):
    seed = seed_of("det1000", head_dim, causal)
    q, k, v, dout = _inputs(4, 2048, 2048, 8, 8, head_dim, torch.bfloat16, seed)
    out, lse = _forward(q, k, v, causal)
    _bitwise_repeats(q, k, v, dout, out, lse, causal, 1000, f"d={head_dim} causal={causal} {seed_tag(seed)}")


def test_deterministic_mode_really_orders_the_reduction():
    """The negative control of the determinism tests: the same order without its semaphores
    gives other bits from run to run, with them never; otherwise the tests above would prove
    nothing about the semaphore protocol.

    The order is forced to fa3's (non-deterministic auto picked shift here until 2026-12-06;
    shift starts the running columns of a head at different Q tiles, so their adds to one dQ
    tile are far apart in time and may land in the same order every run: a skip, before).
    fa3's order starts every column of a head at Q tile 0 and walks the tiles in step: at hdim
    128, full mask, 4096 keys, each dQ tile of 80 rows takes its 32 columns' fp32 reduce-adds
    within about one step of each other (132 SMs run the 32 columns of 4 of the 16 heads at
    once), 832 tiles of them (52 per head). Two runs whose add orders differ anywhere differ in the last fp32 bits of most of
    that tile's sums and, rounded to bf16, in about 2**-15 of the 8.4M dq elements (hundreds
    per run pair), so 30 runs that all equal the first mean the adds are ordered anyway."""
    seed = seed_of("nondet")
    tag = seed_tag(seed)
    q, k, v, dout = _inputs(1, 4096, 4096, 16, 16, 128, torch.bfloat16, seed)
    out, lse = _forward(q, k, v, False)
    nondet = dict(deterministic=False, schedule="fa3")
    first = attention_backward(dout, q, k, v, out, lse, **nondet)[0].clone()
    runs = 30
    differs = sum(not torch.equal(first, attention_backward(dout, q, k, v, out, lse, **nondet)[0])
                  for _ in range(runs))
    assert differs, (f"{tag}: the non-deterministic fa3-order backward gave bitwise the same dq in {runs + 1} "
                     "runs: its dQ adds are not racing, so the bitwise tests cannot tell the semaphores work")
    _bitwise_repeats(q, k, v, dout, out, lse, False, 20, f"fa3 order with semaphores {tag}", schedule="fa3")


@pytest.mark.parametrize("causal", [False, True])
def test_nondeterministic_agrees_with_deterministic(causal):
    seed = seed_of("agree", causal)
    q, k, v, dout = _inputs(2, 2000, 2000, 4, 4, 128, torch.bfloat16, seed)
    out, lse = _forward(q, k, v, causal)
    det = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    nondet = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=False)
    hi = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=torch.float64)
    lo = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, compute_dtype=q.dtype)
    for name, a, b, h, l in zip(("dq", "dk", "dv"), det, nondet, hi, lo):
        bound = reference.error_bound(h, l)
        diff = (a.double() - b.double()).abs().max().item()
        assert diff <= bound, f"causal={causal} {seed_tag(seed)}: {name} det vs non-det {diff:.3e} > {bound:.3e}"


def _main_kernel_lse_early(fn) -> bool:
    """Whether the one backward main kernel fn launches is the kLseEarly mainloop (its last
    template argument, read from the demangled name the profiler records)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if "bwd_main_kernel<" in e.name})
    assert len(names) == 1, f"expected one backward main kernel, the profiler saw {names}"
    found = re.search(r", (?:\(bool\))?(true|false|1|0)>\(", names[0])  # cxxabi or cu++filt style
    assert found, f"no kLseEarly template argument in {names[0]!r}"
    return found.group(1) in ("true", "1")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim,causal", [(128, True), (128, False), (64, True), (64, False)])
def test_lse_early_mainloop_runs_where_the_table_says(head_dim, causal, deterministic):
    """The mainloop that loads the LSE before the S^T GEMM runs exactly for the launches the
    config table marks per mode (lse_early_nondet, lse_early_det), and its gradients agree with
    the float64 reference. It once caught a stale build object that ran that mainloop in a mode
    the table did not mark (docs/kernel-notes.md, eighteenth pass)."""
    seed = seed_of("lse-early", head_dim, causal, deterministic)
    q, k, v, dout = _inputs(1, 1000, 1000, 2, 2, head_dim, torch.bfloat16, seed)
    out, lse = _forward(q, k, v, causal)
    grads = []
    early = _main_kernel_lse_early(
        lambda: grads.extend(attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)))
    cfg = bwd_tile_config(head_dim, causal)
    expected = cfg.lse_early_det if deterministic else cfg.lse_early_nondet
    assert early == expected, (f"hdim {head_dim} causal={causal} deterministic={deterministic}: kLseEarly "
                               f"mainloop {'ran' if early else 'did not run'}")
    _check_against_reference(q, k, v, dout, out, lse, causal, grads, f"lse-early {seed_tag(seed)}")


@pytest.mark.parametrize("causal", [False, True])
def test_sm_margin_and_fewer_ctas_same_result_per_grid(causal):
    """sm_margin shrinks the persistent grid to min(columns, SMs - sm_margin) CTAs.
    Deterministic auto picks a portable schedule for the shape alone (ranked for 132 CTAs on
    every grid), whose bits do not depend on the grid, so results stay bitwise equal across
    margins. 4 x 8 heads x 32 columns of 128 keys = 1024 columns, more than any grid: each
    margin launches a grid of its own (132, 131, 99 and 1 CTAs on 132 SMs)."""
    seed = seed_of("margin", causal)
    batch, seqlen, heads, head_dim = 4, 4096, 8, 64
    q, k, v, dout = _inputs(batch, seqlen, seqlen, heads, heads, head_dim, torch.bfloat16, seed)
    out, lse = _forward(q, k, v, causal)
    sms = _sms()
    margins = (1, 33, sms - 1)
    columns = batch * heads * -(-seqlen // bwd_tile_config(head_dim, causal).block_n)
    grids = [min(columns, sms - m) for m in (0, *margins)]
    assert len(set(grids)) == len(grids), f"margins {margins} launch the grids {grids}: some are the same"
    base = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    for margin in margins:
        got = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, sm_margin=margin)
        for name, a, b in zip(("dq", "dk", "dv"), base, got):
            assert torch.equal(a, b), f"causal={causal} {seed_tag(seed)}: sm_margin={margin} changed the bits of {name}"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("heads_k", [8, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_work_queued_after_the_backward_sees_every_gradient(causal, heads_k, deterministic):
    """With sm_margin 0 the dQ convert kernel runs under the main kernel's tail (programmatic
    dependent launch; deterministic CTAs wait per tile on the dQ semaphores, not for the main
    grid). Work queued on the stream right after the backward (here clones of dq, dk, dv, and
    under GQA the binding's dK/dV casts) must still run after the main kernel's last dK/dV
    stores: each clone, taken with no synchronisation, equals the gradient read after one."""
    seed = seed_of("queued-after", causal, heads_k, deterministic)
    q, k, v, dout = _inputs(2, 2048, 2048, 8, heads_k, 128, torch.bfloat16, seed)
    out, lse = _forward(q, k, v, causal)
    for rep in range(20):
        grads = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
        clones = [g.clone() for g in grads]  # queued behind the backward, no sync in between
        torch.cuda.synchronize()
        for name, g, c in zip(("dq", "dk", "dv"), grads, clones):
            assert torch.equal(g, c), (f"causal={causal} heads_k={heads_k} det={deterministic} rep {rep} "
                                       f"{seed_tag(seed)}: {name} read right after the backward differs from after a sync")


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_end_to_end(causal):
    seed = seed_of("e2e", causal)
    q, k, v, dout = _inputs(2, 777, 777, 4, 2, 128, torch.bfloat16, seed)
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flash_attn_func(qs, ks, vs, causal=causal, deterministic=True, return_attn_probs=True)
    out.backward(dout)
    label = f"e2e causal={causal} {seed_tag(seed)}"
    ref_out, ref_lse = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float64)
    lo_out, _ = reference.attention_forward(q, k, v, causal=causal, compute_dtype=q.dtype)
    reference.assert_within_bound(out, ref_out, lo_out, f"{label} out")
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=0), f"{label}: lse"
    _check_against_reference(q, k, v, dout, out.detach(), lse, causal, (qs.grad, ks.grad, vs.grad), label)


def test_deterministic_follows_torch_global_flag(monkeypatch):
    """deterministic=None follows torch.are_deterministic_algorithms_enabled(): with the flag on,
    flash_attn_func's forward gets deterministic=True (its autograd node runs the backward with
    it) and attention_backward runs the deterministic backward; False with the flag on raises
    PyTorch's non-determinism alert; with the flag off, None is False."""
    from dash import api

    seed = seed_of("flag")
    q, k, v, dout = _inputs(1, 256, 256, 2, 2, 64, torch.bfloat16, seed)
    out, lse = _forward(q, k, v, False)
    seen = []

    def spy(fn):
        def wrapper(*args, **kwargs):
            seen.append((fn.__name__, inspect.signature(fn).bind(*args, **kwargs).arguments["deterministic"]))
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(api, "run_forward", spy(api.run_forward))
    monkeypatch.setattr(api, "run_backward", spy(api.run_backward))
    qs = q.detach().requires_grad_()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="deterministic"):
            flash_attn_func(qs, k, v, deterministic=False)
        assert seen == [], "the refused call reached an op"
        flash_attn_func(qs, k, v).backward(dout)  # deterministic=None follows the flag
        flag_grads = attention_backward(dout, q, k, v, out, lse)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [("run_forward", True), ("run_backward", True)], seen
    # The deterministic kernel's bits, as asked for explicitly (same shape, same auto schedule).
    explicit = attention_backward(dout, q, k, v, out, lse, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), flag_grads, explicit):
        assert torch.equal(a, b), f"{seed_tag(seed)}: {name} under the flag differs from deterministic=True"
    seen.clear()
    attention_backward(dout, q, k, v, out, lse)
    assert seen == [("run_backward", False)], seen


def test_opcheck_ops():
    q, k, v, dout = _inputs(1, 200, 300, 2, 2, 64, torch.bfloat16, seed_of("opcheck"))
    out, lse = _forward(q, k, v, False)
    torch.library.opcheck(torch.ops.dash.bwd.default,
                          (dout, q, k, v, out, lse, 0.125, False, True, "fa3", 0))
    torch.library.opcheck(torch.ops.dash.fwd.default, (q, k, v, 0.125, True, True, "fa3", 0))


def test_torch_compile_fullgraph():
    seed = seed_of("compile")
    q, k, v, dout = _inputs(1, 512, 512, 2, 2, 128, torch.bfloat16, seed)

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic=True)

    compiled = torch.compile(step, fullgraph=True)
    qs = q.detach().requires_grad_()
    compiled(qs, k, v).backward(dout)
    q2 = q.detach().requires_grad_()
    step(q2, k, v).backward(dout)
    assert torch.equal(qs.grad, q2.grad), f"{seed_tag(seed)}: compiled dq differs from eager"


def test_window_equivalent_to_causal_runs_the_causal_kernel():
    """FA3's normalisation: window_size=(-1, 0) is the causal mask; results are bitwise the
    same as causal=True."""
    seed = seed_of("window")
    q, k, v, dout = _inputs(1, 300, 500, 2, 2, 64, torch.bfloat16, seed)
    grads = []
    for kwargs in (dict(causal=True), dict(window_size=(-1, 0))):
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        flash_attn_func(qs, ks, vs, deterministic=True, **kwargs).backward(dout)
        grads.append((qs.grad, ks.grad, vs.grad))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), f"{seed_tag(seed)}: {name} of window_size=(-1, 0) differs from causal=True"


@pytest.mark.parametrize("heads_k", [2, 8], ids=["gqa_8_over_2", "mha_8"])
def test_dk_dv_keep_the_layout_of_k_and_v(heads_k):
    """dk/dv come back in k's/v's layout (what the op's fake promises torch.compile), under GQA
    (8 query heads over 2 KV heads: the kernel accumulates into contiguous fp32 group buffers)
    and MHA (it stores into dk/dv through their strides). A permuted (B, H, S, D) k/v gives
    bitwise the gradients of contiguous k/v: eager and compiled calls on the permuted layout
    run the same kernel, so a stride bug would give both the same wrong bits; the contiguous
    call is the independent check (and is checked against the reference)."""
    seed = seed_of("kv-layout", heads_k)
    tag = f"heads_k={heads_k} {seed_tag(seed)}"
    q, k, v, dout = _inputs(2, 384, 384, 8, heads_k, 64, torch.bfloat16, seed)
    k_bhsd = k.transpose(1, 2).contiguous().transpose(1, 2)  # (B, S, H, D) view of a (B, H, S, D) tensor
    v_bhsd = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_bhsd.is_contiguous() and torch.equal(k_bhsd, k) and torch.equal(v_bhsd, v)
    out, lse = _forward(q, k, v, True)
    op_args = (0.125, True, True, "fa3", 0)  # scale 64 ** -0.5, causal, deterministic, schedule, sm_margin
    contiguous = torch.ops.dash.bwd(dout, q, k, v, out, lse, *op_args)
    _check_against_reference(q, k, v, dout, out, lse, True, contiguous, tag)
    permuted = torch.ops.dash.bwd(dout, q, k_bhsd, v_bhsd, out, lse, *op_args)
    assert permuted[1].stride() == k_bhsd.stride() and permuted[2].stride() == v_bhsd.stride(), tag
    for name, a, b in zip(("dq", "dk", "dv"), permuted, contiguous):
        assert torch.equal(a, b), f"{tag}: {name} of (B, H, S, D) k/v differs from that of contiguous k/v"
    torch.library.opcheck(torch.ops.dash.bwd.default, (dout, q, k_bhsd, v_bhsd, out, lse, *op_args))

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic=True)

    grads = []
    for fn, kk, vv in ((step, k, v), (step, k_bhsd, v_bhsd), (torch.compile(step, fullgraph=True), k_bhsd, v_bhsd)):
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, kk, vv))
        fn(qs, ks, vs).backward(dout)
        grads.append((qs.grad, ks.grad, vs.grad))
    for name, a, b, c in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(b, a), f"{tag}: eager {name} of (B, H, S, D) k/v differs from that of contiguous k/v"
        assert torch.equal(c, a), f"{tag}: compiled {name} of (B, H, S, D) k/v differs from eager contiguous"


def test_gradient_at_a_misaligned_offset_is_accepted():
    """cat's backward hands the attention output's gradient over as a contiguous slice at an
    odd storage offset (not 16-byte aligned, which TMA needs): the op copies it and the
    gradients are bitwise those of an aligned gradient."""
    seed = seed_of("misaligned")
    q, k, v, dout = _inputs(1, 256, 256, 2, 2, 128, torch.bfloat16, seed)
    grads = []
    for pad in (3, 8):
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_attn_func(qs, ks, vs, causal=True, deterministic=True)
        flat = torch.cat([torch.zeros(pad, device="cuda", dtype=out.dtype), out.flatten()])
        weight = torch.cat([torch.zeros(pad, device="cuda", dtype=out.dtype), dout.flatten()])
        (flat.float() * weight.float()).sum().backward()
        grads.append((qs.grad, ks.grad, vs.grad))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), f"{seed_tag(seed)}: {name} at a misaligned gradient differs from an aligned one"


def test_forward_op_refuses_a_schedule_its_backward_cannot_run():
    """dash::fwd carries the schedule for the backward it saves; a bad one is refused at the
    forward, before activations are kept for a backward that cannot run."""
    q, k, v, _ = _inputs(1, 128, 128, 2, 2, 64, torch.bfloat16, seed_of("fwd-schedule"))
    with pytest.raises(NotImplementedError, match="bogus"):
        torch.ops.dash.fwd(q, k, v, 0.125, False, True, "bogus", 0)
    with pytest.raises(NotImplementedError, match="shift"):
        torch.ops.dash.fwd(q, k, v, 0.125, True, True, "shift", 0)
