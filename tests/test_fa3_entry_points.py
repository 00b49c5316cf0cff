"""FA3's low-level entry points (``dash.flash_attn_interface._flash_attn_forward`` /
``_flash_attn_backward``) and the opt-in alias that loads DASH under FA3's module names.

CPU tests: the signatures are FA3's, every FA3 feature DASH lacks is rejected by name, the
accepted no-op arguments get as far as the device check, and the alias installs only when
asked and never over a real FA3 (simulated by a module on sys.path).

GPU tests (marked ``gpu``; skipped without an sm_90 GPU, see conftest.py): the entry points
called the way TransformerEngine's FlashAttention-3 backend calls them, checked against the
float64 reference with FA3's error rule; the backward writes into the caller's dq/dk/dv and
is bitwise repeatable with deterministic=True.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from seeding import seed_of  # tests/seeding.py (conftest.py puts tests/ on sys.path)

import dash
from dash import api, fa3_alias, reference
from dash import flash_attn_interface as fai
from dash.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dash.__file__)))
_ = inspect.Parameter.empty

# Parameter names, order and defaults of FA3's entry points, copied from
# hopper/flash_attn_interface.py of Dao-AILab/flash-attention (commit 0251105a, 2026-08-15).
FA3_FORWARD_PARAMETERS = [
    ("q", _), ("k", _), ("v", _),
    ("k_new", None), ("v_new", None), ("qv", None), ("out_", None),
    ("cu_seqlens_q", None), ("cu_seqlens_k", None), ("cu_seqlens_k_new", None),
    ("seqused_q", None), ("seqused_k", None),
    ("max_seqlen_q", None), ("max_seqlen_k", None),
    ("page_table", None), ("kv_batch_idx", None), ("leftpad_k", None),
    ("rotary_cos", None), ("rotary_sin", None), ("seqlens_rotary", None),
    ("q_descale", None), ("k_descale", None), ("v_descale", None),
    ("softmax_scale", None), ("causal", False),
    ("window_size_left", -1), ("window_size_right", -1),
    ("attention_chunk", 0), ("softcap", 0.0), ("rotary_interleaved", True),
    ("scheduler_metadata", None), ("num_splits", 1), ("pack_gqa", None), ("sm_margin", 0),
]
FA3_BACKWARD_PARAMETERS = [
    ("dout", _), ("q", _), ("k", _), ("v", _), ("out", _), ("softmax_lse", _),
    ("cu_seqlens_q", None), ("cu_seqlens_k", None),
    ("sequed_q", None), ("sequed_k", None),  # sic: FA3's spelling
    ("max_seqlen_q", None), ("max_seqlen_k", None),
    ("dq", None), ("dk", None), ("dv", None),
    ("softmax_scale", None), ("is_causal", False),
    ("window_size_left", -1), ("window_size_right", -1),
    ("softcap", 0.0), ("deterministic", False), ("sm_margin", 0),
]
#: Tensor arguments of FA3's forward that ask for a feature DASH does not have.
FORWARD_TENSOR_FEATURES = ["k_new", "v_new", "qv", "cu_seqlens_k_new", "seqused_q", "seqused_k", "page_table",
                           "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale",
                           "k_descale", "v_descale", "scheduler_metadata"]
BACKWARD_TENSOR_FEATURES = ["sequed_q", "sequed_k"]


def _qkv(batch=2, seqlen_q=64, seqlen_k=None, heads=4, heads_kv=None, head_dim=64, dtype=torch.bfloat16,
         device="cpu"):
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    heads_kv = heads if heads_kv is None else heads_kv
    q = torch.randn(batch, seqlen_q, heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype, device=device)
    return q, k, v


def _backward_args(seqlen_q=64, seqlen_k=None):
    q, k, v = _qkv(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    return (q.clone(), q, k, v, q.clone(), lse)


def _signature(fn):
    return [(name, p.default) for name, p in inspect.signature(fn).parameters.items()]


# ---------------------------------------------------------------------------------------
# Signatures and the module's surface
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn, expected", [(_flash_attn_forward, FA3_FORWARD_PARAMETERS),
                                          (_flash_attn_backward, FA3_BACKWARD_PARAMETERS)],
                         ids=["forward", "backward"])
def test_signature_is_fa3s(fn, expected):
    assert _signature(fn) == expected
    for name, p in inspect.signature(fn).parameters.items():
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name  # TE passes most of them by position


def test_module_exports_fa3s_names():
    assert fai.flash_attn_func is api.flash_attn_func
    assert fai.flash_attn_qkvpacked_func is api.flash_attn_qkvpacked_func
    assert fai.flash_attn_varlen_func is api.flash_attn_varlen_func
    for name in fai.__all__:
        assert callable(getattr(fai, name)), name
    assert {"_flash_attn_forward", "_flash_attn_backward", "flash_attn_qkvpacked_func"} <= set(fai.__all__)


#: The positional parameters of FA3's autograd.Function forwards (after ctx), same file and commit.
FA3_FUNCTION_APPLY_PARAMETERS = {
    "FlashAttnFunc": ["q", "k", "v", "softmax_scale", "causal", "qv", "q_descale", "k_descale", "v_descale",
                      "window_size", "attention_chunk", "softcap", "num_splits", "pack_gqa", "deterministic",
                      "sm_margin", "return_softmax"],
    "FlashAttnQKVPackedFunc": ["qkv", "softmax_scale", "causal", "q_descale", "k_descale", "v_descale", "window_size",
                               "attention_chunk", "softcap", "deterministic", "num_heads_q", "sm_margin",
                               "return_softmax"],
    "FlashAttnVarlenFunc": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q",
                            "max_seqlen_k", "softmax_scale", "causal", "qv", "q_descale", "k_descale", "v_descale",
                            "window_size", "attention_chunk", "softcap", "num_splits", "pack_gqa", "deterministic",
                            "sm_margin", "return_softmax"],
}


@pytest.mark.parametrize("name", list(FA3_FUNCTION_APPLY_PARAMETERS))
def test_fa3_function_classes_apply_in_fa3s_positional_order(name):
    """Position i of FA3's Func.apply means what position i of DASH's apply means (the last,
    return_softmax, is flash_attn_*func's return_attn_probs)."""
    expected = FA3_FUNCTION_APPLY_PARAMETERS[name]
    got = list(inspect.signature(getattr(fai, name).apply).parameters)[:len(expected)]
    assert got[:-1] == expected[:-1] and got[-1] in ("return_softmax", "return_attn_probs"), got


def test_fa3_function_classes_reach_the_ops(cpu_as_sm90):
    q, k, v = _qkv()
    fai.FlashAttnFunc.apply(q, k, v, 0.5, True)
    assert cpu_as_sm90[-1]["causal"] is True and cpu_as_sm90[-1]["softmax_scale"] == 0.5
    qp, kp, vp, cu, longest = _packed()
    out, lse = fai.FlashAttnVarlenFunc.apply(qp, kp, vp, cu, cu, None, None, longest, longest, None, True, None, None,
                                             None, None, (-1, -1), 0, 0.0, 1, None, None, 0, True)
    call = cpu_as_sm90[-1]
    assert call["max_seqlen_q"] == call["max_seqlen_k"] == longest and call["causal"] is True
    assert out.shape == qp.shape and lse.shape == (qp.shape[1], qp.shape[0])
    qkv = torch.stack(_qkv(), dim=2)
    fai.FlashAttnQKVPackedFunc.apply(qkv, None, False)
    assert cpu_as_sm90[-1]["causal"] is False and len(cpu_as_sm90) == 3


@pytest.mark.parametrize("name", ["flash_attn_with_kvcache", "flash_attn_combine", "get_scheduler_metadata"])
def test_fa3_functions_dash_lacks_import_and_raise(name):
    with pytest.raises(NotImplementedError, match=f"^{name} .*not supported"):
        getattr(fai, name)(*_qkv())


# ---------------------------------------------------------------------------------------
# Unsupported FA3 arguments: NotImplementedError naming the argument and the value
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arg", FORWARD_TENSOR_FEATURES)
def test_forward_rejects_unsupported_tensor_argument(arg):
    with pytest.raises(NotImplementedError) as e:
        _flash_attn_forward(*_qkv(), **{arg: torch.ones(3, dtype=torch.int32)})
    msg = str(e.value)
    assert msg.startswith(f"{arg} (") and "not supported yet" in msg and f"pass {arg}=None" in msg
    assert "shape (3,)" in msg  # the value it got


@pytest.mark.parametrize("arg", BACKWARD_TENSOR_FEATURES)
def test_backward_rejects_unsupported_tensor_argument(arg):
    with pytest.raises(NotImplementedError) as e:
        _flash_attn_backward(*_backward_args(), **{arg: torch.ones(3, dtype=torch.int32)})
    msg = str(e.value)
    assert msg.startswith(f"{arg} (") and "not supported yet" in msg and f"pass {arg}=None" in msg


@pytest.mark.parametrize("kw, text", [
    (dict(attention_chunk=128), "attention_chunk=128"),
    (dict(softcap=30.0), "softcap=30.0"),
    (dict(num_splits=2), "num_splits=2"),
    (dict(num_splits=-1), "num_splits=-1"),
], ids=str)
def test_forward_rejects_unsupported_values(kw, text):
    with pytest.raises(NotImplementedError, match=f"^{text}.*not supported yet"):
        _flash_attn_forward(*_qkv(), **kw)


def test_backward_rejects_softcap():
    with pytest.raises(NotImplementedError, match=r"^softcap=50.0.*not supported yet; use 0.0"):
        _flash_attn_backward(*_backward_args(), softcap=50.0)


@pytest.mark.parametrize("window, causal", [((128, 0), False), ((128, -1), False), ((-1, 7), False),
                                            ((16, 16), False), ((128, 0), True)], ids=str)
@pytest.mark.parametrize("entry", ["forward", "backward"])
def test_sliding_window_rejected_naming_fa3s_window_arguments(entry, window, causal):
    """A window shorter than the sequence is a real sliding window (not supported); the error
    names FA3's two window arguments and comes before the device check (CPU tensors here)."""
    left, right = window
    with pytest.raises(NotImplementedError) as e:
        if entry == "forward":
            _flash_attn_forward(*_qkv(seqlen_q=512), causal=causal, window_size_left=left, window_size_right=right)
        else:
            _flash_attn_backward(*_backward_args(seqlen_q=512), is_causal=causal, window_size_left=left,
                                 window_size_right=right)
    msg = str(e.value)
    causal_arg = "causal" if entry == "forward" else "is_causal"
    assert msg.startswith(f"window_size_left={left}, window_size_right={right} ({causal_arg}={causal})")
    assert "not supported yet" in msg and "window_size_left=-1, window_size_right=-1" in msg
    assert msg.endswith(f"or {causal_arg}=True")


@pytest.mark.parametrize("kw, error, text", [
    (dict(causal=1), TypeError, "causal must be a bool, got 1"),
    (dict(window_size_left=1.5), TypeError, "window_size_left must be an int"),
    (dict(window_size_right=None), TypeError, "window_size_right must be an int"),
], ids=str)
def test_forward_argument_types(kw, error, text):
    with pytest.raises(error, match=f"^{text}"):
        _flash_attn_forward(*_qkv(), **kw)


@pytest.mark.parametrize("kw, text", [
    (dict(is_causal="yes"), "is_causal must be a bool, got 'yes'"),
    (dict(deterministic=None), "deterministic must be a bool, got None"),
    (dict(deterministic=1), "deterministic must be a bool, got 1"),
], ids=str)
def test_backward_argument_types(kw, text):
    with pytest.raises(TypeError, match=f"^{text}"):
        _flash_attn_backward(*_backward_args(), **kw)


def test_forward_and_backward_check_tensors_first():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="^k must be a torch.Tensor, got list"):
        _flash_attn_forward(q, [1.0], v)
    with pytest.raises(ValueError, match="^q must have 4 dims"):
        _flash_attn_forward(q[0], k, v)  # varlen layout without cu_seqlens_q
    dout, q, k, v, out, lse = _backward_args()
    with pytest.raises(TypeError, match="^dout must be a torch.Tensor, got NoneType"):
        _flash_attn_backward(None, q, k, v, out, lse)


