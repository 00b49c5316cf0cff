"""Loading of the compiled extension and the build manifest written by setup.py.

Two places hold a DASH: the installed package (site-packages) and the source checkout, whose
``dash/`` folder is what Python imports when you run ``python -m dash`` or ``python -m pytest``
from the repository root. ``pip install --no-build-isolation .`` places the kernels and the
manifest in both, so either runs the same kernels. When the checkout's ``dash/`` has no
kernels, or kernels built from other sources than the checkout's ``csrc/``, the reason says
so in one line, with the fix.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

_PACKAGE_DIR = Path(__file__).resolve().parent
_MANIFEST_PATH = _PACKAGE_DIR / "_build_manifest.json"
#: This dash is the source checkout's (not an installed copy) when the repository is around it.
_CHECKOUT_ROOT = _PACKAGE_DIR.parent if (_PACKAGE_DIR.parent / "setup.py").exists() and (
    _PACKAGE_DIR.parent / "csrc").is_dir() else None
_REBUILD = "pip install --no-build-isolation . (README, 'Install')"


class KernelsNotBuiltError(RuntimeError):
    """Raised when a DASH kernel is called in an install that has no compiled kernels."""


def _installed_elsewhere() -> str | None:
    """Where an installed dash-attention lives, when it is not this folder."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        dist = distribution("dash-attention")
    except (ImportError, PackageNotFoundError):
        return None
    try:
        where = Path(dist.locate_file("dash")).resolve()
    except Exception:
        return None
    return str(where) if where != _PACKAGE_DIR else None


def _missing_manifest_reason() -> str:
    if _CHECKOUT_ROOT is None:
        return f"no build manifest: this dash was not installed through setup.py ({_REBUILD})"
    elsewhere = _installed_elsewhere()
    if elsewhere:
        return (f"you are running the source checkout's dash/ ({_PACKAGE_DIR}), which holds no kernels, instead of "
                f"the installed one ({elsewhere}); build them here with {_REBUILD}, or run from another folder")
    return f"the source checkout's dash/ holds no kernels yet; build them with {_REBUILD}"


def _read_manifest() -> dict[str, Any]:
    try:
        info = json.loads(_MANIFEST_PATH.read_text())
    except FileNotFoundError:
        return {"kernels_built": False, "reason_not_built": _missing_manifest_reason(), "head_dims": [],
                "dtypes": [], "schedules": []}
    if info.get("kernels_built") and _CHECKOUT_ROOT is not None:
        from dash._sources import sources_digest

        built_from, now = info.get("sources_digest"), sources_digest(_CHECKOUT_ROOT)
        if built_from is not None and now is not None and built_from != now:
            info = dict(info, kernels_built=False, stale=True,
                        reason_not_built=(f"the kernels in {_PACKAGE_DIR} were built from other sources than this "
                                          f"checkout's csrc/ (built at {info.get('git_commit')}); rebuild: {_REBUILD}"))
    return info


# Read once at import: callers (also code traced by torch.compile) only look it up.
_MANIFEST: dict[str, Any] = _read_manifest()


def manifest() -> dict[str, Any]:
    """What setup.py compiled: head dims, dtypes, schedules, arch, CUDA/torch versions, git commit."""
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
        torch_built = info.get("torch")
        try:
            import torch as _torch

            if torch_built and _torch.__version__ != torch_built:
                return False, (f"the kernels were built against torch {torch_built}, this is torch "
                               f"{_torch.__version__}; rebuild: {_REBUILD}")
        except ImportError:
            pass
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
        raise KernelsNotBuiltError(f"DASH's CUDA kernels are not available in this install: {reason}.")
