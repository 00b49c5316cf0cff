"""Input validation of DASH's FA3-compatible API, on CPU.

Every bad input must raise the right exception type with a message that names the argument,
the offending value and what is supported. CPU tensors exercise the device check directly;
the checks that come after it run through ``validate_inputs(..., check_device=False)``.
Nothing here launches a kernel.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dash  # noqa: E402
from dash import _ext, api, interface, ops  # noqa: E402
from dash.api import attention_backward, flash_attn_func, flash_attn_qkvpacked_func  # noqa: E402
from dash.config import KERNEL_SCHEDULES, PORTABLE_KERNEL_SCHEDULES, SUPPORTED_HEAD_DIMS  # noqa: E402
from dash.validation import SCHEDULE_NAMES, validate_inputs  # noqa: E402

#: Folder holding the dash package under test; subprocesses import the same dash through PYTHONPATH.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dash.__file__)))
SUPPORTED_TEXT = ", ".join(str(d) for d in SUPPORTED_HEAD_DIMS)
NOT_IMPLEMENTED_SCHEDULES = [n for n in SCHEDULE_NAMES if n != "auto" and n not in KERNEL_SCHEDULES]

#: hopper/flash_attn_interface.py::flash_attn_func, parameter names in order, with defaults.
FA3_FLASH_ATTN_FUNC = [
    ("q", inspect.Parameter.empty),
    ("k", inspect.Parameter.empty),
    ("v", inspect.Parameter.empty),
    ("softmax_scale", None),
    ("causal", False),
    ("qv", None),
    ("q_descale", None),
    ("k_descale", None),
    ("v_descale", None),
    ("window_size", (-1, -1)),
    ("attention_chunk", 0),
    ("softcap", 0.0),
    ("num_splits", 1),
    ("pack_gqa", None),
    ("deterministic", False),
    ("sm_margin", 0),
    ("return_attn_probs", False),
]
#: hopper/flash_attn_interface.py::flash_attn_qkvpacked_func, parameter names in order.
FA3_QKVPACKED = ["qkv", "softmax_scale", "causal", "q_descale", "k_descale", "v_descale", "window_size",
                 "attention_chunk", "softcap", "deterministic", "num_heads_q", "sm_margin", "return_attn_probs"]


def _qkv(batch=2, seqlen_q=16, seqlen_k=None, heads=4, heads_kv=None, head_dim=64, dtype=torch.bfloat16):
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    heads_kv = heads if heads_kv is None else heads_kv
    q = torch.randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype)
    return q, k, v


def _validate(q, k, v, **kw):
    return validate_inputs(q, k, v, check_device=False, **kw)


def _err(excinfo) -> str:
    return str(excinfo.value)


def _same_view(a, b) -> bool:
    """a and b are the same elements of the same storage (the same view, not a copy)."""
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


# ---------------------------------------------------------------------------------------
# Tensors: type, rank, dtype, emptiness, layout
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("check_device", [True, False])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [[[1.0]], None, 3.0], ids=["list", "None", "float"])
def test_non_tensor_is_type_error(which, bad, check_device):
    args = dict(zip("qkv", _qkv()))
    args[which] = bad
    with pytest.raises(TypeError) as e:
        validate_inputs(args["q"], args["k"], args["v"], check_device=check_device)
    msg = _err(e)
    assert msg.startswith(f"{which} ") and "torch.Tensor" in msg and type(bad).__name__ in msg


def test_non_tensor_through_flash_attn_func():
    q, k, _ = _qkv()
    with pytest.raises(TypeError, match=r"^v must be a torch.Tensor, got ndarray"):
        flash_attn_func(q, k, q.float().numpy())


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(16, 4, 64), (2, 16, 4, 1, 64), (64,)])
def test_wrong_number_of_dims(which, shape):
    args = dict(zip("qkv", _qkv()))
    args[which] = torch.randn(*shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        _validate(args["q"], args["k"], args["v"])
    msg = _err(e)
    assert msg.startswith(f"{which} must have 4 dims") and str(tuple(shape)) in msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_unsupported_dtype(dtype):
    q, k, v = _qkv()
    q = q.to(dtype)
    with pytest.raises(ValueError) as e:
        _validate(q, k.to(dtype), v.to(dtype))
    msg = _err(e)
    assert msg.startswith("q ") and str(dtype) in msg
    assert "bfloat16" in msg and "float16" in msg


@pytest.mark.parametrize("which", ["k", "v"])
def test_mixed_dtypes(which):
    args = dict(zip("qkv", _qkv(dtype=torch.bfloat16)))
    args[which] = args[which].to(torch.float16)
    with pytest.raises(ValueError) as e:
        _validate(args["q"], args["k"], args["v"])
    msg = _err(e)
    assert msg.startswith(f"{which} has dtype torch.float16") and "torch.bfloat16" in msg


@pytest.mark.parametrize(
    "which, shapes",
    [
        ("q", dict(q=(0, 16, 4, 64), k=(0, 16, 4, 64), v=(0, 16, 4, 64))),  # batch 0
        ("q", dict(q=(2, 0, 4, 64), k=(2, 16, 4, 64), v=(2, 16, 4, 64))),  # seqlen_q 0
        ("k", dict(q=(2, 16, 4, 64), k=(2, 0, 4, 64), v=(2, 0, 4, 64))),  # seqlen_k 0
        ("q", dict(q=(2, 16, 0, 64), k=(2, 16, 4, 64), v=(2, 16, 4, 64))),  # heads 0
        ("k", dict(q=(2, 16, 4, 64), k=(2, 16, 0, 64), v=(2, 16, 0, 64))),  # heads_kv 0
        ("v", dict(q=(2, 16, 4, 64), k=(2, 16, 4, 64), v=(2, 16, 4, 0))),  # v head_dim 0
    ],
    ids=["batch0", "seqlen_q0", "seqlen_k0", "heads0", "heads_kv0", "v_head_dim0"],
)
def test_empty_tensors(which, shapes):
    t = {n: torch.randn(*s, dtype=torch.float16) for n, s in shapes.items()}
    with pytest.raises(ValueError) as e:
        _validate(t["q"], t["k"], t["v"])
    msg = _err(e)
    assert msg.startswith(f"{which} is empty") and str(shapes[which]) in msg and ">= 1" in msg


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_last_dim_not_contiguous_transposed(which):
    args = dict(zip("qkv", _qkv()))
    b, s, h, d = args[which].shape
    bad = torch.randn(b, s, d, h, dtype=torch.bfloat16).transpose(-1, -2)  # (b, s, h, d), stride(-1) == h
    assert bad.shape == args[which].shape and bad.stride(-1) == h
    args[which] = bad
    with pytest.raises(ValueError) as e:
        _validate(args["q"], args["k"], args["v"])
    msg = _err(e)
    assert msg.startswith(f"{which} must be contiguous in its last dim")
    assert str(tuple(bad.stride())) in msg and ".contiguous()" in msg


def test_last_dim_strided_slice():
    q, k, v = _qkv()
    q = torch.randn(2, 16, 4, 128, dtype=torch.bfloat16)[..., ::2]  # head_dim 64 with stride 2
    with pytest.raises(ValueError, match=r"^q must be contiguous in its last dim .*\(8192, 512, 128, 2\)"):
        _validate(q, k, v)


# ---------------------------------------------------------------------------------------
# Shape agreement between q, k, v
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["k", "v"])
def test_batch_mismatch(which):
    args = dict(zip("qkv", _qkv(batch=2)))
    args[which] = torch.randn(3, 16, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        _validate(args["q"], args["k"], args["v"])
    msg = _err(e)
    assert "batch" in msg and "q 2" in msg and f"{which} 3" in msg


def test_seqlen_k_mismatch_between_k_and_v():
    q, k, _ = _qkv(seqlen_q=16, seqlen_k=16)
    v = torch.randn(2, 24, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        _validate(q, k, v)
    msg = _err(e)
    assert "seqlen_k" in msg and "k (16)" in msg and "v (24)" in msg


def test_heads_mismatch_between_k_and_v():
    q, k, _ = _qkv(heads=8, heads_kv=4)
    v = torch.randn(2, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        _validate(q, k, v)
    msg = _err(e)
    assert "heads" in msg and "k (4)" in msg and "v (2)" in msg


@pytest.mark.parametrize("heads, heads_kv", [(6, 4), (4, 8), (7, 2), (5, 3)])
def test_heads_not_divisible(heads, heads_kv):
    q, k, v = _qkv(heads=heads, heads_kv=heads_kv)
    with pytest.raises(ValueError) as e:
        _validate(q, k, v)
    msg = _err(e)
    assert f"q has {heads} heads" in msg and f"{heads_kv} heads of k/v" in msg and "divisible" in msg


def test_k_head_dim_differs_from_q():
    q, _, v = _qkv(head_dim=64)
    k = torch.randn(2, 16, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        _validate(q, k, v)
    msg = _err(e)
    assert "k has head_dim 128" in msg and "q has 64" in msg


@pytest.mark.parametrize("dv", [128, 32])
def test_v_head_dim_differs_is_not_implemented(dv):
    q, k, _ = _qkv(head_dim=64)
    v = torch.randn(2, 16, 4, dv, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError) as e:
        _validate(q, k, v)
    msg = _err(e)
    assert msg.startswith(f"v has head_dim {dv}") and "64" in msg and "not supported yet" in msg


@pytest.mark.parametrize("head_dim", [16, 32, 80, 96, 192, 256])
def test_unsupported_head_dim(head_dim):
    assert head_dim not in SUPPORTED_HEAD_DIMS
    q, k, v = _qkv(head_dim=head_dim)
    with pytest.raises(NotImplementedError) as e:
        _validate(q, k, v)
    msg = _err(e)
    assert f"head_dim={head_dim}" in msg and "not supported yet" in msg and SUPPORTED_TEXT in msg


def test_supported_head_dims_are_64_and_128():
    assert SUPPORTED_TEXT == "64, 128"


# ---------------------------------------------------------------------------------------
# Scalar arguments
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [0, 0.0, -1.0, -0.125, math.nan, math.inf, -math.inf])
def test_bad_softmax_scale_number(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError) as e:
        _validate(q, k, v, softmax_scale=scale)
    msg = _err(e)
    assert f"softmax_scale={scale!r}" in msg and "finite positive" in msg


def test_bad_softmax_scale_string():
    q, k, v = _qkv()
    with pytest.raises((TypeError, ValueError)) as e:
        _validate(q, k, v, softmax_scale="0.125")
    msg = _err(e)
    assert "softmax_scale='0.125'" in msg and "finite positive" in msg


@pytest.mark.parametrize("scale", [None, 0.125, 1, 2.5, 1e-6])
def test_good_softmax_scale(scale):
    assert _validate(*_qkv(), softmax_scale=scale) is None


@pytest.mark.parametrize("causal", [1, 0, "True", None, 1.0], ids=repr)
def test_causal_not_bool(causal):
    q, k, v = _qkv()
    with pytest.raises(TypeError) as e:
        _validate(q, k, v, causal=causal)
    msg = _err(e)
    assert "causal must be a bool" in msg and repr(causal) in msg


@pytest.mark.parametrize("window", [(0, 0), (128, -1), [64, 64], (-1, 128)], ids=str)
def test_window_size_not_supported(window):
    q, k, v = _qkv(seqlen_q=512)
    with pytest.raises(NotImplementedError) as e:
        _validate(q, k, v, window_size=window)
    msg = _err(e)
    assert f"window_size={tuple(window)}" in msg and "not supported yet" in msg and "(-1, -1)" in msg


@pytest.mark.parametrize("window, causal, seqlens, expect_causal", [
    ((-1, -1), False, (512, 512), False),
    ((-1, 0), False, (512, 512), True),      # FA3: (unbounded, 0) is the causal mask
    ((-1, 7), True, (512, 512), True),       # causal forces the right side to 0
    ((600, -1), False, (512, 512), False),   # a side at least as long as the sequence is unbounded
    ((511, 600), False, (512, 512), False),
    ((700, 0), False, (300, 700), True),
])
def test_windows_equivalent_to_supported_masks_are_accepted(window, causal, seqlens, expect_causal):
    from dash.validation import effective_causal

    q, k, v = _qkv(seqlen_q=seqlens[0], seqlen_k=seqlens[1])
    assert _validate(q, k, v, window_size=window, causal=causal) is None
    assert effective_causal(window, causal, *seqlens) is expect_causal


@pytest.mark.parametrize("window", [None, (1,), (1, 2, 3), (1.5, 2), (True, -1)], ids=repr)
def test_window_size_malformed(window):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        _validate(q, k, v, window_size=window)


def test_window_size_default_as_list_is_accepted():
    assert _validate(*_qkv(), window_size=[-1, -1]) is None


def test_window_size_as_an_array_names_the_argument():
    """An array or tensor pair is refused by name (its == would not give one bool)."""
    np = pytest.importorskip("numpy")
    for window in (np.array([-1, -1]), torch.tensor([-1, -1])):
        with pytest.raises(TypeError, match=r"^window_size must be a pair of ints \(left, right\)"):
            _validate(*_qkv(), window_size=window)


@pytest.mark.parametrize("softcap", [1.0, 30.0, -5.0, 0.5])
def test_softcap_not_supported(softcap):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError) as e:
        _validate(q, k, v, softcap=softcap)
    msg = _err(e)
    assert f"softcap={softcap}" in msg and "not supported yet" in msg and "0.0" in msg


@pytest.mark.parametrize("sm_margin", [-1, -8, 1.5, 2.0, "1", True, False, None], ids=repr)
def test_bad_sm_margin(sm_margin):
    q, k, v = _qkv()
    with pytest.raises(ValueError) as e:
        _validate(q, k, v, sm_margin=sm_margin)
    msg = _err(e)
    assert f"sm_margin={sm_margin!r}" in msg and "int >= 0" in msg


@pytest.mark.parametrize("sm_margin", [0, 1, 8, 100])
def test_good_sm_margin_without_device(sm_margin):
    assert _validate(*_qkv(), sm_margin=sm_margin) is None


@pytest.mark.parametrize("det", [1, 0, "yes", 1.0], ids=repr)
def test_bad_deterministic(det):
    q, k, v = _qkv()
    with pytest.raises(TypeError) as e:
        _validate(q, k, v, deterministic=det)
    msg = _err(e)
    assert "deterministic must be None or a bool" in msg and repr(det) in msg


@pytest.mark.parametrize("det", [None, True, False])
def test_good_deterministic(det):
    assert _validate(*_qkv(), deterministic=det) is None


# ---------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------
def test_schedule_name_tables():
    from dash.schedules.orders import SCHEDULE_NAMES as MODEL_NAMES

    assert SCHEDULE_NAMES == ("auto",) + MODEL_NAMES
    assert len(set(SCHEDULE_NAMES)) == len(SCHEDULE_NAMES)
    assert "fa3" in KERNEL_SCHEDULES and set(KERNEL_SCHEDULES) <= set(SCHEDULE_NAMES)
    assert NOT_IMPLEMENTED_SCHEDULES, "every modelled schedule is implemented: drop this test's NotImplemented cases"
    q, k, _ = _qkv()
    for causal in (False, True):
        for det in (False, True):
            # Deterministic auto picks a schedule whose bits do not depend on the GPU; without
            # determinism any kernel schedule may run (shift under a full mask).
            picked = ops.resolve_schedule("auto", q, k, causal, det, 0)
            assert picked in (PORTABLE_KERNEL_SCHEDULES if det else KERNEL_SCHEDULES), (causal, det, picked)
    assert set(PORTABLE_KERNEL_SCHEDULES) < set(KERNEL_SCHEDULES)
    for name in KERNEL_SCHEDULES:
        assert ops.resolve_schedule(name, q, k, False, True, 0) == name


def _schedule_index(q, k, causal, det):
    return q.new_zeros(()) + KERNEL_SCHEDULES.index(ops.resolve_schedule("auto", q, k, causal, det, 0))


def _compiled_auto_matches_eager(compiled, shapes, head_dim: int, det: bool) -> set:
    """Calls ``compiled`` (``_schedule_index`` under torch.compile) on every (b, sq, sk, h, hk) of
    ``shapes`` under both masks, asserts each pick equals eager mode's, and returns the picks."""
    seen = set()
    for causal in (True, False):
        for b, sq, sk, h, hk in shapes:
            q = torch.empty(b, sq, h, head_dim, dtype=torch.bfloat16)
            k = torch.empty(b, sk, hk, head_dim, dtype=torch.bfloat16)
            eager = ops.resolve_schedule("auto", q, k, causal, det, 0)
            got = KERNEL_SCHEDULES[int(compiled(q, k, causal, det))]
            assert got == eager, (det, causal, b, sq, sk, h, hk, head_dim, got, eager)
            seen.add(eager)
    return seen


