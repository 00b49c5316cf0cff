"""Backwards-compatible home of DASH's API, which now lives in three modules:

* ``dash.api``        -- the public functions (flash_attn_func, flash_attn_qkvpacked_func,
  flash_attn_varlen_func, attention_backward);
* ``dash.validation`` -- every check on user input (validate_inputs, effective_causal, ...);
* ``dash.ops``        -- the torch ops (``dash::fwd`` and its autograd, the fakes of
  ``dash::bwd``) and the call-time schedule decisions (resolve_schedule, ...).

Code that imported these names from ``dash.interface`` keeps working; new code should import
from the modules above. The names here are the same objects, so replacing one here (for
example with ``monkeypatch``) does not change what the other modules call.
"""

from __future__ import annotations

# The underscore names are the pre-split private helpers under their old names, kept for
# code that reached for them; they are not part of __all__.
from dash.api import attention_backward, flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from dash.config import KERNEL_SCHEDULES, PORTABLE_KERNEL_SCHEDULES, SUPPORTED_HEAD_DIMS
from dash.ops import _auto_schedule, forward_impl, resolve_schedule  # noqa: F401
from dash.ops import grid_ctas as _grid_ctas  # noqa: F401
from dash.ops import resolve_deterministic as _resolve_deterministic  # noqa: F401
from dash.validation import SCHEDULE_NAMES, effective_causal, validate_inputs
from dash.validation import check_cuda_devices as _check_cuda_devices  # noqa: F401
from dash.validation import check_tensor as _check_tensor  # noqa: F401
from dash.validation import describe_tensor as _describe  # noqa: F401
from dash.validation import is_tma_aligned as _aligned  # noqa: F401

__all__ = [
    "KERNEL_SCHEDULES",
    "PORTABLE_KERNEL_SCHEDULES",
    "SCHEDULE_NAMES",
    "SUPPORTED_HEAD_DIMS",
    "attention_backward",
    "effective_causal",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "forward_impl",
    "resolve_schedule",
    "validate_inputs",
]
