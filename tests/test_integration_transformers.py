"""DASH as a Hugging Face transformers attention implementation (dash.integrations.transformers).

CPU tests (everywhere transformers is installed): registration, model construction, the
argument translation -- checked by replacing ``dash.api.flash_attn_func`` with a
differentiable reference that has FA3's semantics (bottom-right causal, GQA) and comparing a
tiny Llama's forward/backward with ``attn_implementation="sdpa"`` -- and every error path.

GPU tests (``gpu`` marker, skipped without an sm_90 GPU): a tiny Llama built in code trains for
a few AdamW steps with DASH in a subprocess (so that CUBLAS_WORKSPACE_CONFIG is set before
cuBLAS starts and ``torch.use_deterministic_algorithms`` does not leak into other tests); two
runs are bit-identical, a second process gives the same bits, and the losses and first-step
gradients are close to an SDPA run. This file is also the subprocess' script (``__main__``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import subprocess
import sys
import time
import types

import pytest

torch = pytest.importorskip("torch")
try:
    import transformers
except ImportError:
    pytest.skip("transformers is not installed (pip install 'transformers>=4.51')", allow_module_level=True)
if getattr(transformers, "AttentionInterface", None) is None:
    pytest.skip(f"transformers {transformers.__version__} is older than 4.51 (no AttentionInterface)",
                allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import dash  # noqa: E402
import dash.integrations.transformers as dt  # noqa: E402
from dash import api as dash_api  # noqa: E402
from dash import reference  # noqa: E402
from dash.config import KERNEL_SCHEDULES  # noqa: E402
from dash.validation import SCHEDULE_NAMES, validate_inputs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dash.__file__)))
MASK_INTERFACE = dt._interfaces()[1]
needs_mask_interface = pytest.mark.skipif(MASK_INTERFACE is None, reason="transformers < 4.53 has no mask interface")


# ---------------------------------------------------------------------------------------
# A differentiable stand-in for dash.api.flash_attn_func (CPU, any dtype)
# ---------------------------------------------------------------------------------------
class ReferenceFlashAttn:
    """FA3 semantics in plain PyTorch: q (B, Sq, H, D), k/v (B, Sk, Hk, D), bottom-right
    causal, GQA by head groups. Computes in float32, returns q's dtype, records each call.
    ``validate=True`` first runs DASH's own input validation (everything but the device
    checks), so the tensors the integration passes are ones DASH accepts; float32 tests of
    the math turn it off (DASH itself takes bf16/fp16 only)."""

    def __init__(self, validate: bool = True):
        self.validate = validate
        self.calls: list[dict] = []

    def __call__(self, q, k, v, softmax_scale=None, causal=False, deterministic=None, schedule="auto", **kwargs):
        if self.validate:
            validate_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal, schedule=schedule,
                            deterministic=deterministic, check_device=False)
        self.calls.append(dict(q_shape=tuple(q.shape), k_shape=tuple(k.shape), v_shape=tuple(v.shape),
                               q_stride=tuple(q.stride()), q_is_view=q._base is not None, dtype=q.dtype,
                               softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                               schedule=schedule, kwargs=kwargs))
        return reference_attention(q, k, v, softmax_scale, causal)


def reference_attention(q, k, v, softmax_scale=None, causal=False):
    _, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(heads // heads_k, dim=2)
    vv = v.repeat_interleave(heads // heads_k, dim=2)
    mask = None
    if causal:
        mask = torch.arange(seqlen_k)[None, :] <= torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), kk.float().transpose(1, 2),
                                         vv.float().transpose(1, 2), attn_mask=mask, scale=scale)
    return out.transpose(1, 2).to(q.dtype).contiguous()


@pytest.fixture
def fake_dash(monkeypatch):
    fake = ReferenceFlashAttn()
    monkeypatch.setattr(dash_api, "flash_attn_func", fake)
    return fake


@pytest.fixture(autouse=True)
def _restore_default_registration():
    yield
    dt.register()  # tests that re-register "dash" with other settings must not leak them


# ---------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------
def tiny_llama_config(heads=4, kv_heads=4, head_dim=64, layers=2, hidden=128, vocab=101, **extra):
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=256, **extra)


def build(config, attn_implementation, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation)
    return model.to(dtype)


def model_pair(config, dtype=torch.float32):
    """The same weights with attn_implementation 'dash' and 'sdpa'."""
    dash_model = build(config, "dash", dtype)
    sdpa_model = build(config, "sdpa", dtype)
    sdpa_model.load_state_dict(dash_model.state_dict())
    return dash_model, sdpa_model


def token_batch(config, batch=2, seqlen=24, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seqlen), generator=gen)


def forward_backward(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def assert_close_models(a, b, rtol, atol, label):
    logits_a, loss_a, grads_a = a
    logits_b, loss_b, grads_b = b
    torch.testing.assert_close(logits_a.float(), logits_b.float(), rtol=rtol, atol=atol, msg=f"{label}: logits")
    torch.testing.assert_close(loss_a.float(), loss_b.float(), rtol=rtol, atol=atol, msg=f"{label}: loss")
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        ga, gb = grads_a[name].float(), grads_b[name].float()
        scale = gb.abs().max().item() or 1.0  # tolerances relative to the gradient's magnitude
        assert (ga - gb).abs().max().item() <= (atol + rtol) * scale, f"{label}: grad of {name}"


def stub_module(is_causal=True, output_attentions=False):
    return types.SimpleNamespace(is_causal=is_causal, config=types.SimpleNamespace(output_attentions=output_attentions))


def bhsd(batch=1, heads=2, seqlen=8, head_dim=64, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, seqlen, head_dim, generator=gen).to(dtype)


# ---------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------
def test_import_registers_dash():
    attention_interface, mask_interface = dt._interfaces()
    assert "dash" in attention_interface()
    assert attention_interface()["dash"].dash_settings == dt.Settings("dash", None, "auto")
    if mask_interface is not None:
        assert "dash" in mask_interface()
    assert dt.registered_names()["dash"] == dt.Settings("dash", None, "auto")


def test_register_is_idempotent():
    attention_interface, mask_interface = dt._interfaces()
    first = attention_interface()["dash"]
    assert dt.register() == "dash"
    assert dt.register() == "dash"
    assert attention_interface()["dash"] is first
    if mask_interface is not None:
        assert mask_interface()["dash"] is dt._registered["dash"][2]
    # Other settings replace the registration; the last call wins.
    dt.register(deterministic=True, schedule="fa3")
    assert attention_interface()["dash"].dash_settings == dt.Settings("dash", True, "fa3")
    dt.register()
    assert attention_interface()["dash"].dash_settings == dt.Settings("dash", None, "auto")


def test_register_under_another_name_with_settings(fake_dash):
    assert dt.register("dash_det", deterministic=True) == "dash_det"
    assert dt.register("dash_det", deterministic=True) == "dash_det"
    config = tiny_llama_config()
    model = build(config, "dash_det", torch.bfloat16)
    model(token_batch(config), use_cache=False)
    assert fake_dash.calls and all(c["deterministic"] is True and c["schedule"] == "auto" for c in fake_dash.calls)


@pytest.mark.parametrize("name", ["", "sdpa", "my_flash", "kernels-community/flash", "paged|dash", "dash det",
                                  "eager", "FLEX", 3, None])
def test_register_rejects_names_transformers_reserves(name):
    with pytest.raises(ValueError, match="name="):
        dt.register(name)


def test_register_rejects_bad_settings():
    with pytest.raises(TypeError, match="deterministic"):
        dt.register(deterministic="yes")
    with pytest.raises(ValueError, match="schedule='nope' is unknown"):
        dt.register(schedule="nope")
    unimplemented = [s for s in SCHEDULE_NAMES if s != "auto" and s not in KERNEL_SCHEDULES]
    if unimplemented:
        with pytest.raises(NotImplementedError, match=f"schedule='{unimplemented[0]}'"):
            dt.register(schedule=unimplemented[0])


def test_old_transformers_error_names_the_minimum_version():
    old = types.SimpleNamespace(__version__="4.50.3")
    with pytest.raises(ImportError, match=r"transformers 4\.50\.3 has no AttentionInterface.*>= 4\.51"):
        dt._interfaces(old)


def test_importing_dash_does_not_import_transformers():
    code = "import sys, dash, dash.integrations; assert 'transformers' not in sys.modules, 'imported transformers'"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


# ---------------------------------------------------------------------------------------
# Construction and switching
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_from_config_builds_with_dash(heads, kv_heads):
    model = build(tiny_llama_config(heads=heads, kv_heads=kv_heads), "dash")
    assert model.config._attn_implementation == "dash"


@pytest.mark.skipif(not hasattr(transformers.PreTrainedModel, "set_attn_implementation"),
                    reason="this transformers has no PreTrainedModel.set_attn_implementation")
def test_set_attn_implementation_switches_a_model_to_dash(fake_dash):
    fake_dash.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    model = build(config, "sdpa")
    ids = token_batch(config)
    before = model(ids, use_cache=False).logits
    assert not fake_dash.calls
    model.set_attn_implementation("dash")
    assert model.config._attn_implementation == "dash"
    after = model(ids, use_cache=False).logits
    assert len(fake_dash.calls) == config.num_hidden_layers
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Argument translation: DASH (reference stand-in) vs SDPA on a tiny Llama
# ---------------------------------------------------------------------------------------
CONFIGS = {
    "mha-hd64": dict(heads=4, kv_heads=4, head_dim=64),
    "gqa-8x2-hd64": dict(heads=8, kv_heads=2, head_dim=64),
    "mqa-4x1-hd128": dict(heads=4, kv_heads=1, head_dim=128),
}


@pytest.mark.parametrize("label", list(CONFIGS))
def test_forward_backward_match_sdpa_float32(label, fake_dash):
    fake_dash.validate = False  # float32: DASH would reject the dtype; this test is about the math
    config = tiny_llama_config(**CONFIGS[label])
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config)
    a = forward_backward(dash_model, ids)
    b = forward_backward(sdpa_model, ids)
    assert_close_models(a, b, rtol=1e-4, atol=1e-5, label=label)
    assert len(fake_dash.calls) == config.num_hidden_layers
    heads, kv_heads, head_dim = (CONFIGS[label][k] for k in ("heads", "kv_heads", "head_dim"))
    for call in fake_dash.calls:
        assert call["q_shape"] == (2, 24, heads, head_dim)
        assert call["k_shape"] == call["v_shape"] == (2, 24, kv_heads, head_dim)  # GQA heads go in unrepeated
        assert call["causal"] is True
        assert call["softmax_scale"] == pytest.approx(head_dim**-0.5)
        assert call["deterministic"] is None and call["schedule"] == "auto"


@pytest.mark.parametrize("label", list(CONFIGS))
def test_bf16_inputs_pass_dash_validation_without_copies(label, fake_dash):
    config = tiny_llama_config(**CONFIGS[label])
    dash_model, sdpa_model = model_pair(config, torch.bfloat16)
    ids = token_batch(config)
    a = forward_backward(dash_model, ids)
    b = forward_backward(sdpa_model, ids)
    assert_close_models(a, b, rtol=3e-2, atol=3e-2, label=label)
    heads, head_dim = CONFIGS[label]["heads"], CONFIGS[label]["head_dim"]
    seqlen = 24
    for call in fake_dash.calls:
        assert call["dtype"] == torch.bfloat16
        # q is a (B, S, H, D) view of transformers' (B, H, S, D) tensor (whose memory may be
        # either order): no copy was made
        assert call["q_is_view"]
        assert call["q_stride"] in [(heads * seqlen * head_dim, heads * head_dim, head_dim, 1),
                                    (heads * seqlen * head_dim, head_dim, seqlen * head_dim, 1)]


def test_custom_scaling_is_passed_as_softmax_scale(fake_dash):
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    out, weights = dt.attention_forward(stub_module(), q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (1, 8, 2, 64)
    assert fake_dash.calls[-1]["softmax_scale"] == 0.3
    torch.testing.assert_close(out, reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.3,
                                                        True))


def test_reference_stand_in_has_fa3_semantics():
    """The stand-in agrees with dash.reference (bottom-right causal, GQA groups)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, 64, generator=gen)
    k = torch.randn(2, 9, 2, 64, generator=gen)
    v = torch.randn(2, 9, 2, 64, generator=gen)
    for causal in (False, True):
        expected, _ = reference.attention_forward(q, k, v, causal=causal, compute_dtype=torch.float64)
        torch.testing.assert_close(reference_attention(q, k, v, None, causal).double(), expected, rtol=1e-5, atol=1e-6)


