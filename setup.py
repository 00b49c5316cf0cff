"""Build DASH: the pure-Python package always, the sm_90a CUDA extension when it can.

    pip install --no-build-isolation .      # torch (with CUDA) and nvidia-cutlass installed first

Environment:
    DASH_HDIMS=64,128          head dims to compile (default: all in dash/config.py)
    DASH_DTYPES=bf16,fp16      element types to compile (default: both)
    DASH_CUTLASS_DIR=/path     a CUTLASS checkout (its include/ is used) instead of nvidia-cutlass
    DASH_SKIP_CUDA_BUILD=1     install the pure-Python parts only
    MAX_JOBS=N                 parallel compile jobs (default: from cores and free memory)
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from dash import config as dash_config  # noqa: E402  (pure Python, no torch)

MANIFEST = ROOT / "dash" / "_build_manifest.json"
GENERATED_HEADER = ROOT / "csrc" / "generated" / "bwd_config.h"
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


def _pip_cuda_includes(cuda_home: str) -> list[str]:
    """torch's CUDA headers include cuSPARSE/cuBLAS headers. A minimal toolkit (nvcc and the
    runtime only) lacks them; the nvidia-* wheels torch depends on ship them."""
    if (Path(cuda_home) / "include" / "cusparse.h").exists():
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


def _why_no_kernels() -> str | None:
    """Return None when the extension can be built, else the reason it cannot."""
    if os.environ.get("DASH_SKIP_CUDA_BUILD", "0") not in ("", "0"):
        return "DASH_SKIP_CUDA_BUILD is set"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return "torch is not importable in the build environment (install torch first and use pip install --no-build-isolation .)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} has no CUDA support"
    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "no CUDA toolkit found (set CUDA_HOME to the folder holding bin/nvcc)"
    try:
        _cutlass_include()
    except RuntimeError as e:
        return str(e)
    return None


def _write_manifest(kernels_built: bool, reason: str | None, hdims: list[int], dtypes: list[str], cutlass: str) -> None:
    info = {
        "kernels_built": kernels_built,
        "reason_not_built": reason,
        "head_dims": hdims if kernels_built else [],
        "dtypes": [DTYPE_NAMES[d] for d in dtypes] if kernels_built else [],
        "arch": "sm_90a" if kernels_built else None,
        "git_commit": _git_commit(),
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
    if kernels_built:
        from torch.utils.cpp_extension import CUDA_HOME

        nvcc = subprocess.run([str(Path(CUDA_HOME) / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
        info["nvcc"] = nvcc.stdout.strip().splitlines()[-1] if nvcc.returncode == 0 else "unknown"
    MANIFEST.write_text(json.dumps(info, indent=2) + "\n")


def _extension_kwargs() -> dict:
    reason = _why_no_kernels()
    all_hdims = [str(d) for d in dash_config.SUPPORTED_HEAD_DIMS]
    hdims = [int(d) for d in _selected("DASH_HDIMS", all_hdims)]
    dtypes = _selected("DASH_DTYPES", list(DTYPE_NAMES))
    if reason is not None:
        print(f"DASH: CUDA kernels NOT built ({reason}); installing the pure-Python parts only.", flush=True)
        _write_manifest(False, reason, [], [], cutlass="")
        return {}

    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    # Only Hopper's sm_90a: WGMMA and setmaxnreg do not exist elsewhere.
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    os.environ["MAX_JOBS"] = str(_max_jobs())
    cutlass_inc = _cutlass_include()
    dash_config.write_if_changed(str(GENERATED_HEADER), dash_config.render_cpp_header())

    sources = ["csrc/torch_binding.cpp", "csrc/bwd_dispatch.cpp"]
    sources += [f"csrc/instantiations/bwd_hdim{d}_{t}.cu" for d in hdims for t in dtypes]
    defines = [f"-DDASH_BUILD_HDIM{d}" for d in hdims] + [f"-DDASH_BUILD_{t.upper()}" for t in dtypes]
    nvcc_flags = [
        "-O3",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-DNDEBUG",
        "-lineinfo",  # source lines in ncu / compute-sanitizer reports, no runtime cost
        *defines,
    ]
    print(f"DASH: building kernels for head dims {hdims}, dtypes {dtypes}, sm_90a, "
          f"MAX_JOBS={os.environ['MAX_JOBS']}, CUTLASS {cutlass_inc}", flush=True)
    _write_manifest(True, None, hdims, dtypes, cutlass=str(cutlass_inc))
    ext = CUDAExtension(
        name="dash._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc"), str(cutlass_inc), *_pip_cuda_includes(CUDA_HOME)],
        extra_compile_args={"cxx": ["-O3", "-std=c++17", *defines], "nvcc": nvcc_flags},
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)}}


setup(
    name="dash-attention",
    version="0.1.0",
    description="Deterministic FlashAttention-3-compatible attention backward for Hopper (DASH schedules)",
    packages=find_packages(include=["dash", "dash.*"]),
    package_data={"dash": ["_build_manifest.json"]},
    python_requires=">=3.10",
    install_requires=["numpy"],
    extras_require={"plot": ["matplotlib"], "test": ["pytest", "hypothesis", "matplotlib"]},
    **_extension_kwargs(),
)
