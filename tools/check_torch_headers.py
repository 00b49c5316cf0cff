"""Compile DASH's torch-facing C++ (csrc/torch_binding.cpp, csrc/bwd_dispatch.cpp) against the
headers of another torch release, without installing it: the oldest torch requirements.txt
allows, by default. CI runs this so that both ends of the supported torch range are
compiled (the newest is compiled by the install itself).

    python tools/check_torch_headers.py                 # the lower bound in requirements.txt
    python tools/check_torch_headers.py --torch 2.11.0

Downloads that torch's wheel for this Python (no dependencies), extracts its include/ folder
and its cpp_extension.py (which names the C++ standard its headers need), and runs the host
compiler with -fsyntax-only. Needs a CUDA toolkit's headers (found as setup.py finds them)
and the nvidia-* wheels of the installed torch for the cuSPARSE/cuBLAS headers a minimal
toolkit lacks. No GPU.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dash import config as dash_config  # noqa: E402
from dash._build import resolve_cuda_home, toolkit_headers  # noqa: E402

SOURCES = ("csrc/torch_binding.cpp", "csrc/autograd.cpp", "csrc/bwd_dispatch.cpp", "csrc/fwd_dispatch.cpp")


def lower_bound() -> str:
    text = (ROOT / "requirements.txt").read_text()
    m = re.search(r"^torch\s*>=\s*([0-9.]+)", text, re.M)
    if not m:
        raise SystemExit("requirements.txt has no 'torch>=X' line")
    return m.group(1)


def cxx_standard(cpp_extension_py: str) -> str:
    """The standard torch's BuildExtension adds when an extension names none."""
    m = re.search(r"cpp_flag_prefix \+ '(c\+\+\d+)'", cpp_extension_py)
    return m.group(1) if m else "c++17"


def pip_cuda_includes() -> list[str]:
    try:
        import nvidia
    except ImportError:
        return []
    return [str(p) for base in getattr(nvidia, "__path__", []) for p in sorted(Path(base).glob("*/include"))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--torch", default=None, help="torch version (default: requirements.txt's lower bound)")
    args = p.parse_args(argv)
    version = args.torch or lower_bound()
    if re.fullmatch(r"\d+\.\d+", version):
        version += ".0"
    cuda_home, why = resolve_cuda_home()
    if cuda_home is None:
        raise SystemExit(f"check_torch_headers: {why}")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("check_torch_headers: no host C++ compiler")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        py = f"{sys.version_info.major}{sys.version_info.minor}"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", py, f"torch=={version}", "-d", str(tmp)], check=True)
        wheel = next(tmp.glob("torch-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.startswith("torch/include/") or n == "torch/utils/cpp_extension.py"]
            z.extractall(tmp, members=names)
        std = cxx_standard((tmp / "torch/utils/cpp_extension.py").read_text())
        dash_config.write_generated(str(ROOT / "csrc/generated"))
        import sysconfig

        includes = [ROOT / "csrc", tmp / "torch/include", tmp / "torch/include/torch/csrc/api/include",
                    toolkit_headers(cuda_home), sysconfig.get_paths()["include"], *pip_cuda_includes()]
        failed = 0
        for src in SOURCES:
            cmd = [cxx, f"-std={std}", "-fsyntax-only", "-D_GLIBCXX_USE_CXX11_ABI=1",
                   *[f"-I{i}" for i in includes], str(ROOT / src)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            status = "ok" if proc.returncode == 0 else "FAILED"
            print(f"torch {version} ({wheel.name}), -std={std}: {src}: {status}")
            if proc.returncode != 0:
                failed += 1
                print(proc.stderr[-3000:])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