def test_generate_matches_sdpa(fake_dash):
    """Prefill and single-token decode steps with a KV cache (seqlen_q < seqlen_k: bottom-right causal)."""
    fake_dash.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    dash_model, sdpa_model = model_pair(config)
    dash_model.eval()
    sdpa_model.eval()
    prompt = token_batch(config, batch=1, seqlen=7)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(dash_model.generate(prompt, **kwargs), sdpa_model.generate(prompt, **kwargs))
    assert any(c["q_shape"][1] == 1 and c["k_shape"][1] > 1 for c in fake_dash.calls)


@pytest.mark.skipif("is_causal" not in getattr(getattr(transformers.utils.generic, "TransformersKwargs", None),
                                                "__annotations__", {}),
                    reason="this transformers has no is_causal forward kwarg")
def test_is_causal_false_runs_bidirectional(fake_dash):
    fake_dash.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config)
    a = dash_model(ids, use_cache=False, is_causal=False).logits
    b = sdpa_model(ids, use_cache=False, is_causal=False).logits
    assert fake_dash.calls and all(c["causal"] is False for c in fake_dash.calls)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _breaks_in_integration(explanation):
    here = os.path.join("integrations", "transformers.py")
    return [r for r in explanation.break_reasons if any(f.filename.endswith(here) for f in r.user_stack)]


