"""Drop-in module path for code written against FA3:

    from dash.flash_attn_interface import flash_attn_func
"""

from dash.interface import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func"]