@pytest.mark.parametrize("det", [True, False], ids=["deterministic", "nondeterministic"])
def test_auto_schedule_under_torch_compile_with_dynamic_shapes(det):
    """Under torch.compile with dynamic shapes the sizes are symbolic while tracing; auto must
    still pick what eager mode picks for each shape (the bits depend on the pick), not fail
    inside Dynamo (it did: AsPythonConstantNotImplementedError) and not bake in the first
    shape's pick. Deterministic: the graph is specialised per shape (one graph each);
    non-deterministic: the rule is traced on the symbolic sizes, so a few graphs (guards on
    size ranges) serve every shape. The shapes get different picks in both modes."""
    shapes = [(2, 512, 512, 4, 4), (8, 512, 512, 16, 16), (2, 1024, 700, 4, 2), (4, 1024, 1024, 8, 2),
              (2, 3000, 3000, 2, 2), (3, 640, 896, 6, 3), (2, 2048, 4096, 4, 4), (4, 4096, 4096, 2, 2)]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    # Deterministic: one graph per (shape, mask), more than Dynamo's default limit of 8.
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(**{limit: 64}):
            compiled = torch.compile(_schedule_index, fullgraph=True, dynamic=True, backend=backend)
            seen = _compiled_auto_matches_eager(compiled, shapes, 64, det)
    finally:
        torch._dynamo.reset()
    assert len(seen) >= 2, f"the shapes must get different picks for this test to mean anything: {seen}"
    calls = 2 * len(shapes)
    if det:
        assert len(graphs) == calls, f"deterministic auto specialises per shape: {len(graphs)} graphs, {calls} calls"
    else:
        assert len(graphs) <= 6, f"the non-deterministic rule should not specialise per shape: {len(graphs)} graphs"


