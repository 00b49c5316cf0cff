"""Build DASH: the pure-Python package always, the sm_90a CUDA extension when it can.

    pip install --no-build-isolation .      # torch (with CUDA) and nvidia-cutlass installed first

Environment:
    DASH_HDIMS=64,128          head dims to compile (default: all in dash/config.py)
    DASH_DTYPES=bf16,fp16      element types to compile (default: both)
    DASH_CUTLASS_DIR=/path     a CUTLASS checkout (its include/ is used) instead of nvidia-cutlass
    DASH_SKIP_CUDA_BUILD=1     install the pure-Python parts only, even where the kernels could be built
    CUDA_HOME=/path            the CUDA toolkit root (the folder holding bin/nvcc and include/);
                               default: found from nvcc on PATH, also behind a wrapper script
    MAX_JOBS=N                 parallel compile jobs (default: from cores and free memory)

What gets built, and why not:
  * no torch with CUDA, or no CUDA toolkit       -> pure-Python install, one line saying why;
  * CUDA torch + toolkit, but the compile fails  -> the install FAILS, the compiler's first
                                                    error on top (never a silent fallback);
  * built                                         -> dash/_C and dash/_build_manifest.json, in
                                                    the installed package and beside the sources
                                                    (so `python -m dash` run from this folder
                                                    uses the same kernels).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from dash import config as dash_config  # noqa: E402  (pure Python, no torch)
from dash._build import first_compiler_error, resolve_cuda_home, toolkit_headers  # noqa: E402
from dash._sources import prepare_build_folder, sources_digest  # noqa: E402  (pure Python)

MANIFEST_NAME = "_build_manifest.json"
GENERATED_DIR = ROOT / "csrc" / "generated"
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
# nvcc peaks at about 2 GB per CuTe translation unit.
GB_PER_COMPILE_JOB = 2.5


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def _selected(env: str, allowed: list[str]) -> list[str]:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return allowed
    chosen = [x.strip() for x in raw.split(",") if x.strip()]
    bad = [x for x in chosen if x not in allowed]
    if bad:
        raise SystemExit(f"{env}={raw!r}: unsupported {bad}; choose from {allowed}")
    return chosen


def _cutlass_include() -> Path:
    override = os.environ.get("DASH_CUTLASS_DIR")
    if override:
        inc = Path(override) / "include"
        if not (inc / "cute" / "tensor.hpp").exists():
            raise SystemExit(f"DASH_CUTLASS_DIR={override}: no include/cute/tensor.hpp there")
        return inc
    try:
        import cutlass_library
    except ImportError as e:
        raise RuntimeError("nvidia-cutlass is not installed (pip install nvidia-cutlass==4.2.0.0)") from e
    inc = Path(cutlass_library.source_path) / "include"
    if not (inc / "cute" / "tensor.hpp").exists():
        raise RuntimeError(f"nvidia-cutlass has no CuTe headers under {inc}")
    return inc


def _pip_cuda_includes(cuda_home: Path) -> list[str]:
    """torch's CUDA headers include cuSPARSE/cuBLAS headers. A minimal toolkit (nvcc and the
    runtime only) lacks them; the nvidia-* wheels torch depends on ship them. They may belong
    to a newer CUDA than the toolkit (torch 2.15's nvidia/cu13 holds CUDA 13.2's whole header
    set), so they are searched after the toolkit's own headers (see include_dirs below)."""
    inc = toolkit_headers(cuda_home)
    if inc is not None and (inc / "cusparse.h").exists():
        return []
    try:
        import nvidia
    except ImportError:
        return []
    found = []
    for base in getattr(nvidia, "__path__", []):
        for inc in sorted(Path(base).glob("**/include")):
            if any(inc.glob("*.h")):
                found.append(str(inc))
    return found