# ---------------------------------------------------------------------------------------
# Arguments that choose nothing in DASH: accepted, reaching the device check on CPU
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {},
    dict(max_seqlen_q=64, max_seqlen_k=64),  # TransformerEngine passes these for bshd too
    dict(max_seqlen_q=64, max_seqlen_k=32),  # its context-parallel halves (ignored without cu_seqlens)
    dict(pack_gqa=True), dict(pack_gqa=False), dict(num_splits=0), dict(num_splits=1),
    dict(rotary_interleaved=False), dict(sm_margin=8), dict(softmax_scale=0.1),
    dict(causal=True, window_size_left=-1, window_size_right=0),  # TE's causal call
    dict(window_size_left=-1, window_size_right=0),  # (-1, 0) is the causal mask
    dict(window_size_left=600, window_size_right=600),  # longer than the sequence: unbounded
], ids=str)
def test_forward_accepted_arguments_reach_the_device_check(kw):
    with pytest.raises(ValueError, match=r"^q is on device cpu.*\.cuda\(\)"):
        _flash_attn_forward(*_qkv(), **kw)


@pytest.mark.parametrize("kw", [
    {}, dict(max_seqlen_q=64, max_seqlen_k=64), dict(deterministic=True), dict(sm_margin=4),
    dict(is_causal=True, window_size_left=-1, window_size_right=0), dict(window_size_left=-1, window_size_right=0),
], ids=str)
def test_backward_accepted_arguments_reach_the_device_check(kw):
    with pytest.raises(ValueError, match=r"^q is on device cpu"):
        _flash_attn_backward(*_backward_args(), **kw)