def test_nondeterministic_auto_under_torch_compile_at_hdim_128():
    """The non-deterministic rule's hdim-128 branches (shift from 16384 queries under a full mask
    where shift_lanes allows, interleaved below 2048 under a causal one) traced on symbolic sizes
    pick what eager mode picks."""
    shapes = [(1, 16384, 16384, 2, 2), (1, 8192, 8192, 2, 2), (1, 20000, 40000, 2, 1), (2, 1024, 1024, 2, 2),
              (1, 3000, 3000, 2, 2)]
    torch._dynamo.reset()
    try:
        compiled = torch.compile(_schedule_index, fullgraph=True, dynamic=True)
        seen = _compiled_auto_matches_eager(compiled, shapes, 128, False)
    finally:
        torch._dynamo.reset()
    assert seen == {"shift", "fa3", "interleaved", "descending"}, seen


@pytest.mark.parametrize("det", [True, False], ids=["deterministic", "nondeterministic"])
def test_auto_schedule_under_symbolic_tracing_outside_dynamo(det):
    """make_fx / non-strict export trace with SymInts outside Dynamo: auto specialises them
    (guard_int) instead of failing on int("s0")."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q = torch.empty(2, 512, 4, 64, dtype=torch.bfloat16)
    gm = make_fx(lambda q, k: _schedule_index(q, k, True, det), tracing_mode="symbolic")(q, q)
    assert int(gm(q, q)) == KERNEL_SCHEDULES.index(ops.resolve_schedule("auto", q, q, True, det, 0))


@pytest.mark.parametrize("schedule", ["bogus", "FA3", "", "all", "Auto", None], ids=repr)
def test_unknown_schedule(schedule):
    q, k, v = _qkv()
    with pytest.raises(ValueError) as e:
        _validate(q, k, v, schedule=schedule)
    msg = _err(e)
    assert f"schedule={schedule!r}" in msg and "unknown" in msg
    for name in SCHEDULE_NAMES:
        assert name in msg


@pytest.mark.parametrize("schedule", NOT_IMPLEMENTED_SCHEDULES)
def test_modelled_but_not_implemented_schedule(schedule):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError) as e:
        _validate(q, k, v, schedule=schedule)
    msg = _err(e)
    assert f"schedule={schedule!r}" in msg and "modelled" in msg and "not implemented" in msg
    assert "fa3" in msg
    for name in KERNEL_SCHEDULES:
        assert name in msg


@pytest.mark.parametrize("schedule", ("auto",) + KERNEL_SCHEDULES)
def test_implemented_schedules_pass(schedule):
    assert _validate(*_qkv(), schedule=schedule) is None


# ---------------------------------------------------------------------------------------
# flash_attn_func's FA3 arguments DASH does not support
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arg", ["qv", "q_descale", "k_descale", "v_descale"])
def test_flash_attn_func_unsupported_tensor_args(arg):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError) as e:
        flash_attn_func(q, k, v, **{arg: torch.ones(1)})
    msg = _err(e)
    assert msg.startswith(arg) and "not supported yet" in msg and f"{arg}=None" in msg


def test_flash_attn_func_attention_chunk():
    with pytest.raises(NotImplementedError, match=r"^attention_chunk=128 is not supported yet; use 0"):
        flash_attn_func(*_qkv(), attention_chunk=128)


@pytest.mark.parametrize("num_splits", [2, 4, -1])
def test_flash_attn_func_num_splits(num_splits):
    with pytest.raises(NotImplementedError) as e:
        flash_attn_func(*_qkv(), num_splits=num_splits)
    msg = _err(e)
    assert f"num_splits={num_splits}" in msg and "not supported yet" in msg and "use 1" in msg


@pytest.mark.parametrize("kw", [dict(num_splits=0), dict(num_splits=1), dict(pack_gqa=True), dict(pack_gqa=False),
                                dict(return_attn_probs=True)], ids=str)
def test_flash_attn_func_accepted_fa3_options_reach_the_device_check(kw):
    """num_splits 0/1 and pack_gqa are FA3 performance knobs DASH accepts: on CPU they get as far
    as the device check."""
    with pytest.raises(ValueError, match=r"^q is on device cpu"):
        flash_attn_func(*_qkv(), **kw)


@pytest.mark.parametrize("shape", [(2, 16, 2, 4, 64), (2, 16, 4, 3, 64), (2, 16, 12, 64), (2, 16, 3, 4, 64, 1)],
                         ids=str)
def test_qkvpacked_wrong_shape(shape):
    qkv = torch.randn(*shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        flash_attn_qkvpacked_func(qkv)
    msg = _err(e)
    assert msg.startswith("qkv must be (batch, seqlen, 3, heads, head_dim)") and str(shape) in msg


@pytest.mark.parametrize("num_heads_q", [4, 7])
def test_qkvpacked_5d_ignores_num_heads_q_as_fa3_does(num_heads_q, cpu_as_sm90):
    """FA3 reads num_heads_q only for the 4-dim layout; a 5-dim qkv is unbound whatever it says."""
    qkv = torch.randn(2, 16, 3, 4, 64, dtype=torch.bfloat16)
    flash_attn_qkvpacked_func(qkv, num_heads_q=num_heads_q)
    (call,) = cpu_as_sm90
    for i, name in enumerate("qkv"):
        assert _same_view(call[name], qkv[:, :, i]), name


@pytest.mark.parametrize("num_heads_q", [7, 12, 13, 0, -2])
def test_qkvpacked_4d_bad_num_heads_q(num_heads_q):
    qkv = torch.randn(2, 16, 12, 64, dtype=torch.bfloat16)  # 12 = heads_q + 2 * heads_kv
    with pytest.raises(ValueError) as e:
        flash_attn_qkvpacked_func(qkv, num_heads_q=num_heads_q)
    msg = _err(e)
    assert "qkv has 12 heads" in msg and f"num_heads_q={num_heads_q}" in msg


def test_qkvpacked_non_tensor():
    with pytest.raises(TypeError, match=r"^qkv must be a torch.Tensor, got list"):
        flash_attn_qkvpacked_func([[1.0]])


@pytest.mark.parametrize("qkv_shape, num_heads_q", [((2, 16, 3, 4, 64), None), ((2, 16, 12, 128), 8),
                                                     ((2, 16, 8, 64), 6)], ids=str)
def test_qkvpacked_valid_shape_reaches_device_check(qkv_shape, num_heads_q):
    qkv = torch.randn(*qkv_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        flash_attn_qkvpacked_func(qkv, 0.125, True, deterministic=True, num_heads_q=num_heads_q, schedule="fa3")
    _assert_device_error(_err(e))


@pytest.mark.parametrize("causal, window_size", [(True, (-1, -1)), (False, (-1, 0))])
@pytest.mark.parametrize("layout", ["5d", "4d_gqa"])
def test_qkvpacked_forwards_its_arguments_to_the_forward(layout, causal, window_size, cpu_as_sm90):
    """What the packed entry point hands on arrives at the forward: the q, k, v views of qkv
    and every option, each different from its default (window_size (-1, 0) with causal=False
    is the causal mask only if the window arrives; the default scale would be 0.125)."""
    if layout == "5d":
        qkv = torch.randn(2, 16, 3, 4, 64, dtype=torch.float16)
        views, num_heads_q = qkv.unbind(dim=2), None
    else:
        qkv = torch.randn(2, 16, 8 + 2 * 2, 64, dtype=torch.float16)
        views, num_heads_q = qkv.split([8, 2, 2], dim=2), 8
    out, lse = flash_attn_qkvpacked_func(qkv, 0.25, causal, window_size=window_size, softcap=0.0, deterministic=True,
                                         num_heads_q=num_heads_q, sm_margin=3, return_attn_probs=True,
                                         schedule="descending")
    (call,) = cpu_as_sm90
    for name, view in zip("qkv", views):
        assert _same_view(call[name], view), name
    assert (call["softmax_scale"], call["causal"], call["deterministic"], call["schedule"], call["sm_margin"]) == (
        0.25, True, True, "descending", 3)
    assert out.shape == views[0].shape and lse.shape == (2, views[0].shape[2], 16)


@pytest.mark.parametrize("kw, error, text", [
    (dict(softcap=1.0), NotImplementedError, "softcap=1.0"),
    (dict(softcap=None), TypeError, "softcap must be a float"),
    (dict(window_size=(8, 8)), NotImplementedError, "window_size=(8, 8)"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(deterministic="yes"), TypeError, "deterministic must be None or a bool"),
    (dict(schedule="bogus"), ValueError, "schedule='bogus' is unknown"),
    (dict(sm_margin=-1), ValueError, "sm_margin=-1"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale=-1.0"),
], ids=str)
def test_qkvpacked_forwards_bad_arguments_to_validation(kw, error, text, cpu_as_sm90):
    """Each bad option given to the packed entry point is refused by validation, by name, on a
    device that passes the device checks (so the error is the option's, not the device's)."""
    qkv = torch.randn(2, 16, 3, 4, 64, dtype=torch.float16)
    with pytest.raises(error) as e:
        flash_attn_qkvpacked_func(qkv, **kw)
    assert text in _err(e)
    assert cpu_as_sm90 == []


@pytest.mark.parametrize("arg", ["q_descale", "k_descale", "v_descale"])
def test_qkvpacked_fp8_descale_not_supported(arg):
    qkv = torch.randn(2, 16, 3, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=rf"^{arg} \(FP8 attention\) is not supported yet"):
        flash_attn_qkvpacked_func(qkv, **{arg: torch.ones(1)})


def test_qkvpacked_attention_chunk_not_supported():
    qkv = torch.randn(2, 16, 3, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"^attention_chunk=64 is not supported yet"):
        flash_attn_qkvpacked_func(qkv, attention_chunk=64)


def test_qkvpacked_signature_matches_fa3():
    params = list(inspect.signature(dash.flash_attn_qkvpacked_func).parameters)
    assert params == FA3_QKVPACKED + ["schedule"]


def test_qkvpacked_fa3_positional_call_reaches_device_check():
    qkv = torch.randn(2, 16, 3, 4, 64, dtype=torch.bfloat16)
    # FA3: (qkv, softmax_scale, causal, q_descale, k_descale, v_descale, window_size, attention_chunk, softcap,
    #       deterministic, num_heads_q, sm_margin, return_attn_probs)
    with pytest.raises(ValueError) as e:
        flash_attn_qkvpacked_func(qkv, None, False, None, None, None, (-1, -1), 0, 0.0, True, None, 0, True)
    _assert_device_error(_err(e))
    # FA3's positions reach the right parameters: 4th is q_descale (not qv), 8th attention_chunk.
    with pytest.raises(NotImplementedError, match=r"^q_descale \(FP8 attention\)"):
        flash_attn_qkvpacked_func(qkv, None, False, torch.ones(1))
    with pytest.raises(NotImplementedError, match=r"^v_descale \(FP8 attention\)"):
        flash_attn_qkvpacked_func(qkv, None, False, None, None, torch.ones(1))
    with pytest.raises(NotImplementedError, match=r"^attention_chunk=64 "):
        flash_attn_qkvpacked_func(qkv, None, False, None, None, None, (-1, -1), 64)


# ---------------------------------------------------------------------------------------
# Valid inputs pass; the device check comes first
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads, heads_kv", [(4, 4), (8, 2), (6, 1)], ids=["MHA", "GQA8/2", "MQA6/1"])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(16, 16), (8, 40), (33, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_valid_inputs_pass(dtype, head_dim, heads, heads_kv, seqlen_q, seqlen_k, causal):
    q, k, v = _qkv(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads=heads, heads_kv=heads_kv, head_dim=head_dim,
                   dtype=dtype)
    assert _validate(q, k, v, causal=causal, softmax_scale=head_dim ** -0.5, deterministic=causal,
                     schedule="fa3") is None


def _views(head_dim=64, heads=4):
    b, s = 2, 24
    packed = torch.randn(b, s, 3, heads, head_dim, dtype=torch.bfloat16)
    yield "qkvpacked_unbind", packed.unbind(dim=2)
    lastdim = torch.randn(b, s, heads, 3 * head_dim, dtype=torch.bfloat16)
    yield "split_last_dim", lastdim.split(head_dim, dim=-1)
    bhsd = torch.randn(3, b, heads, s, head_dim, dtype=torch.float16)
    yield "bhsd_transposed", tuple(t.transpose(1, 2) for t in bhsd)
    long = torch.randn(b, 2 * s, heads, head_dim, dtype=torch.bfloat16)
    yield "seqlen_slices", (long[:, 3:3 + s], long[:, s:], long[:, ::2])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_noncontiguous_last_dim_contiguous_views_pass(head_dim):
    for label, (q, k, v) in _views(head_dim):
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()), label
        assert _validate(q, k, v, causal=True) is None, label


def test_gqa_views_of_a_packed_tensor_pass():
    # (b, s, h_q + 2 h_kv, d), FA3's 4-D qkvpacked layout for GQA, split into q / k / v views.
    packed = torch.randn(2, 16, 8 + 2 * 2, 128, dtype=torch.float16)
    q, k, v = packed.split([8, 2, 2], dim=2)
    assert _validate(q, k, v) is None


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    seqlen_q=st.integers(1, 40),
    seqlen_k=st.integers(1, 40),
    heads_kv=st.integers(1, 4),
    group=st.integers(1, 4),
    head_dim=st.sampled_from(SUPPORTED_HEAD_DIMS),
    half=st.booleans(),
    causal=st.booleans(),
)
def test_property_valid_shapes_pass(batch, seqlen_q, seqlen_k, heads_kv, group, head_dim, half, causal):
    dtype = torch.float16 if half else torch.bfloat16
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, heads_kv * group, heads_kv, head_dim, dtype)
    assert _validate(q, k, v, causal=causal) is None


@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 12), heads_kv=st.integers(1, 12))
def test_property_heads_divisibility(heads, heads_kv):
    q, k, v = _qkv(heads=heads, heads_kv=heads_kv)
    if heads % heads_kv == 0:
        assert _validate(q, k, v) is None
    else:
        with pytest.raises(ValueError, match="divisible"):
            _validate(q, k, v)


def _assert_device_error(msg: str, name: str = "q", device: str = "cpu"):
    assert msg.startswith(f"{name} is on device {device}")
    assert "cuda" in msg.lower() and "9.0" in msg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_tensors_raise_device_error(dtype):
    q, k, v = _qkv(dtype=dtype)
    with pytest.raises(ValueError) as e:
        flash_attn_func(q, k, v)
    _assert_device_error(_err(e))
    with pytest.raises(ValueError) as e:
        validate_inputs(q, k, v)  # check_device defaults to True
    _assert_device_error(_err(e))


def test_meta_tensors_raise_device_error():
    q, k, v = (torch.empty(2, 16, 4, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    with pytest.raises(ValueError) as e:
        flash_attn_func(q, k, v)
    _assert_device_error(_err(e), device="meta")


@pytest.mark.parametrize(
    "tensors, kw",
    [
        (dict(dtype=torch.float32), {}),
        (dict(head_dim=80), {}),
        (dict(heads=6, heads_kv=4), {}),
        ({}, dict(schedule="bogus")),
        ({}, dict(schedule="shift")),
        ({}, dict(softcap=30.0)),
        ({}, dict(window_size=(128, 0))),
        ({}, dict(sm_margin=-1)),
        ({}, dict(causal=1)),
        ({}, dict(softmax_scale=-1.0)),
        ({}, dict(deterministic="yes")),
    ],
    ids=lambda x: str(x),
)
def test_device_error_comes_before_everything_else(tensors, kw, monkeypatch):
    calls = []
    monkeypatch.setattr(_ext, "require_kernels", lambda: calls.append("require_kernels"))
    q, k, v = _qkv(**tensors)
    with pytest.raises(ValueError) as e:
        flash_attn_func(q, k, v, **kw)
    _assert_device_error(_err(e))
    assert calls == []  # the device check stopped it before any kernel lookup


def test_device_error_before_seqlen_and_empty_checks():
    q = torch.randn(2, 16, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(3, 0, 4, 64, dtype=torch.bfloat16)
    v = torch.randn(3, 9, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        flash_attn_func(q, k, v)
    _assert_device_error(_err(e))


def test_attention_backward_cpu_device_error():
    q, k, v = _qkv()
    lse = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError) as e:
        attention_backward(q.clone(), q, k, v, q.clone(), lse, causal=True, deterministic=True)
    _assert_device_error(_err(e))


# ---------------------------------------------------------------------------------------
# Kernels missing, package surface
# ---------------------------------------------------------------------------------------
def test_require_kernels_matches_kernels_available():
    assert issubclass(dash.KernelsNotBuiltError, RuntimeError)
    info = dash.manifest()
    assert {"kernels_built", "head_dims", "dtypes"} <= set(info)
    if not info["kernels_built"]:
        assert dash.kernels_available() is False
    if dash.kernels_available():
        assert _ext.require_kernels() is None
    else:
        with pytest.raises(dash.KernelsNotBuiltError) as e:
            _ext.require_kernels()
        reason = _ext._load()[1]
        assert reason and reason in _err(e) and "not available" in _err(e)


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_import_dash_does_not_import_torch():
    code = (
        "import json, sys\n"
        "import dash\n"
        "mods = lambda: sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "before = mods()\n"
        "extra = (dash.__version__, dash.manifest(), dash.KernelsNotBuiltError, dash.__all__)\n"
        "after_surface = mods()\n"
        "dash.flash_attn_func\n"  # positive control: the lazy attribute does import torch
        "print(json.dumps({'before': before, 'after_surface': after_surface, 'after_func': 'torch' in sys.modules}))\n"
    )
    p = _run_python(code)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["before"] == [] and res["after_surface"] == []
    assert res["after_func"] is True


def test_lazy_attributes():
    for name in dash.__all__:
        assert getattr(dash, name) is not None
    with pytest.raises(AttributeError, match="no_such_thing"):
        dash.no_such_thing  # noqa: B018


def test_drop_in_module_is_the_same_function():
    from dash.flash_attn_interface import flash_attn_func as fa3_path
    from dash.flash_attn_interface import flash_attn_qkvpacked_func, flash_attn_varlen_func

    assert fa3_path is dash.flash_attn_func is api.flash_attn_func
    assert flash_attn_qkvpacked_func is dash.flash_attn_qkvpacked_func is api.flash_attn_qkvpacked_func
    assert flash_attn_varlen_func is dash.flash_attn_varlen_func is api.flash_attn_varlen_func


def test_dash_interface_keeps_its_old_names():
    """dash.interface was split into dash.api, dash.validation and dash.ops; code importing
    the old names from it (README, users' scripts) must keep working, with the same objects."""
    from dash import validation

    moved = {
        "flash_attn_func": api.flash_attn_func,
        "flash_attn_qkvpacked_func": api.flash_attn_qkvpacked_func,
        "flash_attn_varlen_func": api.flash_attn_varlen_func,
        "attention_backward": api.attention_backward,
        "validate_inputs": validation.validate_inputs,
        "effective_causal": validation.effective_causal,
        "SCHEDULE_NAMES": validation.SCHEDULE_NAMES,
        "KERNEL_SCHEDULES": KERNEL_SCHEDULES,
        "PORTABLE_KERNEL_SCHEDULES": PORTABLE_KERNEL_SCHEDULES,
        "resolve_schedule": ops.resolve_schedule,
        "_grid_ctas": ops.grid_ctas,
        "_resolve_deterministic": ops.resolve_deterministic,
        "_auto_schedule": ops._auto_schedule,
        "_check_tensor": validation.check_tensor,
        "_describe": validation.describe_tensor,
        "_check_cuda_devices": validation.check_cuda_devices,
        "_aligned": validation.is_tma_aligned,
    }
    for name, obj in moved.items():
        assert getattr(interface, name) is obj, name


def test_flash_attn_func_signature_is_fa3s_plus_schedule():
    params = inspect.signature(dash.flash_attn_func).parameters
    assert list(params) == [n for n, _ in FA3_FLASH_ATTN_FUNC] + ["schedule"]
    for name, p in params.items():
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name
    for name, fa3_default in FA3_FLASH_ATTN_FUNC:
        if name == "deterministic":
            # DASH: None = follow torch.are_deterministic_algorithms_enabled() (FA3: False).
            assert params[name].default is None
        else:
            assert params[name].default == fa3_default, name
    assert params["schedule"].default == "auto"


def test_compiled_call_on_cpu_tensors_gets_dashs_device_error():
    """Under torch.compile the tensors are fakes; their device is still checked, so the user
    sees DASH's error naming the argument and the fix, not the dispatcher's 'Could not run
    dash::fwd with arguments from the CPU backend'."""
    q, k, v = _qkv()

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    with pytest.raises(Exception) as e:
        torch.compile(step, fullgraph=True, backend="eager")(q, k, v)
    msg = str(e.value)
    assert "q is on device cpu" in msg and ".cuda()" in msg and "Could not run" not in msg


def test_cuda_device_info_asks_the_driver_once_per_device(monkeypatch):
    """Capability and SM count are read once per device (host time per attention call)."""
    import types

    from dash import validation

    calls = []

    def fake_props(index):
        calls.append(index)
        return types.SimpleNamespace(major=9, minor=0, multi_processor_count=132 - index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", fake_props)
    validation.cuda_device_info.cache_clear()
    try:
        assert validation.cuda_device_info(0) == ((9, 0), 132)
        assert validation.cuda_device_info(1) == ((9, 0), 131)
        assert validation.cuda_device_info(0) == ((9, 0), 132)
        assert calls == [0, 1]
    finally:
        validation.cuda_device_info.cache_clear()


def test_repeated_valid_calls_skip_revalidation_but_not_the_pointer_check(monkeypatch):
    """validate_inputs remembers valid calls by shapes, strides, dtypes, devices and typed
    options; a remembered call still checks the data pointers' alignment, and a call that
    differs only in an option's type (causal=1 for True) is validated in full."""
    from dash import validation

    # A CPU stand-in for an sm_90 device (the device checks are the only ones patched).
    monkeypatch.setattr(validation, "check_cuda_devices", lambda q, k, v: None)
    monkeypatch.setattr(validation, "cuda_device_info", lambda index: ((9, 0), 132))
    monkeypatch.setattr(validation, "_check_built", lambda head_dim, dtype: None)
    validation._VALID_CALLS.clear()
    shape = (1, 64, 2, 64)
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16) for _ in range(3))
    calls = []
    full = validation._validate_inputs
    monkeypatch.setattr(validation, "_validate_inputs", lambda *a, **kw: (calls.append(1), full(*a, **kw)))
    validation.validate_inputs(q, k, v, causal=True)
    validation.validate_inputs(q, k, v, causal=True)
    assert len(calls) == 1  # the second call was remembered
    numel = q.numel()
    base = torch.empty(numel + 8, dtype=torch.bfloat16)
    misaligned = base[1:1 + numel].view(shape)  # same shape and strides, pointer 2 bytes off
    assert misaligned.stride() == q.stride() and misaligned.data_ptr() % 16 != 0
    with pytest.raises(ValueError, match="not aligned to 16 bytes"):
        validation.validate_inputs(misaligned, k, v, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        validation.validate_inputs(q, k, v, causal=1)
    validation._VALID_CALLS.clear()


# ---------------------------------------------------------------------------------------
# The remembered-call key, the backward's limits, attention_backward's determinism
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, error, text", [
    (dict(schedule=["fa3"]), ValueError, "schedule=['fa3'] is unknown"),
    (dict(deterministic=[True]), TypeError, "deterministic must be None or a bool, got [True]"),
    (dict(softcap=[0.0]), TypeError, "softcap must be a float (0.0: no softcapping), got [0.0]"),
    (dict(window_size=([-1], 0)), TypeError, "window_size must be a pair of ints"),
    (dict(causal=[True]), TypeError, "causal must be a bool, got [True]"),
    (dict(softmax_scale=[0.1]), ValueError, "softmax_scale=[0.1] must be None"),
    (dict(sm_margin=[0]), ValueError, "sm_margin=[0] must be an int"),
], ids=str)
def test_unhashable_options_get_their_own_error(kw, error, text, cpu_as_sm90):
    """The remembered-call key holds the options; an unhashable one (a list) is validated in
    full and named, not reported as Python's 'unhashable type'."""
    from dash import validation

    q, k, v = _qkv()
    with pytest.raises(error) as e:
        validation.validate_inputs(q, k, v, **kw)
    assert text in _err(e)
    with pytest.raises(error) as e:
        flash_attn_func(q, k, v, **kw)
    assert text in _err(e)
    assert validation._VALID_CALLS == set() and cpu_as_sm90 == []