def test_torch_compile_traces_the_attention_function(fake_dash):
    """TorchDynamo traces the attention function without a graph break (the mask function,
    which inspects transformers' mask closures, runs eagerly: it is not in the trace). With
    transformers < 4.53 the model hands a 4D mask to every layer, whose check does break."""
    fake_dash.validate = False
    config = tiny_llama_config(heads=8, kv_heads=2)
    model = build(config, "dash")
    ids = token_batch(config)
    run = lambda x: model(x, use_cache=False).logits  # noqa: E731
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(run)(ids)
        if MASK_INTERFACE is not None:
            assert not _breaks_in_integration(explanation), _breaks_in_integration(explanation)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(run, backend="eager")(ids), run(ids))
    finally:
        torch._dynamo.reset()


def test_torch_compile_still_rejects_packed_position_ids(fake_dash):
    """Compiled, the position_ids check is an asynchronous assert (no graph break); on CPU it
    raises at once, on CUDA as a device-side assert."""
    fake_dash.validate = False
    q, k, v = bhsd(seqlen=8), bhsd(seqlen=8, seed=1), bhsd(seqlen=8, seed=2)
    module = torch.nn.Module()
    module.is_causal = True
    step = lambda q, k, v, pos: dt.attention_forward(module, q, k, v, None, position_ids=pos)[0]  # noqa: E731
    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        compiled(q, k, v, torch.arange(8)[None])
        with pytest.raises(RuntimeError, match=r"does not support packed sequences \(varlen\)"):
            compiled(q, k, v, torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))
    finally:
        torch._dynamo.reset()


