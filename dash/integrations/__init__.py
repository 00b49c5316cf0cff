"""Integrations of DASH with other libraries.

Each integration is a submodule that imports its library only when the submodule itself
is imported, so ``import dash`` (and ``import dash.integrations``) never needs them:

* :mod:`dash.integrations.transformers` -- DASH as a Hugging Face ``transformers``
  attention implementation: ``import dash.integrations.transformers`` registers
  ``attn_implementation="dash"`` (see ``docs/transformers.md``).
"""