def _max_jobs() -> int:
    if os.environ.get("MAX_JOBS"):
        return int(os.environ["MAX_JOBS"])
    cores = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        avail_gb = info.get("MemAvailable", info["MemTotal"]) / 2**20
    except Exception:
        avail_gb = 8.0
    return max(1, min(cores, int(avail_gb // GB_PER_COMPILE_JOB)))


def _why_no_kernels() -> tuple[str | None, Path | None]:
    """(None, toolkit root) when the extension can be built, else (the reason, None)."""
    if os.environ.get("DASH_SKIP_CUDA_BUILD", "0") not in ("", "0"):
        return "DASH_SKIP_CUDA_BUILD is set", None
    try:
        import torch
    except ImportError:
        return ("torch is not importable in the build environment (install torch first and use "
                "pip install --no-build-isolation .)"), None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} has no CUDA support", None
    root, why = resolve_cuda_home()
    if root is None:
        return why, None
    try:
        _cutlass_include()
    except RuntimeError as e:
        return str(e), None
    return None, root


# ---------------------------------------------------------------------------------------------
# The build manifest: what was compiled (dash._ext reads it; python -m dash info shows it)
# ---------------------------------------------------------------------------------------------
def _manifest(kernels_built: bool, reason: str | None, hdims: list[int], dtypes: list[str], cutlass: str,
              cuda_home: Path | None) -> dict:
    info = {
        "kernels_built": kernels_built,
        "reason_not_built": reason,
        "head_dims": hdims if kernels_built else [],
        "dtypes": [DTYPE_NAMES[d] for d in dtypes] if kernels_built else [],
        "schedules": list(dash_config.KERNEL_SCHEDULES) if kernels_built else [],
        "arch": "sm_90a" if kernels_built else None,
        "git_commit": _git_commit(),
        "sources_digest": sources_digest(ROOT),
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "cutlass": cutlass,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
    except ImportError:
        info["torch"] = None
        info["torch_cuda"] = None
    if kernels_built and cuda_home is not None:
        nvcc = subprocess.run([str(cuda_home / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
        info["nvcc"] = nvcc.stdout.strip().splitlines()[-1] if nvcc.returncode == 0 else "unknown"
        info["cuda_home"] = str(cuda_home)
    return info


def _write_manifest(info: dict, *folders: Path) -> None:
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST_NAME).write_text(json.dumps(info, indent=2) + "\n")


def _clear_source_tree_artifacts() -> None:
    """Remove a previous build's kernels and manifest from the source folder, so that nothing
    there claims kernels this build did not make (a failed build leaves none)."""
    for path in [ROOT / "dash" / MANIFEST_NAME, *(ROOT / "dash").glob("_C.*.so"), *(ROOT / "dash").glob("_C.so")]:
        try:
            path.unlink()
        except (FileNotFoundError, PermissionError):
            pass


class _BuildPy(build_py):
    """Writes the manifest of a pure-Python install (the kernels' build_ext writes its own)."""

    def run(self) -> None:
        super().run()
        if not self.distribution.ext_modules:
            info = _manifest(False, PURE_PYTHON_REASON, [], [], "", None)
            _write_manifest(info, Path(self.build_lib) / "dash", ROOT / "dash")


PURE_PYTHON_REASON: str | None = None


def _extension_kwargs() -> dict:
    global PURE_PYTHON_REASON
    reason, cuda_home = _why_no_kernels()
    all_hdims = [str(d) for d in dash_config.SUPPORTED_HEAD_DIMS]
    hdims = [int(d) for d in _selected("DASH_HDIMS", all_hdims)]
    dtypes = _selected("DASH_DTYPES", list(DTYPE_NAMES))
    _clear_source_tree_artifacts()
    if reason is not None:
        PURE_PYTHON_REASON = reason
        print(f"DASH: CUDA kernels NOT built ({reason}); installing the pure-Python parts only.", flush=True)
        return {"cmdclass": {"build_py": _BuildPy}}

    import torch.utils.cpp_extension as cpp_ext
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    # torch guessed its CUDA_HOME at import (the folder above `nvcc` on PATH, which may be a
    # wrapper's); build with the real toolkit root found above.
    os.environ["CUDA_HOME"] = str(cuda_home)
    cpp_ext.CUDA_HOME = str(cuda_home)
    # Only Hopper's sm_90a: WGMMA and setmaxnreg do not exist elsewhere.
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    os.environ["MAX_JOBS"] = str(_max_jobs())
    cutlass_inc = _cutlass_include()
    # The tile table, the list of compiled (head dim, dtype) units and the units themselves,
    # all rendered from dash/config.py for this build's choice.
    units = dash_config.write_generated(str(GENERATED_DIR), hdims, [DTYPE_NAMES[t] for t in dtypes])

    sources = ["csrc/torch_binding.cpp", "csrc/autograd.cpp", "csrc/bwd_dispatch.cpp", "csrc/fwd_dispatch.cpp"]
    sources += [str(Path(u).relative_to(ROOT)) for u in units]
    # No -std flag: torch's BuildExtension adds the C++ standard its own headers need
    # (C++17 up to torch 2.13, C++20 from 2.14), for the host compiler and nvcc alike.
    nvcc_flags = [
        "-O3",
        "--expt-relaxed-constexpr",
        "-DNDEBUG",
        "-lineinfo",  # source lines in ncu / compute-sanitizer reports, no runtime cost
    ]
    print(f"DASH: building kernels for head dims {hdims}, dtypes {dtypes}, sm_90a, torch {torch_version()}, "
          f"CUDA toolkit {cuda_home}, MAX_JOBS={os.environ['MAX_JOBS']}, CUTLASS {cutlass_inc}", flush=True)
    manifest = _manifest(True, None, hdims, dtypes, str(cutlass_inc), cuda_home)

    class _BuildExt(BuildExtension):
        """Builds the kernels; on failure, the install fails with the compiler's first error
        on top (and again at the end) instead of a wall of ninja output; on success writes
        the manifest and places the kernels beside the sources too."""

        def build_extensions(self) -> None:
            # Objects are reused only by a build of the same sources (dash/_sources.py says why).
            digest = manifest["sources_digest"]
            stamp = prepare_build_folder(Path(self.build_temp), digest)
            log = tempfile.TemporaryFile()
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            failure = None
            try:
                super().build_extensions()
            except Exception as e:  # the compiler's own messages are in the log
                failure = e
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
            log.seek(0)
            text = log.read().decode(errors="replace")
            if failure is not None:
                first = first_compiler_error(text)
                sys.stderr.write(f"DASH: building the CUDA kernels failed. First compiler error:\n    {first}\n"
                                 f"(torch {torch_version()}, CUDA toolkit {cuda_home}; the full log follows)\n\n")
                sys.stderr.write(text)
                sys.stderr.write(f"\nDASH: building the CUDA kernels failed: {first}\n"
                                 "Fix the cause, or install without kernels: DASH_SKIP_CUDA_BUILD=1 pip install "
                                 "--no-build-isolation .\n")
                sys.stderr.flush()
                raise SystemExit(f"DASH kernel build failed: {first}")
            sys.stdout.write(text)
            if digest is not None:
                stamp.write_text(digest + "\n")
            built = Path(self.get_ext_fullpath("dash._C"))
            targets = [built.parent]
            source_pkg = ROOT / "dash"
            if built.parent.resolve() != source_pkg.resolve():
                try:
                    shutil.copy2(built, source_pkg / built.name)
                    targets.append(source_pkg)
                except OSError as e:
                    print(f"DASH: could not place the kernels beside the sources ({e})")
            _write_manifest(manifest, *targets)

    ext = CUDAExtension(
        name="dash._C",
        sources=sources,
        # The toolkit's headers before the pip wheels' (torch adds them again afterwards):
        # nvcc refuses CUDA headers of another release than its own.
        include_dirs=[str(ROOT / "csrc"), str(cutlass_inc), str(toolkit_headers(cuda_home)),
                      *_pip_cuda_includes(cuda_home)],
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags},
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": _BuildExt.with_options(use_ninja=True),
                                                "build_py": _BuildPy}}


def torch_version() -> str:
    import torch

    return torch.__version__


setup(
    name="dash-attention",
    version="0.1.0",
    description="Deterministic FlashAttention-3-compatible attention backward for Hopper (DASH schedules)",
    packages=find_packages(include=["dash", "dash.*"]),
    package_data={"dash": [MANIFEST_NAME]},
    python_requires=">=3.10",
    install_requires=["numpy"],
    extras_require={"plot": ["matplotlib>=3.7"], "test": ["pytest", "hypothesis", "matplotlib>=3.7"],
                    "transformers": ["transformers"]},
    **_extension_kwargs(),
)