def test_unhashable_option_on_cpu_gets_the_device_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError) as e:
        flash_attn_func(q, k, v, schedule=["fa3"])
    _assert_device_error(_err(e))


def _validate_backward(*tensors, **kw):
    from dash.validation import validate_backward_inputs

    return validate_backward_inputs(*tensors, check_device=False, **kw)


def _wide(batch=1, heads=1, heads_kv=1, requires_grad=False):
    """q, k, v of (batch, 4, heads, 64) as expanded views of one small tensor (no allocation
    of their size; validation reads shapes and strides only)."""
    base = torch.randn(1, 4, 1, 64, dtype=torch.bfloat16, requires_grad=requires_grad)
    return (base.expand(batch, 4, heads, 64), base.expand(batch, 4, heads_kv, 64), base.expand(batch, 4, heads_kv, 64))


@pytest.mark.parametrize("name, shape", [("batch", dict(batch=65536)), ("heads", dict(heads=65536)),
                                         ("heads", dict(heads=70000, heads_kv=7))], ids=str)
def test_backward_limits_batch_and_heads(name, shape):
    """The backward's pre/post-process grids take batch and heads as CUDA grid y/z (at most
    65535): refused up front whenever a backward will run, not after the forward."""
    value = shape.get(name)
    q, k, v = _wide(**shape, requires_grad=True)
    text = f"{name}={value} is not supported by the backward yet: at most 65535"
    with pytest.raises(NotImplementedError, match=rf"^{text}"):
        _validate(q, k, v)  # requires grad, grad mode on: a backward will run
    with pytest.raises(NotImplementedError, match=rf"^{text}"):
        _validate(*(t.detach() for t in (q, k, v)), backward=True)
    lse = torch.zeros(1, 1, 1).expand(q.shape[0], q.shape[2], q.shape[1])
    with pytest.raises(NotImplementedError, match=rf"^{text}"):
        _validate_backward(q.detach(), q.detach(), k.detach(), v.detach(), q.detach(), lse)
    # No backward: the forward alone has no such limit.
    assert _validate(*(t.detach() for t in (q, k, v))) is None
    with torch.no_grad():
        assert _validate(q, k, v) is None


