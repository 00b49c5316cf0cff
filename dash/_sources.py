"""A digest of the sources the kernels are compiled from (csrc/ and the config table).

setup.py records it in the build manifest; ``dash._ext`` compares it with the checkout when
DASH runs from its source folder, so that kernels built from other sources are refused with
a one-line explanation instead of being run against Python code they do not match.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: What the compiled extension depends on, relative to the repository root.
KERNEL_SOURCE_GLOBS = ("csrc/**/*.h", "csrc/**/*.hpp", "csrc/**/*.cu", "csrc/**/*.cpp", "dash/config.py")


def sources_digest(root: Path) -> str | None:
    """sha256 over the kernel sources under ``root`` (None when there are none: an installed
    package, not a checkout). Generated files are excluded: they follow from the config table."""
    files = sorted({p for g in KERNEL_SOURCE_GLOBS for p in root.glob(g)
                    if p.is_file() and "generated" not in p.parts})
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]