def test_autocast_float32_inputs_are_cast(fake_dash):
    """Under torch.autocast, float32 q/k/v (e.g. after a float32 RoPE) go to DASH in the
    autocast dtype, as SDPA would compute them."""
    q, k, v = (bhsd(dtype=torch.float32, seed=s) for s in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = dt.attention_forward(stub_module(), q, k, v, None)
    assert fake_dash.calls[-1]["dtype"] == torch.bfloat16 and out.dtype == torch.bfloat16
    config = tiny_llama_config(heads=8, kv_heads=2)
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = dash_model(ids, use_cache=False).logits
        b = sdpa_model(ids, use_cache=False).logits
    torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


def test_all_ones_padding_mask_is_accepted(fake_dash):
    fake_dash.validate = False
    config = tiny_llama_config()
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config)
    ones = torch.ones_like(ids)
    torch.testing.assert_close(dash_model(ids, attention_mask=ones, use_cache=False).logits,
                               sdpa_model(ids, use_cache=False).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["bool-causal", "float-causal", "bool-full"])
def test_exact_4d_masks_are_accepted(kind, fake_dash):
    """A 4D mask that is exactly causal or exactly all-visible decides causality, as in SDPA."""
    fake_dash.validate = False
    config = tiny_llama_config()
    dash_model, sdpa_model = model_pair(config)
    ids = token_batch(config, seqlen=16)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    mask = {"bool-causal": causal, "bool-full": torch.ones(16, 16, dtype=torch.bool),
            "float-causal": torch.zeros(16, 16).masked_fill(~causal, torch.finfo(torch.float32).min)}[kind]
    mask = mask.expand(2, 1, 16, 16)
    a = dash_model(ids, attention_mask=mask, use_cache=False).logits
    b = sdpa_model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert all(c["causal"] is (kind != "bool-full") for c in fake_dash.calls)


# ---------------------------------------------------------------------------------------
# Errors: each names the feature and its value, never a fallback
# ---------------------------------------------------------------------------------------
def test_padding_mask_raises(fake_dash):
    config = tiny_llama_config()
    model = build(config, "dash")
    ids = token_batch(config, seqlen=10)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of the second sequence
    # transformers >= 4.53: our mask function sees the 2D mask; older versions build a 4D one
    with pytest.raises(NotImplementedError, match=r"does not support a padding mask: .*attention_mask \(shape \(2, "):
        model(ids, attention_mask=mask, use_cache=False)
    assert not fake_dash.calls


def test_custom_4d_mask_raises(fake_dash):
    config = tiny_llama_config()
    model = build(config, "dash")
    ids = token_batch(config, seqlen=8)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    mask[5, 2] = False
    with pytest.raises(NotImplementedError, match=r"does not support a custom attention mask: the 4D attention_mask"):
        model(ids, attention_mask=mask.expand(2, 1, 8, 8), use_cache=False)


@pytest.mark.parametrize("causal", [True, False])
def test_padded_4d_mask_is_named_a_padding_mask(causal):
    """The 4D masks transformers < 4.53 builds from a padded 2D mask (or users pass)."""
    q, k, v = bhsd(batch=2), bhsd(batch=2, seed=1), bhsd(batch=2, seed=2)
    keep = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    if causal:
        keep &= torch.ones(8, 8, dtype=torch.bool).tril()
    keep[1, ..., :3] = False  # left padding of the second sequence
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    with pytest.raises(NotImplementedError, match=r"does not support a padding mask: the 4D attention_mask"):
        dt.attention_forward(stub_module(is_causal=causal), q, k, v, mask)


