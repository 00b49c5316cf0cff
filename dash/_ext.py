"""Loading of the compiled extension and the build manifest written by setup.py."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

_MANIFEST_PATH = Path(__file__).with_name("_build_manifest.json")


class KernelsNotBuiltError(RuntimeError):
    """Raised when a DASH kernel is called in an install that has no compiled kernels."""


def _read_manifest() -> dict[str, Any]:
    try:
        return json.loads(_MANIFEST_PATH.read_text())
    except FileNotFoundError:
        return {
            "kernels_built": False,
            "reason_not_built": "no build manifest: this dash was not installed through setup.py "
            "(pip install --no-build-isolation .)",
            "head_dims": [],
            "dtypes": [],
        }


# Read once at import: callers (also code traced by torch.compile) only look it up.
_MANIFEST: dict[str, Any] = _read_manifest()


def manifest() -> dict[str, Any]:
    """What setup.py compiled: head dims, dtypes, arch, CUDA/torch versions, git commit."""
    return _MANIFEST


@functools.lru_cache(maxsize=None)
def _load() -> tuple[bool, str | None]:
    info = manifest()
    if not info.get("kernels_built"):
        return False, info.get("reason_not_built") or "the CUDA kernels were not built"
    try:
        import torch  # noqa: F401  (the extension links against libtorch)

        from dash import _C  # noqa: F401  (registers torch.ops.dash.*)
    except ImportError as e:
        import sys

        built_for = str(info.get("python") or "")
        running = f"{sys.version_info.major}.{sys.version_info.minor}"
        if built_for and ".".join(built_for.split(".")[:2]) != running:
            return False, f"the kernels were built for Python {built_for}, this is Python {running} (rebuild here)"
        return False, f"the compiled extension dash._C failed to import: {e}"
    return True, None


def kernels_available() -> bool:
    return _load()[0]


def kernels_status() -> tuple[bool, str | None]:
    """(usable, reason when not)."""
    return _load()


def require_kernels() -> None:
    ok, reason = _load()
    if not ok:
        raise KernelsNotBuiltError(
            f"DASH's CUDA kernels are not available in this install: {reason}. "
            "Rebuild on a machine with a CUDA toolkit and a CUDA build of torch: "
            "pip install --no-build-isolation . (see README, 'Install')."
        )
