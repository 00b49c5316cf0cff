"""Load DASH under FlashAttention-3's module names, on request.

Code written for FA3 imports it by one of two names:

* ``flash_attn_interface`` -- the module FA3's ``hopper/`` build installs at top level
  (TransformerEngine's FA3 backend imports ``_flash_attn_forward`` / ``_flash_attn_backward``
  and ``flash_attn_func`` from it);
* ``flash_attn_3.flash_attn_interface`` -- the same module inside the ``flash_attn_3``
  package.

``install_as_flash_attn_3()`` makes both names (and the ``flash_attn_3`` package) resolve to
``dash.flash_attn_interface`` in this process, by entries in ``sys.modules``:

    import dash
    dash.install_as_flash_attn_3()
    from flash_attn_3.flash_attn_interface import _flash_attn_forward   # DASH's

Rules:

* Opt-in only. ``import dash`` never installs the alias; nothing does but this call.
* Never over a real FA3. If ``flash_attn_3`` or ``flash_attn_interface`` can be imported
  from somewhere else (``importlib.util.find_spec`` finds it, or it is already imported),
  the call raises ``RealFlashAttn3Error`` naming where, and changes nothing.
  ``force=True`` installs the alias anyway: an escape hatch for deliberately running DASH
  in place of an installed FA3 in this process. Modules that already hold FA3's functions
  (``from flash_attn_interface import ...`` done earlier) keep them.
  ``uninstall_as_flash_attn_3()`` removes the alias and puts back what it replaced.
* Idempotent: installing twice is harmless.

What the alias does not do: it does not make DASH look like the ``flash-attn-3``
distribution to ``importlib.metadata``. Frameworks that decide whether FA3 is present by
its package metadata -- TransformerEngine reads the version of ``flash-attn-3`` before it
imports ``flash_attn_interface`` -- still see no FA3. Faking another package's metadata
would also fake its version, which such frameworks use to pick code paths written for FA3
itself, so DASH does not.

No environment-variable opt-in: a variable read at ``import dash`` would change what
unrelated ``import flash_attn_interface`` statements load, in every process that inherits
the environment (launchers, workers, subprocesses), invisibly to whoever reads the code, and
it would work or not depending on whether something imported dash before the framework
imported FA3. One explicit call at the top of the program has none of these problems.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Optional

__all__ = [
    "RealFlashAttn3Error",
    "find_real_flash_attn_3",
    "install_as_flash_attn_3",
    "is_dash_alias",
    "uninstall_as_flash_attn_3",
]

#: The top-level names a real FA3 installs, checked before installing the alias.
FA3_TOP_LEVEL_NAMES: tuple[str, ...] = ("flash_attn_3", "flash_attn_interface")
#: Every ``sys.modules`` entry the alias sets.
ALIAS_NAMES: tuple[str, ...] = ("flash_attn_3", "flash_attn_3.flash_attn_interface", "flash_attn_interface")

#: Modules the alias replaced (only with force=True), restored by uninstall_as_flash_attn_3.
_replaced: dict[str, types.ModuleType] = {}


class RealFlashAttn3Error(RuntimeError):
    """A real FlashAttention-3 is installed; DASH will not shadow it without force=True."""


def is_dash_alias(module: object) -> bool:
    """Whether ``module`` is one of the alias' modules (DASH's, not FA3's)."""
    return getattr(module, "__name__", None) == "dash.flash_attn_interface" or bool(
        getattr(module, "__dash_alias__", False))


def _location(module_or_spec) -> str:
    origin = getattr(module_or_spec, "origin", None) or getattr(module_or_spec, "__file__", None)
    if origin and origin != "namespace":
        return str(origin)
    locations = getattr(module_or_spec, "submodule_search_locations", None) or getattr(module_or_spec, "__path__", None)
    return ", ".join(map(str, locations)) if locations else repr(module_or_spec)


def find_real_flash_attn_3() -> Optional[str]:
    """Where a real FA3 is (``"flash_attn_interface at /path/..."``), or None: a module of
    FA3's top-level names that is already imported and is not the alias, or that
    ``importlib.util.find_spec`` finds on sys.path. Imports nothing."""
    for name in FA3_TOP_LEVEL_NAMES:
        if name in sys.modules:
            module = sys.modules[name]
            if module is None or is_dash_alias(module):  # None: imports of it are blocked
                continue
            return f"{name} at {_location(module)}"
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            return f"{name} at {_location(spec)}"
    return None


def _alias_package(interface: types.ModuleType) -> types.ModuleType:
    """A stand-in for the ``flash_attn_3`` package holding DASH's flash_attn_interface."""
    package = types.ModuleType("flash_attn_3", "DASH installed under FlashAttention-3's package name "
                                               "(dash.install_as_flash_attn_3); see dash.fa3_alias.")
    package.__path__ = []  # a package, so "flash_attn_3.flash_attn_interface" imports through sys.modules
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn_3", None, is_package=True)
    package.__dash_alias__ = True
    package.flash_attn_interface = interface
    return package


def install_as_flash_attn_3(*, force: bool = False) -> None:
    """Make ``flash_attn_interface``, ``flash_attn_3`` and ``flash_attn_3.flash_attn_interface``
    import DASH (``dash.flash_attn_interface``) in this process.

    Raises RealFlashAttn3Error, changing nothing, when a real FA3 is importable or imported;
    ``force=True`` installs over it (see the module docstring for what that means). Calling
    it again is harmless."""
    if not isinstance(force, bool):
        raise TypeError(f"force must be a bool, got {force!r}")
    real = find_real_flash_attn_3()
    if real is not None and not force:
        raise RealFlashAttn3Error(
            f"a real FlashAttention-3 is installed ({real}); DASH will not shadow it. Import FA3 or DASH "
            "(dash.flash_attn_interface) by their own names, or call install_as_flash_attn_3(force=True) to make "
            "this process import DASH under FA3's names anyway."
        )
    from dash import flash_attn_interface as interface  # imports torch

    package = sys.modules.get("flash_attn_3")
    if not is_dash_alias(package):
        package = _alias_package(interface)
    for name, module in (("flash_attn_3", package), ("flash_attn_3.flash_attn_interface", interface),
                         ("flash_attn_interface", interface)):
        current = sys.modules.get(name)
        if current is not None and not is_dash_alias(current):
            _replaced[name] = current
        sys.modules[name] = module


def uninstall_as_flash_attn_3() -> None:
    """Remove the alias' ``sys.modules`` entries, restoring any module force=True replaced.
    Entries that are not the alias' are left alone."""
    for name in ALIAS_NAMES:
        if is_dash_alias(sys.modules.get(name)):
            if name in _replaced:
                sys.modules[name] = _replaced.pop(name)
            else:
                del sys.modules[name]