def test_additive_bias_mask_raises():
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    bias = torch.zeros(1, 1, 8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    bias[..., 7, 0] = -1.0  # a soft bias, not a mask
    with pytest.raises(NotImplementedError, match="custom attention mask"):
        dt.attention_forward(stub_module(), q, k, v, bias)


@pytest.mark.parametrize("training", [True, False])
def test_dropout_raises_in_training(training, fake_dash):
    fake_dash.validate = False
    config = tiny_llama_config(attention_dropout=0.1)
    model = build(config, "dash")
    model.train(training)
    ids = token_batch(config)
    if training:
        with pytest.raises(NotImplementedError, match=r"does not support attention dropout: dropout=0\.1"):
            model(ids, use_cache=False)
    else:
        model(ids, use_cache=False)
        assert len(fake_dash.calls) == config.num_hidden_layers


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_position_ids_raise(use_cache, fake_dash):
    config = tiny_llama_config()
    model = build(config, "dash")
    ids = token_batch(config, batch=1, seqlen=12)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with pytest.raises(NotImplementedError, match=r"does not support packed sequences \(varlen\)"):
        model(ids, position_ids=position_ids, use_cache=use_cache)
    assert not fake_dash.calls


def test_consecutive_position_ids_with_offset_are_fine(fake_dash):
    fake_dash.validate = False
    config = tiny_llama_config()
    model = build(config, "dash")
    ids = token_batch(config, batch=2, seqlen=12)
    model(ids, position_ids=torch.arange(5, 17).expand(2, 12), use_cache=False)
    assert len(fake_dash.calls) == config.num_hidden_layers


@pytest.mark.parametrize("kwarg", ["cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "seq_idx"])
def test_varlen_kwargs_raise(kwarg, fake_dash):
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    value = 8 if kwarg.startswith("max_length") else torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=rf"does not support packed sequences \(varlen\): {kwarg} was given"):
        dt.attention_forward(stub_module(), q, k, v, None, **{kwarg: value})
    assert not fake_dash.calls


@pytest.mark.parametrize("kwarg,feature", [("s_aux", "attention sinks"), ("sinks", "attention sinks"),
                                           ("position_bias", "additive attention bias"), ("head_mask", "head mask")])
def test_other_unsupported_kwargs_raise(kwarg, feature):
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    with pytest.raises(NotImplementedError, match=feature):
        dt.attention_forward(stub_module(), q, k, v, None, **{kwarg: torch.zeros(2)})


def test_sliding_window_raises_only_when_it_cuts(fake_dash):
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    with pytest.raises(NotImplementedError, match=r"does not support sliding-window attention: sliding_window=4 with"):
        dt.attention_forward(stub_module(), q, k, v, None, sliding_window=4)
    dt.attention_forward(stub_module(), q, k, v, None, sliding_window=8)  # covers every key: plain causal
    assert len(fake_dash.calls) == 1


@pytest.mark.skipif(not hasattr(transformers, "MistralConfig"), reason="no MistralConfig")
def test_sliding_window_model(fake_dash):
    fake_dash.validate = False
    config = transformers.MistralConfig(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=8)
    model = build(config, "dash")
    with pytest.raises(NotImplementedError, match=r"sliding-window attention: sliding_window=8"):
        model(token_batch(config, seqlen=12), use_cache=False)
    model(token_batch(config, seqlen=8), use_cache=False)
    assert len(fake_dash.calls) == config.num_hidden_layers


def test_softcap_raises():
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    with pytest.raises(NotImplementedError, match=r"does not support softcapping: softcap=50\.0"):
        dt.attention_forward(stub_module(), q, k, v, None, softcap=50.0)


def test_output_attentions_raises(fake_dash):
    config = tiny_llama_config()
    model = build(config, "dash")
    with pytest.raises(NotImplementedError, match=r"does not support output_attentions=True"):
        model(token_batch(config), output_attentions=True, use_cache=False)
    q, k, v = bhsd(), bhsd(seed=1), bhsd(seed=2)
    with pytest.raises(NotImplementedError, match="output_attentions=True"):
        dt.attention_forward(stub_module(output_attentions=True), q, k, v, None)


def test_unsupported_head_dim_error_comes_from_dash(fake_dash):
    config = tiny_llama_config(heads=4, kv_heads=4, head_dim=32)
    model = build(config, "dash", torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"head_dim=32 is not supported yet"):
        model(token_batch(config), use_cache=False)


def test_float32_without_autocast_error_comes_from_dash(fake_dash):
    config = tiny_llama_config()
    model = build(config, "dash", torch.float32)
    with pytest.raises(ValueError, match=r"q has dtype torch\.float32; supported: torch\.bfloat16, torch\.float16"):
        model(token_batch(config), use_cache=False)


def test_real_flash_attn_func_is_called_and_its_errors_propagate():
    """No stand-in: the real dash.api.flash_attn_func rejects CPU tensors; the error
    reaches the caller unchanged (nothing falls back to another implementation)."""
    config = tiny_llama_config()
    model = build(config, "dash", torch.bfloat16)
    with pytest.raises(ValueError, match=r"q is on device cpu; DASH runs on CUDA devices"):
        model(token_batch(config), use_cache=False)


# ---------------------------------------------------------------------------------------
# The mask function (transformers >= 4.53) and the mask / position checks
# ---------------------------------------------------------------------------------------
def _mask_fn(**kwargs):
    return dt._mask_function("dash", **kwargs)


@needs_mask_interface
def test_mask_function_plain_masks_build_nothing():
    from transformers import masking_utils as mu

    assert _mask_fn(batch_size=2, q_length=8, kv_length=8, mask_function=mu.causal_mask_function) is None
    assert _mask_fn(batch_size=1, q_length=1, kv_length=9, q_offset=8, mask_function=mu.causal_mask_function) is None
    if hasattr(mu, "bidirectional_mask_function"):
        assert _mask_fn(batch_size=2, q_length=8, kv_length=8, mask_function=mu.bidirectional_mask_function) is None
    ones = torch.ones(2, 8, dtype=torch.bool)
    assert _mask_fn(batch_size=2, q_length=8, kv_length=8, attention_mask=ones,
                    mask_function=mu.causal_mask_function) is None
    # transformers 4.53-4.5x pass cache_position instead of q_length/q_offset
    assert _mask_fn(batch_size=1, cache_position=torch.arange(4, 8), kv_length=8,
                    mask_function=mu.causal_mask_function) is None
    # a sliding window that covers every key changes nothing
    window = mu.sliding_window_causal_mask_function(8)
    assert _mask_fn(batch_size=1, q_length=8, kv_length=8, mask_function=window) is None


@needs_mask_interface
def test_mask_function_errors_name_the_feature():
    from transformers import masking_utils as mu

    causal = mu.causal_mask_function
    padded = torch.ones(2, 8, dtype=torch.bool)
    padded[0, 0] = False
    with pytest.raises(NotImplementedError, match="does not support a padding mask"):
        _mask_fn(batch_size=2, q_length=8, kv_length=8, attention_mask=padded, mask_function=causal)
    with pytest.raises(NotImplementedError, match="sliding-window attention: sliding_window=4 is shorter than the 8"):
        _mask_fn(batch_size=1, q_length=8, kv_length=8, mask_function=mu.sliding_window_causal_mask_function(4))
    with pytest.raises(NotImplementedError, match="a custom mask pattern"):
        _mask_fn(batch_size=1, q_length=8, kv_length=8,
                 mask_function=mu.or_masks(causal, lambda b, h, q, kv: kv == 0))
    with pytest.raises(NotImplementedError, match="a custom mask pattern: mask function"):
        _mask_fn(batch_size=1, q_length=8, kv_length=8, mask_function=lambda b, h, q, kv: kv <= q)
    with pytest.raises(NotImplementedError, match=r"KV cache longer than the tokens it holds \(e\.g\. StaticCache\)"):
        _mask_fn(batch_size=1, q_length=4, kv_length=16, q_offset=0, mask_function=causal)
    if hasattr(mu, "packed_sequence_mask_function"):
        seq_ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
        packed = mu.and_masks(causal, mu.packed_sequence_mask_function(seq_ids))
        with pytest.raises(NotImplementedError, match=r"packed sequences \(varlen\)"):
            _mask_fn(batch_size=1, q_length=6, kv_length=6, mask_function=packed)
        # under torch.compile transformers adds the packed-sequence leaf even for one sequence per row
        single = mu.and_masks(causal, mu.packed_sequence_mask_function(torch.zeros(1, 6, dtype=torch.long)))
        assert _mask_fn(batch_size=1, q_length=6, kv_length=6, mask_function=single) is None
    if hasattr(mu, "chunked_causal_mask_function"):
        try:
            chunked = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
        except TypeError:
            chunked = mu.chunked_causal_mask_function(4)
        with pytest.raises(NotImplementedError, match="chunked attention: attention_chunk_size=4"):
            _mask_fn(batch_size=1, q_length=8, kv_length=8, mask_function=chunked)


def _causal_4d(seqlen_q, seqlen_k, dtype=torch.bool, batch=2):
    visible = torch.arange(seqlen_k)[None, :] <= torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    if dtype == torch.bool:
        mask = visible
    else:
        mask = torch.zeros(seqlen_q, seqlen_k, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
    return mask.expand(batch, 1, seqlen_q, seqlen_k).contiguous()


@pytest.mark.parametrize("chunk", [7, 1 << 24])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16])
def test_four_d_mask_kind_in_chunks(chunk, dtype, monkeypatch):
    monkeypatch.setattr(dt, "_MASK_CHECK_CHUNK", chunk)
    for seqlen_q, seqlen_k in [(8, 8), (5, 13), (1, 6)]:
        mask = _causal_4d(seqlen_q, seqlen_k, dtype)
        full, causal = dt._four_d_mask_kind(mask, seqlen_q, seqlen_k)
        assert causal and full == (seqlen_q == 1)
        if seqlen_q < seqlen_k:  # the top-left aligned causal mask is not DASH's
            top_left = torch.arange(seqlen_k)[None, :] <= torch.arange(seqlen_q)[:, None]
            if dtype != torch.bool:
                top_left = torch.zeros(top_left.shape, dtype=dtype).masked_fill(~top_left, torch.finfo(dtype).min)
            assert dt._four_d_mask_kind(top_left[None, None], seqlen_q, seqlen_k) == (False, False)
        visible = torch.ones(1, 1, seqlen_q, seqlen_k, dtype=torch.bool) if dtype == torch.bool else \
            torch.zeros(1, 1, seqlen_q, seqlen_k, dtype=dtype)
        assert dt._four_d_mask_kind(visible, seqlen_q, seqlen_k) == (True, seqlen_q == 1)


def test_four_d_mask_checked_once_per_tensor_version(monkeypatch):
    calls = []
    real = dt._four_d_mask_kind
    monkeypatch.setattr(dt, "_four_d_mask_kind", lambda *a: calls.append(1) or real(*a))
    mask = _causal_4d(8, 8)
    for _ in range(4):  # the layers of one forward share the mask
        assert dt._mask_decides_causal("dash", mask, True, 8, 8) is True
    assert len(calls) == 1
    mask[0, 0, 3, 1] = False  # modified in place: checked again, and now rejected
    with pytest.raises(NotImplementedError, match="custom attention mask"):
        dt._mask_decides_causal("dash", mask, True, 8, 8)
    assert len(calls) == 2


def test_transformers_pre_453_style_masks_are_understood():
    """transformers < 4.53 builds a float (B, 1, Sq, Sk + 1) causal mask for custom
    implementations; the integration slices the key dim as transformers' SDPA path does."""
    mask = torch.cat([_causal_4d(8, 8, torch.float32), torch.full((2, 1, 8, 1), torch.finfo(torch.float32).min)], -1)
    assert dt._mask_decides_causal("dash", mask, True, 8, 8) is True
    with pytest.raises(ValueError, match="does not fit 8 queries and 9 keys"):
        dt._mask_decides_causal("dash", mask[..., :7], True, 8, 9)


def test_two_d_masks_in_the_attention_function():
    ones = torch.ones(2, 8, dtype=torch.long)
    assert dt._mask_decides_causal("dash", ones, True, 8, 8) is True
    padded = ones.clone()
    padded[1, 0] = 0
    with pytest.raises(NotImplementedError, match="padding mask"):
        dt._mask_decides_causal("dash", padded, True, 8, 8)
    with pytest.raises(NotImplementedError, match="BlockMask|type"):
        dt._mask_decides_causal("dash", object(), True, 8, 8)


def test_position_ids_check():
    dt._check_position_ids("dash", torch.arange(3, 11)[None], 8)
    dt._check_position_ids("dash", torch.tensor([[7]]), 1)  # decode step
    dt._check_position_ids("dash", torch.zeros(3, 2, 8, dtype=torch.long), 8)  # not (batch, seqlen): not read
    with pytest.raises(NotImplementedError, match="packed sequences"):
        dt._check_position_ids("dash", torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), 8)


