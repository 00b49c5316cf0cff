"""Build-time helpers of setup.py that are worth testing on their own (pure Python, no torch):
finding the real CUDA toolkit, and the first compiler error of a failed build's log."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path


def toolkit_headers(root: Path) -> Path | None:
    """The folder holding cuda_runtime.h of a toolkit root, or None."""
    for inc in [root / "include", *sorted(root.glob("targets/*/include"))]:
        if (inc / "cuda_runtime.h").exists():
            return inc
    return None


def nvcc_home(nvcc: Path) -> Path | None:
    """The real toolkit root of an nvcc, also when `nvcc` is a wrapper script or a symlink:
    nvcc itself reports where it lives (its `_HERE_` in a dry run)."""
    try:
        proc = subprocess.run([str(nvcc), "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except Exception:
        return None
    m = re.search(r"^#\$ _HERE_=(.+)$", proc.stdout + proc.stderr, re.M)
    return Path(m.group(1).strip()).resolve().parent if m else None


def resolve_cuda_home(env: dict[str, str] | None = None, default: Path = Path("/usr/local/cuda")) -> tuple[Path | None, str]:
    """(toolkit root, "") when a usable toolkit is found, else (None, why not).

    Candidates, in order: CUDA_HOME (or CUDA_PATH), the folder above the `nvcc` on PATH, and
    ``default``. A candidate is usable when it has bin/nvcc and cuda_runtime.h; when it has
    an nvcc but no headers (a wrapper script in /usr/local/bin, say), the nvcc is asked for
    its real root. An explicit CUDA_HOME without bin/nvcc is an error, not skipped.
    """
    env = os.environ if env is None else env
    explicit = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    candidates: list[tuple[str, Path]] = []
    if explicit:
        candidates.append(("CUDA_HOME", Path(explicit)))
    nvcc_on_path = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc_on_path:
        candidates.append(("nvcc on PATH", Path(nvcc_on_path).parent.parent))
    candidates.append(("default", default))
    found = []
    for origin, root in candidates:
        nvcc = root / "bin" / "nvcc"
        if not nvcc.exists():
            if origin == "CUDA_HOME":
                return None, f"CUDA_HOME={explicit} has no bin/nvcc (set CUDA_HOME to the toolkit root)"
            continue
        if toolkit_headers(root) is not None:
            return root.resolve(), ""
        real = nvcc_home(nvcc)
        if real is not None and toolkit_headers(real) is not None:
            return real, ""
        found.append(f"{nvcc} ({origin}) belongs to {real or root}, which has no include/cuda_runtime.h")
    if found:
        return None, "no usable CUDA toolkit: " + "; ".join(found) + " (set CUDA_HOME to a full toolkit root)"
    return None, "no CUDA toolkit found: no nvcc on PATH and no CUDA_HOME (set CUDA_HOME to the toolkit root)"


_FIRST_ERROR_RE = re.compile(r"(?i)(\berror\b|#error|fatal)")
_NOT_THE_ERROR = ("ninja: build stopped", "Error compiling objects", "subprocess.CalledProcessError", "FAILED:")


def first_compiler_error(log: str) -> str:
    """The first line of a compiler log that reports an error (the cause, not ninja's summary)."""
    for line in log.splitlines():
        if _FIRST_ERROR_RE.search(line) and not any(s in line for s in _NOT_THE_ERROR):
            return line.strip()
    return "(no compiler error line found; see the log above)"