def _strided_like(t):
    """t's values in a tensor whose last dim has stride 2."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def test_strided_last_dim_is_copied_as_fa3_does(cpu_as_sm90):
    """FA3's entry points copy a tensor whose last dim is strided (maybe_contiguous) instead of
    rejecting it: the op gets a unit-stride copy with the same values; other tensors as given."""
    q, k, v = _qkv()
    strided = _strided_like(q)
    assert strided.stride(-1) == 2
    _flash_attn_forward(strided, k, v)
    (call,) = cpu_as_sm90
    assert call["q"].stride(-1) == 1 and torch.equal(call["q"], q)
    assert call["k"] is k and call["v"] is v

    dout, q, k, v, out, lse = _backward_args()
    _flash_attn_backward(_strided_like(dout), q, _strided_like(k), v, _strided_like(out), lse)
    call = cpu_as_sm90[1]
    for name, want in (("dout", dout), ("k", k), ("out", out)):
        assert call[name].stride(-1) == 1 and torch.equal(call[name], want), name
    assert call["q"] is q and call["v"] is v


def test_output_buffer_must_match():
    from dash.validation import check_output_buffer

    q, k, _ = _qkv(heads_kv=2)
    assert check_output_buffer("dk", torch.empty_like(k), k, "k") is not None
    with pytest.raises(ValueError, match=r"^dk must match k \(shape \(2, 64, 2, 64\).*got shape \(2, 64, 4, 64\)"):
        check_output_buffer("dk", torch.empty_like(q), k, "k")
    with pytest.raises(ValueError, match=r"^out_ must match q .*dtype torch.float16"):
        check_output_buffer("out_", q.half(), q, "q")
    with pytest.raises(TypeError, match="^dq must be a torch.Tensor"):
        check_output_buffer("dq", 0, q, "q")


def test_lse_gradient_behaviour_is_documented():
    from dash import ops

    assert "non-differentiable" in ops.__doc__ and "first order only" in ops.__doc__
    assert "no gradient flows back" in api.flash_attn_func.__doc__
    assert "create_graph=True" in api.flash_attn_func.__doc__


def test_first_order_only_raises_on_a_second_differentiation():
    """dash.ops.first_order_only, on a function whose backward (like dash::bwd) is not itself
    differentiable: first-order gradients unchanged with and without create_graph, and a second
    differentiation with respect to the input raises the message, also when another term of
    the loss would give a gradient on its own (the silent partial result it prevents)."""
    from dash import ops

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            with torch.no_grad():
                dx = 2 * g * x
            return ops.first_order_only((dx,), (x,))[0]

    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (plain,) = torch.autograd.grad(Square.apply(x).sum(), x)
    assert not plain.requires_grad and torch.equal(plain, 2 * x.detach())
    (graphed,) = torch.autograd.grad(Square.apply(x).sum(), x, create_graph=True)
    assert graphed.requires_grad and torch.equal(graphed.detach(), plain)
    with pytest.raises(RuntimeError) as e:
        torch.autograd.grad(graphed.pow(2).sum() + x.pow(3).sum(), x)
    assert str(e.value) == ops.NOT_TWICE_DIFFERENTIABLE


@pytest.mark.parametrize("varlen", [False, True])
def test_autograd_rules_of_the_ops_on_fake_tensors(varlen):
    """The autograd of dash::fwd (C++, csrc/autograd.cpp) and dash::fwd_varlen (Python), run on
    fake tensors (the ops' fake kernels stand in for the GPU's; no device needed): the LSE
    comes back non-differentiable, plain gradients carry no graph, and under create_graph a
    second differentiation raises NOT_TWICE_DIFFERENTIABLE."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dash import _ext, ops

    ok, why = _ext.kernels_status()
    if not ok:
        pytest.skip(f"dash._C is not loaded, so its ops are not registered: {why}")
    with FakeTensorMode():
        if varlen:
            q, k, v = (torch.empty(96, 2, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
            cu = torch.tensor([0, 40, 96], dtype=torch.int32)
            out, lse = torch.ops.dash.fwd_varlen(q, k, v, cu, cu, 56, 56, 0.125, True, True, "fa3", 0)
        else:
            q, k, v = (torch.empty(1, 128, 2, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
            out, lse = torch.ops.dash.fwd(q, k, v, 0.125, True, True, "fa3", 0)
        assert out.requires_grad and not lse.requires_grad
        plain = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), retain_graph=True)
        assert not any(g.requires_grad for g in plain)
        graphed = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), create_graph=True)
        assert all(g.requires_grad for g in graphed)
        for wrt in (q, v):
            with pytest.raises(RuntimeError) as e:
                torch.autograd.grad(graphed[0].float().sum() + graphed[2].float().sum(), wrt, retain_graph=True)
            assert str(e.value) == ops.NOT_TWICE_DIFFERENTIABLE


