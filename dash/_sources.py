"""A digest of the sources the kernels are compiled from (csrc/ and the config table).

setup.py records it in the build manifest; ``dash._ext`` compares it with the checkout when
DASH runs from its source folder, so that kernels built from other sources are refused with
a one-line explanation instead of being run against Python code they do not match.
"""

from __future__ import annotations

import hashlib
import shutil
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


#: File in the build folder naming the sources digest of the build that left its objects there.
BUILD_STAMP_NAME = "dash_sources_digest"


def prepare_build_folder(build_temp: Path, digest: str | None) -> Path:
    """Keep the objects in ``build_temp`` only if the build that left them compiled the same
    sources (its stamp equals ``digest``); otherwise remove them, so every translation unit is
    compiled afresh. Returns the stamp's path, removed until the new build succeeds and writes it.

    Ninja alone decides from the header dependencies it recorded per object, and those records
    can be empty (a build interrupted, two builds sharing one folder): a kernel object older than
    its headers was once linked into a build whose manifest named the newer sources
    (docs/kernel-notes.md, eighteenth pass)."""
    build_temp = Path(build_temp)
    stamp = build_temp / BUILD_STAMP_NAME
    same_sources = digest is not None and stamp.is_file() and stamp.read_text().strip() == digest
    if not same_sources:
        shutil.rmtree(build_temp, ignore_errors=True)
    build_temp.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    return stamp