# ---------------------------------------------------------------------------------------
# GPU: a tiny Llama trains deterministically with DASH (subprocess, see the module docstring)
# ---------------------------------------------------------------------------------------
#: Tiny Llamas built in code (no downloads). "autocast": float32 weights under bf16 autocast;
#: otherwise bf16 weights. Sequence lengths include ragged ones (not multiples of 128).
GPU_CONFIGS = {
    "mha-hd64-bf16": dict(heads=4, kv_heads=4, head_dim=64, seqlen=512, batch=2, autocast=False),
    "gqa-8x2-hd64-bf16": dict(heads=8, kv_heads=2, head_dim=64, seqlen=1024, batch=2, autocast=False),
    "gqa-8x2-hd128-autocast": dict(heads=8, kv_heads=2, head_dim=128, seqlen=768, batch=2, autocast=True),
    "mqa-4x1-hd128-bf16": dict(heads=4, kv_heads=1, head_dim=128, seqlen=333, batch=3, autocast=False),
}
GPU_STEPS = 5
GPU_HIDDEN = 256
GPU_LAYERS = 2
GPU_VOCAB = 1000
#: Relative tolerance of DASH's losses against SDPA's. DASH's forward is SDPA's flash kernel;
#: the backwards differ in summation order, i.e. by a few bf16 roundings (2**-8 = 3.9e-3) per
#: gradient element, which AdamW turns into parameter differences of at most ~lr per step.
#: Over 5 steps that moves a loss of ~6.9 by well under 1e-2 relative.
LOSS_RTOL = 1e-2
#: Relative L2 difference of the first step's full gradient (all parameters) against SDPA's:
#: a few bf16 roundings; a wrong mask, scale or head mapping gives O(1).
GRAD_RTOL = 3e-2