# ---------------------------------------------------------------------------------------
# The alias: opt-in, never over a real FA3
# ---------------------------------------------------------------------------------------
@pytest.fixture
def clean_fa3_names():
    """Leave sys.modules' FA3 names as they were, whatever the test installed or imported."""
    names = set(fa3_alias.ALIAS_NAMES) | set(fa3_alias.FA3_TOP_LEVEL_NAMES)
    saved = {name: sys.modules[name] for name in names if name in sys.modules}
    yield
    fa3_alias.uninstall_as_flash_attn_3()
    fa3_alias._replaced.clear()
    for name in names:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


@pytest.fixture
def no_real_fa3(clean_fa3_names):
    if fa3_alias.find_real_flash_attn_3() is not None:
        pytest.skip(f"a real FA3 is installed here ({fa3_alias.find_real_flash_attn_3()})")


def _real_fa3_on_path(tmp_path, monkeypatch, as_package: bool):
    """A stand-in for an installed FA3: flash_attn_interface.py, or the flash_attn_3 package."""
    if as_package:
        (tmp_path / "flash_attn_3").mkdir()
        (tmp_path / "flash_attn_3" / "__init__.py").write_text("REAL = True\n")
        (tmp_path / "flash_attn_3" / "flash_attn_interface.py").write_text("REAL = True\n")
        where = tmp_path / "flash_attn_3"
    else:
        (tmp_path / "flash_attn_interface.py").write_text("REAL = True\n")
        where = tmp_path / "flash_attn_interface.py"
    # The stand-in must be the only FA3 the lookup can find: a real FA3 elsewhere on sys.path
    # (the device's anchor build, say) would be found first and named in the message instead.
    # Drop every entry where the lookup's own finder finds one of FA3's names.
    elsewhere = [p for p in sys.path
                 if not any(importlib.machinery.PathFinder.find_spec(name, [p])
                            for name in fa3_alias.FA3_TOP_LEVEL_NAMES)]
    monkeypatch.setattr(sys, "path", elsewhere)
    monkeypatch.syspath_prepend(str(tmp_path))
    return str(where)