def test_backward_limit_is_part_of_the_remembered_key(cpu_as_sm90):
    """A shape remembered as valid without grad is checked again when a backward will run."""
    q, k, v = _wide(batch=65536)
    flash_attn_func(q, k, v)
    assert len(cpu_as_sm90) == 1
    q, k, v = _wide(batch=65536, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"^batch=65536 is not supported by the backward"):
        flash_attn_func(q, k, v)
    assert _validate(*_wide(batch=65535, heads=65535, requires_grad=True)) is None


def test_softmax_lse_must_be_on_qs_device():
    q, k, v = _qkv()
    lse = torch.zeros(2, 4, 16, device="meta")
    with pytest.raises(ValueError, match=r"^softmax_lse is on meta but q is on cpu; all inputs must share one device"):
        _validate_backward(q.clone(), q, k, v, q.clone(), lse)


def test_attention_backward_deterministic_follows_torch_by_default(cpu_as_sm90):
    assert inspect.signature(attention_backward).parameters["deterministic"].default is None
    q, k, v = _qkv()
    args = (q.clone(), q, k, v, q.clone(), torch.zeros(2, 4, 16))
    attention_backward(*args)
    attention_backward(*args, deterministic=True)
    attention_backward(*args, deterministic=False)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        attention_backward(*args)
        attention_backward(*args, deterministic=None)
        with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
            attention_backward(*args, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(was)
    assert [c["deterministic"] for c in cpu_as_sm90] == [False, True, False, True, True]
    with pytest.raises(TypeError, match=r"^deterministic must be None or a bool, got 'yes'"):
        attention_backward(*args, deterministic="yes")


@pytest.mark.parametrize("deterministic", [None, 1, "yes"], ids=repr)
def test_trace_backward_deterministic_must_be_a_bool(deterministic):
    from dash.trace import trace_backward

    q, k, v = _qkv()
    with pytest.raises(TypeError, match=rf"^deterministic must be a bool, got {deterministic!r}"):
        trace_backward(q.clone(), q, k, v, q.clone(), torch.zeros(2, 4, 16), deterministic=deterministic)


# ---------------------------------------------------------------------------------------
# Layouts flash_attn_func copies (as FA3 does) and the ones it refuses
# ---------------------------------------------------------------------------------------
def test_flash_attn_func_copies_a_strided_last_dim_as_fa3_does(cpu_as_sm90):
    q, k, v = _qkv()
    wide = torch.zeros(2, 16, 4, 128, dtype=q.dtype)
    wide[..., ::2] = q
    strided = wide[..., ::2]
    flash_attn_func(strided, k, v)
    (call,) = cpu_as_sm90
    assert call["q"].stride(-1) == 1 and torch.equal(call["q"], q)
    assert call["k"] is k and call["v"] is v  # unit last stride: passed as given, no copy


def test_flash_attn_func_copy_of_a_strided_last_dim_keeps_the_graph(cpu_as_sm90):
    """The copy is differentiable, as FA3's is: gradients reach the caller's strided tensor."""
    _, k, v = _qkv()
    wide = torch.zeros(2, 16, 4, 128, dtype=torch.bfloat16, requires_grad=True)
    flash_attn_func(wide[..., ::2], k, v)
    (call,) = cpu_as_sm90
    torch.autograd.backward(call["q"], torch.ones_like(call["q"]))
    assert torch.equal(wide.grad[..., ::2], torch.ones(2, 16, 4, 64)) and not wide.grad[..., 1::2].any()


@pytest.mark.parametrize("layout, fix", [("contiguous, pointer 2 bytes off", ".clone()"),
                                         ("row stride of 136 bytes", ".contiguous()")])
def test_misaligned_layout_error_names_the_call_that_fixes_it(layout, fix, cpu_as_sm90):
    """.contiguous() of a contiguous tensor is the same tensor, misaligned pointer and all."""
    q, k, v = _qkv()
    if fix == ".clone()":
        bad = torch.empty(q.numel() + 8, dtype=q.dtype)[1:1 + q.numel()].view(q.shape)
        assert bad.is_contiguous() and bad.data_ptr() % 16
    else:
        bad = torch.randn(2, 16, 4, 68, dtype=q.dtype)[..., :64]
        assert not bad.is_contiguous() and bad.data_ptr() % 16 == 0
    with pytest.raises(ValueError) as e:
        flash_attn_func(bad, k, v)
    assert "not aligned to 16 bytes" in _err(e) and _err(e).endswith(f"call {fix}")


# ---------------------------------------------------------------------------------------
# FA3 options whose type is wrong (None included): TypeError, not "not supported yet"
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, text", [
    (dict(num_splits=None), "num_splits must be an int (1: no split, 0: FA3's heuristic), got None"),
    (dict(num_splits=1.0), "num_splits must be an int (1: no split, 0: FA3's heuristic), got 1.0"),
    (dict(attention_chunk=None), "attention_chunk must be an int (0: no chunking), got None"),
], ids=str)
def test_fa3_numeric_options_of_the_wrong_type(kw, text):
    """FA3's op schema types them int, so None is refused there too: a type error, here before
    the device check (as for their unsupported values)."""
    with pytest.raises(TypeError) as e:
        flash_attn_func(*_qkv(), **kw)
    assert _err(e) == text


