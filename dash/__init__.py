"""DASH: a FlashAttention-3-compatible attention library for Hopper whose backward pass is
bitwise deterministic, with schedules chosen by a scheduling model you can run.

    from dash import flash_attn_func          # same arguments as FA3's flash_attn_func
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)

Importing ``dash`` needs neither torch nor a GPU; the attention functions load torch on
first use, so ``python -m dash simulate`` runs anywhere.

``dash.install_as_flash_attn_3()`` (opt-in; see ``dash.fa3_alias``) makes
``import flash_attn_interface`` / ``flash_attn_3.flash_attn_interface`` load DASH when no
real FlashAttention-3 is installed.
"""

from dash._ext import KernelsNotBuiltError, kernels_available, manifest

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "install_as_flash_attn_3",
    "KernelsNotBuiltError",
    "kernels_available",
    "manifest",
]
__version__ = "0.1.0"

#: Lazy attributes: name -> the module that defines it (imported on first access).
_LAZY_ATTRIBUTES = {
    "flash_attn_func": "dash.api",
    "flash_attn_qkvpacked_func": "dash.api",
    "flash_attn_varlen_func": "dash.api",
    "install_as_flash_attn_3": "dash.fa3_alias",  # does not import torch until called
}


def __getattr__(name: str):
    if name in _LAZY_ATTRIBUTES:
        import importlib

        value = getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
        globals()[name] = value  # later lookups of dash.<name> skip this function (host time per call)
        return value
    raise AttributeError(f"module 'dash' has no attribute {name!r}")