def test_import_dash_installs_no_alias():
    """Neither importing dash, nor its FA3 module, nor reading install_as_flash_attn_3
    registers FA3's names (a fresh interpreter, so nothing else in this session interferes)."""
    code = (
        "import json, sys\n"
        "import dash, dash.flash_attn_interface\n"
        "dash.install_as_flash_attn_3\n"
        "names = ('flash_attn_3', 'flash_attn_3.flash_attn_interface', 'flash_attn_interface')\n"
        "print(json.dumps([n for n in names if n in sys.modules]))\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == []


def test_install_then_fa3_imports_are_dash(no_real_fa3):
    assert dash.install_as_flash_attn_3 is fa3_alias.install_as_flash_attn_3
    dash.install_as_flash_attn_3()
    from flash_attn_3.flash_attn_interface import _flash_attn_backward as bwd
    from flash_attn_3.flash_attn_interface import _flash_attn_forward as fwd
    from flash_attn_interface import flash_attn_func

    assert fwd is _flash_attn_forward and bwd is _flash_attn_backward
    assert flash_attn_func is api.flash_attn_func
    import flash_attn_3
    import flash_attn_3.flash_attn_interface as by_package_path

    assert flash_attn_3.flash_attn_interface is by_package_path is fai
    assert fa3_alias.is_dash_alias(flash_attn_3) and fa3_alias.find_real_flash_attn_3() is None
    dash.install_as_flash_attn_3()  # idempotent
    assert sys.modules["flash_attn_interface"] is fai
    fa3_alias.uninstall_as_flash_attn_3()
    assert not any(name in sys.modules for name in fa3_alias.ALIAS_NAMES)
    with pytest.raises(ImportError):
        import flash_attn_interface


@pytest.mark.parametrize("as_package", [False, True], ids=["flash_attn_interface", "flash_attn_3"])
def test_install_refuses_to_shadow_a_real_fa3(tmp_path, monkeypatch, clean_fa3_names, as_package):
    where = _real_fa3_on_path(tmp_path, monkeypatch, as_package)
    before = {name: sys.modules.get(name) for name in fa3_alias.ALIAS_NAMES}
    with pytest.raises(fa3_alias.RealFlashAttn3Error) as e:
        dash.install_as_flash_attn_3()
    msg = str(e.value)
    assert where in msg and "will not shadow" in msg and "force=True" in msg
    assert {name: sys.modules.get(name) for name in fa3_alias.ALIAS_NAMES} == before  # nothing changed
    name = "flash_attn_3.flash_attn_interface" if as_package else "flash_attn_interface"
    real = __import__(name, fromlist=["REAL"])
    assert real.REAL is True


def test_force_installs_over_a_real_fa3_and_uninstall_restores_it(tmp_path, monkeypatch, clean_fa3_names):
    _real_fa3_on_path(tmp_path, monkeypatch, as_package=False)
    import flash_attn_interface as real

    with pytest.raises(fa3_alias.RealFlashAttn3Error, match="is installed"):
        dash.install_as_flash_attn_3()  # found through sys.modules now
    dash.install_as_flash_attn_3(force=True)
    import flash_attn_interface as now

    assert now is fai and now._flash_attn_forward is _flash_attn_forward
    fa3_alias.uninstall_as_flash_attn_3()
    assert sys.modules["flash_attn_interface"] is real


def test_install_force_must_be_a_bool(clean_fa3_names):
    with pytest.raises(TypeError, match="force must be a bool"):
        dash.install_as_flash_attn_3(force="yes")


# ---------------------------------------------------------------------------------------
# GPU: the entry points driven the way TransformerEngine drives them
# ---------------------------------------------------------------------------------------
def _te_forward(q, k, v, causal, softmax_scale, max_seqlen_q, max_seqlen_kv):
    """TransformerEngine's call (context_parallel.py, cp_p2p_fwd_flash_attn with
    get_fa_args(forward=True, use_flash_attn_3=True, qkv_format="bshd")): nine Nones, the
    max seqlens, nine Nones by position; the rest by keyword; outputs[0] and [1] used."""
    fa_forward_kwargs = {"softmax_scale": softmax_scale, "window_size_left": -1,
                         "window_size_right": 0 if causal else -1}
    fa_forward_args = [*[None] * 9, max_seqlen_q, max_seqlen_kv, *[None] * 9]
    outputs = _flash_attn_forward(q, k, v, *fa_forward_args, causal=causal, **fa_forward_kwargs)
    return outputs


def _te_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, softmax_scale, max_seqlen_q, max_seqlen_kv):
    """TransformerEngine's call (cp_p2p_bwd_flash_attn with get_fa_args(forward=False, ...)):
    four Nones, the max seqlens and dq, dk, dv by position; softmax_scale, deterministic,
    the window and is_causal by keyword; the return value ignored (dq, dk, dv are outputs)."""
    fa_backward_kwargs = {"softmax_scale": softmax_scale, "deterministic": True, "window_size_left": -1,
                          "window_size_right": 0 if causal else -1, "is_causal": causal}
    fa_backward_args = [None, None, None, None, max_seqlen_q, max_seqlen_kv, dq, dk, dv]
    return _flash_attn_backward(dout, q, k, v, out, lse, *fa_backward_args, **fa_backward_kwargs)


