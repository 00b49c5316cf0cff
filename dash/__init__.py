"""DASH: a FlashAttention-3-compatible attention library for Hopper whose backward pass is
bitwise deterministic, with schedules chosen by a scheduling model you can run.

    from dash import flash_attn_func          # same arguments as FA3's flash_attn_func
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)

Importing ``dash`` needs neither torch nor a GPU; the attention functions load torch on
first use, so ``python -m dash simulate`` runs anywhere.
"""

from dash._ext import KernelsNotBuiltError, kernels_available, manifest

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "KernelsNotBuiltError",
    "kernels_available",
    "manifest",
]
__version__ = "0.1.0"

_INTERFACE_NAMES = {"flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func"}


def __getattr__(name: str):
    if name in _INTERFACE_NAMES:
        from dash import interface

        return getattr(interface, name)
    raise AttributeError(f"module 'dash' has no attribute {name!r}")