@pytest.mark.parametrize("softcap", [None, "0"], ids=repr)
def test_softcap_of_the_wrong_type(softcap, cpu_as_sm90):
    text = f"softcap must be a float (0.0: no softcapping), got {softcap!r}"
    with pytest.raises(TypeError) as e:
        _validate(*_qkv(), softcap=softcap)
    assert _err(e) == text
    with pytest.raises(TypeError) as e:
        flash_attn_func(*_qkv(), softcap=softcap)
    assert _err(e) == text


@pytest.mark.parametrize("entry", ["attention_backward", "_flash_attn_backward"])
def test_backward_entry_points_trace_with_fullgraph(cpu_as_sm90, entry):
    """The backward entry points trace under torch.compile(fullgraph=True): their validation
    used to read the fake tensors' data pointers (TMA alignment), which Dynamo cannot trace,
    and to require the kernels while tracing. Both are left to the op's C++ checks and the
    call, as in the forward. The op (here a recorder) receives the traced call's arguments."""
    from dash import api
    from dash import flash_attn_interface as fai

    q, k, v = _qkv()
    dout, out = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(q.shape[0], q.shape[2], q.shape[1])

    if entry == "attention_backward":
        def step(dout, q, k, v, out, lse):
            return api.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    else:
        def step(dout, q, k, v, out, lse):
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            fai._flash_attn_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, is_causal=True, deterministic=True)
            return dq, dk, dv

    torch._dynamo.reset()
    try:
        torch.compile(step, fullgraph=True, backend="eager")(dout, q, k, v, out, lse)
    finally:
        torch._dynamo.reset()
    assert cpu_as_sm90 and cpu_as_sm90[-1]["causal"] is True and cpu_as_sm90[-1]["deterministic"] is True