#: (seqlen_q, seqlen_k, causal): TE's context-parallel sections -- "diagonal" (causal,
#: equal halves), "lower-triangle" (all of q, half of k), "upper-triangle" (half of q, all of
#: k) -- and a plain odd-sized pair.
TE_SECTIONS = [(1024, 1024, True), (1024, 512, False), (512, 1024, False), (333, 777, True), (777, 333, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", TE_SECTIONS)
def test_te_style_forward_and_backward_match_reference(seqlen_q, seqlen_k, causal, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(seed_of("te", seqlen_q, seqlen_k, head_dim, causal))
    heads, heads_kv = 4, 2
    q, k, v = (torch.randn(2, s, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for s, h in ((seqlen_q, heads), (seqlen_k, heads_kv), (seqlen_k, heads_kv)))
    dout = torch.randn_like(q)
    scale = head_dim ** -0.5
    outputs = _te_forward(q, k, v, causal, scale, seqlen_q, seqlen_k)
    assert len(outputs) == 4
    out, lse, out_accum, lse_accum = outputs
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, heads, seqlen_q) and lse.dtype == torch.float32
    assert out_accum.numel() == 0 and lse_accum.numel() == 0  # DASH never splits KV, like FA3 with num_splits=1
    ref_out, ref_lse = reference.attention_forward(q, k, v, scale, causal, compute_dtype=torch.float64)
    low_out, _ = reference.attention_forward(q, k, v, scale, causal, compute_dtype=q.dtype)
    reference.assert_within_bound(out, ref_out, low_out, "out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse.double()[finite], ref_lse[finite], atol=1e-3, rtol=0)

    # Poisoned buffers: every element must be written by the backward.
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    pointers = [t.data_ptr() for t in (dq, dk, dv)]
    softmax_d = _te_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, seqlen_q, seqlen_k)
    assert [t.data_ptr() for t in (dq, dk, dv)] == pointers
    hi = reference.attention_backward(dout, q, k, v, out, lse, scale, causal, compute_dtype=torch.float64)
    lo = reference.attention_backward(dout, q, k, v, out, lse, scale, causal, compute_dtype=q.dtype)
    for name, grad, high, low in zip(("dq", "dk", "dv"), (dq, dk, dv), hi, lo):
        assert torch.isfinite(grad).all(), f"{name}: elements left unwritten"
        reference.assert_within_bound(grad, high, low, name)
    expected_d = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    assert softmax_d.shape == (2, heads, seqlen_q) and softmax_d.dtype == torch.float32
    assert torch.allclose(softmax_d.double(), expected_d, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_te_style_backward_is_bitwise_repeatable(causal):
    gen = torch.Generator(device="cuda").manual_seed(seed_of("te-repeat", causal))
    q, k, v = (torch.randn(2, 1536, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    dout = torch.randn_like(q)
    scale = 128 ** -0.5
    out, lse, *_ = _te_forward(q, k, v, causal, scale, 1536, 1536)
    first = [torch.empty_like(t) for t in (q, k, v)]
    _te_backward(dout, q, k, v, out, lse, *first, causal, scale, 1536, 1536)
    for i in range(30):
        again = [torch.empty_like(t) for t in (q, k, v)]
        _te_backward(dout, q, k, v, out, lse, *again, causal, scale, 1536, 1536)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"repeat {i}: {name} differs bitwise"


@pytest.mark.gpu
def test_backward_into_views_of_one_packed_gradient():
    """dq, dk, dv as views of one (B, S, 3, H, D) buffer, as a packed-QKV caller passes them."""
    gen = torch.Generator(device="cuda").manual_seed(seed_of("packed-grad"))
    qkv = torch.randn(2, 300, 3, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = qkv.unbind(dim=2)
    dout = torch.randn_like(q)
    out, lse, *_ = _flash_attn_forward(q, k, v, causal=True)
    dqkv = torch.full_like(qkv, float("nan"))
    dq, dk, dv = dqkv.unbind(dim=2)
    _flash_attn_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, is_causal=True, deterministic=True)
    assert torch.isfinite(dqkv).all()
    expected = api.attention_backward(dout, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, causal=True,
                                      deterministic=True)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        assert torch.equal(got, want), name


@pytest.mark.gpu
def test_forward_writes_out_buffer_and_is_differentiable():
    """out_ receives the output (and is what is returned); with grad on, the forward's own
    autograd (deterministic under the global flag) gives the bits _flash_attn_backward gives."""
    gen = torch.Generator(device="cuda").manual_seed(seed_of("out-buffer"))
    q, k, v = (torch.randn(1, 512, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    dout = torch.randn_like(q)
    out_ = torch.empty_like(q)
    out, lse, *_ = _flash_attn_forward(q, k, v, out_=out_, causal=True)
    assert out is out_
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    torch.use_deterministic_algorithms(True)
    try:
        out2, lse2, *_ = _flash_attn_forward(qs, ks, vs, causal=True)
        out2.backward(dout)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(out2.detach(), out) and torch.equal(lse2.detach(), lse)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    _flash_attn_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, is_causal=True, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), (qs.grad, ks.grad, vs.grad), (dq, dk, dv)):
        assert torch.equal(a, b), name


def test_softmax_d_in_slices_equals_the_whole(monkeypatch):
    """_flash_attn_backward's softmax_d (FA3's D = rowsum(dout * out), float32, (B, H, Sq)) is
    computed over sequence slices to bound its float32 temporaries; slicing changes nothing."""
    gen = torch.Generator().manual_seed(7)
    dout = torch.randn(2, 37, 3, 64, generator=gen).to(torch.bfloat16)
    out = torch.randn(2, 37, 3, 64, generator=gen).to(torch.bfloat16)
    whole = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    monkeypatch.setattr(fai, "_SOFTMAX_D_SLICE_ELEMENTS", 2 * 3 * 64 * 5)  # 5 rows per slice, a ragged last one
    sliced = fai._softmax_d(dout, out)
    assert sliced.shape == (2, 3, 37) and sliced.dtype == torch.float32 and sliced.is_contiguous()
    assert torch.allclose(sliced.double(), whole, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(fai, "_SOFTMAX_D_SLICE_ELEMENTS", 1 << 24)
    assert torch.equal(fai._softmax_d(dout, out), sliced)


# ---------------------------------------------------------------------------------------
# Packed variable-length sequences (TransformerEngine's THD layout) through the entry points
# ---------------------------------------------------------------------------------------
def _packed(lengths=(5, 0, 17), heads=4, heads_kv=2, head_dim=64):
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, dtype=torch.bfloat16)
    k = torch.randn(total, heads_kv, head_dim, dtype=torch.bfloat16)
    v = torch.randn(total, heads_kv, head_dim, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(lengths)


@pytest.mark.parametrize("given", ["cu_seqlens_q", "cu_seqlens_k"])
def test_one_varlen_offset_alone_is_refused(given):
    q, k, v, cu, longest = _packed()
    with pytest.raises(ValueError, match=rf"^{given} is given but cu_seqlens_[qk] is None; packed \(varlen\) "
                                         r"sequences need both offsets"):
        _flash_attn_forward(q, k, v, **{given: cu}, max_seqlen_q=longest, max_seqlen_k=longest)
    with pytest.raises(ValueError, match=rf"^{given} is given"):
        _flash_attn_backward(q, q, k, v, q, torch.zeros(4, q.shape[0]), **{given: cu}, max_seqlen_q=longest,
                             max_seqlen_k=longest)


@pytest.mark.parametrize("left, right, causal, expect", [(-1, -1, False, False), (-1, 0, False, True),
                                                         (-1, -1, True, True)])
def test_varlen_forward_reaches_the_varlen_op(cpu_as_sm90, left, right, causal, expect):
    q, k, v, cu, longest = _packed()
    out_ = torch.empty_like(q)
    out, lse, out_accum, lse_accum = _flash_attn_forward(
        q, k, v, out_=out_, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
        causal=causal, window_size_left=left, window_size_right=right)
    (call,) = cpu_as_sm90
    assert call["cu_seqlens_q"] is cu and call["max_seqlen_q"] == longest and call["causal"] is expect
    assert call["schedule"] == "fa3"  # no backward will run: nothing to choose
    assert out is out_ and lse.shape == (4, q.shape[0]) and out_accum.numel() == lse_accum.numel() == 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_backward_reaches_the_varlen_op(cpu_as_sm90, deterministic):
    q, k, v, cu, longest = _packed()
    dout, out = torch.randn_like(q), torch.randn_like(q)
    lse = torch.zeros(4, q.shape[0])
    dq, dk, dv = torch.full_like(q, 7.0), torch.full_like(k, 7.0), torch.full_like(v, 7.0)
    softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, cu, cu, None, None, longest, longest, dq, dk, dv,
                                     is_causal=True, deterministic=deterministic)
    (call,) = cpu_as_sm90
    assert call["deterministic"] is deterministic and call["causal"] is True
    assert call["schedule"] in ("fa3", "interleaved", "descending")
    assert torch.all(dq == 0) and torch.all(dk == 0) and torch.all(dv == 0)  # the recorder's zeros, copied in
    expected = (dout.float() * out.float()).sum(-1).transpose(0, 1)
    torch.testing.assert_close(softmax_d, expected)


def test_varlen_backward_checks_its_lse(cpu_as_sm90):
    q, k, v, cu, longest = _packed()
    with pytest.raises(ValueError, match=r"softmax_lse must be float32 \(heads, total_q\) = \(4, 22\) for packed "
                                         r"sequences; got shape \(1, 4, 22\)"):
        _flash_attn_backward(q, q, k, v, q, torch.zeros(1, 4, q.shape[0]), cu, cu, None, None, longest, longest)
    with pytest.raises(ValueError, match=r"max_seqlen_q=None must be an int"):
        _flash_attn_backward(q, q, k, v, q, torch.zeros(4, q.shape[0]), cu, cu)
    assert cpu_as_sm90 == []


def test_varlen_window_is_normalised_with_validated_lengths(cpu_as_sm90):
    """numpy ints are lengths like any int: a window shorter than them stays a (refused) sliding
    window instead of being widened to none."""
    np = pytest.importorskip("numpy")
    q, k, v, cu, longest = _packed()
    with pytest.raises(NotImplementedError, match="sliding-window attention is not supported yet"):
        _flash_attn_forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=np.int64(longest),
                            max_seqlen_k=np.int64(longest), window_size_left=3, window_size_right=0)
    _flash_attn_forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=np.int64(longest),
                        max_seqlen_k=np.int64(longest), window_size_left=-1, window_size_right=0)
    assert cpu_as_sm90[0]["causal"] is True and cpu_as_sm90[0]["max_seqlen_q"] == longest


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for one test, then the flag as it was."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("varlen", [False, True])
def test_backward_entry_point_follows_the_deterministic_flag(cpu_as_sm90, deterministic_algorithms, varlen):
    """FA3's _flash_attn_backward defaults to deterministic=False, which TransformerEngine passes
    on when its user never chose: under torch.use_deterministic_algorithms(True) the ordered
    backward runs anyway (an upgrade, never a downgrade: True stays True without the flag)."""
    if varlen:
        q, k, v, cu, longest = _packed()
        dout, out, lse = torch.randn_like(q), torch.randn_like(q), torch.zeros(4, q.shape[0])
        _flash_attn_backward(dout, q, k, v, out, lse, cu, cu, None, None, longest, longest, is_causal=True)
    else:
        _flash_attn_backward(*_backward_args())
    (call,) = cpu_as_sm90
    assert call["deterministic"] is True