def _train(spec: dict, impl: str, device: str, keep_grads: bool = False) -> dict:
    """One seeded training run: GPU_STEPS AdamW steps. Returns losses, a digest of the final
    parameters, the parameters themselves and (optionally) the first step's gradients."""
    config = tiny_llama_config(heads=spec["heads"], kv_heads=spec["kv_heads"], head_dim=spec["head_dim"],
                               layers=GPU_LAYERS, hidden=GPU_HIDDEN, vocab=GPU_VOCAB)
    config.max_position_embeddings = 2048
    weights_dtype = torch.float32 if spec["autocast"] else torch.bfloat16
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
    model = model.to(device=device, dtype=weights_dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    # Fresh Zipf-distributed tokens each step: learnable statistics, so the loss goes down.
    gen = torch.Generator().manual_seed(99)
    zipf = 1.0 / torch.arange(1, GPU_VOCAB + 1, dtype=torch.float64)
    batches = [torch.multinomial(zipf, spec["batch"] * spec["seqlen"], replacement=True, generator=gen)
               .view(spec["batch"], spec["seqlen"]).to(device) for _ in range(GPU_STEPS)]
    losses, first_grads = [], None
    for step, ids in enumerate(batches):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=spec["autocast"]):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if step == 0 and keep_grads:
            first_grads = torch.cat([p.grad.detach().float().flatten() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    digest = hashlib.sha256()
    for name, p in params.items():
        digest.update(name.encode())
        digest.update(p.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return dict(losses=losses, digest=digest.hexdigest(), params=params, grads=first_grads)


def _train_all(configs: dict, device: str, with_sdpa: bool) -> dict:
    """Per config: two DASH runs (deterministic=True, all other ops deterministic too) and,
    optionally, one SDPA run. Counts the calls that reach dash.api.flash_attn_func."""
    dt.register("dash", deterministic=True)
    real = dash_api.flash_attn_func
    calls = {"n": 0}

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    results = {}
    dash_api.flash_attn_func = counting
    try:
        for label, spec in configs.items():
            t0 = time.time()
            torch.use_deterministic_algorithms(True, warn_only=False)
            calls["n"] = 0
            first = _train(spec, "dash", device, keep_grads=with_sdpa)
            dash_calls = calls["n"]
            second = _train(spec, "dash", device)
            differing = [n for n in first["params"] if not torch.equal(first["params"][n], second["params"][n])]
            entry = dict(losses=[first["losses"], second["losses"]], digests=[first["digest"], second["digest"]],
                         differing_params=differing, dash_calls_per_run=dash_calls)
            if with_sdpa:
                torch.use_deterministic_algorithms(False)
                calls["n"] = 0
                sdpa = _train(spec, "sdpa", device, keep_grads=True)
                entry["sdpa_losses"] = sdpa["losses"]
                entry["sdpa_dash_calls"] = calls["n"]
                entry["grad_rel_l2"] = ((first["grads"] - sdpa["grads"]).norm() / sdpa["grads"].norm()).item()
            entry["seconds"] = time.time() - t0
            results[label] = entry
    finally:
        dash_api.flash_attn_func = real
        torch.use_deterministic_algorithms(False)
        dt.register()
    return results


def check_bitwise_reproducible(a: dict, b: dict) -> None:
    """``a``: one process' entry for a config (two runs); ``b``: another process' entry."""
    assert a["dash_calls_per_run"] == GPU_LAYERS * GPU_STEPS, "DASH was not called for every layer and step"
    (l1, l2), (d1, d2) = a["losses"], a["digests"]
    assert all(math.isfinite(x) for x in l1), l1
    assert l1 == l2, f"losses differ between two runs: {l1} vs {l2}"
    assert not a["differing_params"], f"parameters differ bitwise after {GPU_STEPS} steps: {a['differing_params']}"
    assert d1 == d2
    assert b["losses"][0] == l1, f"another process gave other losses: {b['losses'][0]} vs {l1}"
    assert b["digests"][0] == d1, "another process gave other parameters"


def check_close_to_sdpa(a: dict) -> None:
    dash_losses, sdpa_losses = a["losses"][0], a["sdpa_losses"]
    assert a["sdpa_dash_calls"] == 0, "the SDPA run called DASH"
    for step, (x, y) in enumerate(zip(dash_losses, sdpa_losses)):
        assert abs(x - y) <= LOSS_RTOL * abs(y), f"step {step}: DASH loss {x} vs SDPA {y}"
    assert a["grad_rel_l2"] <= GRAD_RTOL, f"first-step gradient differs from SDPA's by {a['grad_rel_l2']:.3g} (rel L2)"
    assert dash_losses[-1] < dash_losses[0], f"the loss did not go down: {dash_losses}"


def test_training_harness_on_cpu(fake_dash):
    """The GPU tests' harness, on CPU with the reference stand-in and short sequences: checks
    the harness itself (counting, digests, comparisons), not DASH's kernel."""
    fake_dash.validate = True
    small = {"gqa-8x2-hd128-autocast": dict(GPU_CONFIGS["gqa-8x2-hd128-autocast"], seqlen=64)}
    a = _train_all(small, "cpu", with_sdpa=True)
    b = _train_all(small, "cpu", with_sdpa=False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert dt.registered_names()["dash"] == dt.Settings("dash", None, "auto")
    assert dash_api.flash_attn_func is fake_dash
    assert all(c["deterministic"] is True for c in fake_dash.calls)
    for label in small:
        check_bitwise_reproducible(a[label], b[label])
        check_close_to_sdpa(a[label])


def _gpu_main(out_path: str, with_sdpa: bool) -> None:
    """Subprocess entry: CUBLAS_WORKSPACE_CONFIG is set by the parent before cuBLAS starts."""
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    results = _train_all(GPU_CONFIGS, "cuda", with_sdpa)
    with open(out_path, "w") as f:
        json.dump(dict(results=results, transformers=transformers.__version__, torch=torch.__version__), f)


def _run_gpu_subprocess(tmp_path_factory, with_sdpa: bool) -> dict:
    out = tmp_path_factory.mktemp("hf_train") / "results.json"
    env = dict(os.environ, PYTHONPATH=ROOT, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    cmd = [sys.executable, os.path.abspath(__file__), "--gpu-train", str(out)] + (["--with-sdpa"] if with_sdpa else [])
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        pytest.fail(f"training subprocess failed (rc {p.returncode}):\n{p.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)["results"]


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    """Process A: per config two DASH runs and one SDPA run; process B: the DASH runs again."""
    return _run_gpu_subprocess(tmp_path_factory, True), _run_gpu_subprocess(tmp_path_factory, False)


@pytest.mark.gpu
@pytest.mark.parametrize("label", list(GPU_CONFIGS))
def test_gpu_training_is_bitwise_reproducible(label, gpu_runs):
    check_bitwise_reproducible(gpu_runs[0][label], gpu_runs[1][label])


@pytest.mark.gpu
@pytest.mark.parametrize("label", list(GPU_CONFIGS))
def test_gpu_training_close_to_sdpa(label, gpu_runs):
    check_close_to_sdpa(gpu_runs[0][label])


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--gpu-train":
        _gpu_main(sys.argv[2], "--with-sdpa" in sys.argv[3:])
    else:
        sys.exit(f"usage: {sys.argv[0]} --gpu-train OUT.json [--with-sdpa]")