# ---------------------------------------------------------------------------------------
# flash_attn_func's remembered calls: what the key tells apart
# ---------------------------------------------------------------------------------------
def _key(q, k, v, **kw):
    args = dict(softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
                window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, deterministic=None, sm_margin=0,
                schedule="auto", deterministic_flag=torch.are_deterministic_algorithms_enabled())
    args.update(kw)
    return api._call_key(q, k, v, **args)


def test_call_key_separates_every_input_of_a_decision():
    """A remembered call is replayed only for an equal key (dash.api._CALL_PLANS). Everything that
    changes what validation, the deterministic=None rule or the schedule choice would say must
    give another key: values with their types, strides, dtypes, grad mode and requires_grad, the
    deterministic-algorithms flag, an unsupported tensor argument; an unhashable option cannot be
    a key at all."""
    q, k, v = _qkv()
    base = _key(q, k, v, causal=True)
    assert base == _key(*(t.clone() for t in (q, k, v)), causal=True)  # other tensors, same layout
    others = [
        _key(q, k, v, causal=1),
        _key(q, k, v, causal=False),
        _key(q, k, v, causal=True, softmax_scale=0.125),
        _key(q, k, v, causal=True, sm_margin=1),
        _key(q, k, v, causal=True, sm_margin=True),
        _key(q, k, v, causal=True, deterministic=False),
        _key(q, k, v, causal=True, schedule="fa3"),
        _key(q, k, v, causal=True, num_splits=0),
        _key(q, k, v, causal=True, window_size=(-1, 0)),
        _key(q, k, v, causal=True, qv=q),
        _key(q.half(), k.half(), v.half(), causal=True),
        _key(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, causal=True),  # same shape, other strides
        _key(q.requires_grad_(), k, v, causal=True),
    ]
    with torch.no_grad():  # requires_grad, but no backward will run: the decisions of the base call
        assert _key(q, k, v, causal=True) == base
    q.requires_grad_(False)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        others.append(_key(q, k, v, causal=True))
    finally:
        torch.use_deterministic_algorithms(was)
    for i, other in enumerate(others):
        assert other != base, f"variant {i} shares the key of the base call"
    with pytest.raises(TypeError):
        hash(_key(q, k, v, causal=True, schedule=["fa3"]))
    # Window sides that equal a valid int (False == 0.0 == 0) but that validation refuses, a
    # list, and tensors are never remembered.
    for window in ((-1, False), (-1, 0.0), [-1, -1], (torch.tensor(-1), torch.tensor(-1))):
        assert _key(q, k, v, causal=True, window_size=window) is None, window
