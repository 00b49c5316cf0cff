"""setup.py's build helpers (dash._build), on fake toolkits in tmp folders: the real toolkit
is found behind a wrapper `nvcc`, a broken CUDA_HOME is named, and a failed build reports
the compiler's first error, not ninja's summary. CPU-only, no compiler needed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dash._build import first_compiler_error, resolve_cuda_home, toolkit_headers


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _toolkit(root: Path, headers: bool = True) -> Path:
    """A fake toolkit: bin/nvcc that answers a dry run like nvcc does, and the runtime header."""
    _script(root / "bin" / "nvcc", f'echo "#$ _HERE_={root}/bin"; echo "#$ _THERE_={root}/bin"')
    if headers:
        (root / "targets" / "x86_64-linux" / "include").mkdir(parents=True)
        (root / "targets" / "x86_64-linux" / "include" / "cuda_runtime.h").write_text("")
    return root


def test_a_toolkit_root_is_taken_as_is(tmp_path):
    real = _toolkit(tmp_path / "cuda-13.0")
    root, why = resolve_cuda_home({"CUDA_HOME": str(real), "PATH": ""}, default=tmp_path / "none")
    assert root == real.resolve() and why == ""
    assert toolkit_headers(real) == real / "targets" / "x86_64-linux" / "include"


def test_the_real_toolkit_behind_a_wrapper_nvcc_on_path(tmp_path):
    """/usr/local/bin/nvcc = `exec /usr/local/cuda-13.0/bin/nvcc "$@"`: torch would guess
    /usr/local (no headers there); the build must use the folder nvcc reports."""
    real = _toolkit(tmp_path / "cuda-13.0")
    _script(tmp_path / "usr-local" / "bin" / "nvcc", f'exec {real}/bin/nvcc "$@"')
    root, why = resolve_cuda_home({"PATH": str(tmp_path / "usr-local" / "bin")}, default=tmp_path / "none")
    assert root == real.resolve(), why


def test_a_cuda_home_without_nvcc_is_named(tmp_path):
    root, why = resolve_cuda_home({"CUDA_HOME": str(tmp_path), "PATH": ""}, default=tmp_path / "none")
    assert root is None and f"CUDA_HOME={tmp_path}" in why and "bin/nvcc" in why


def test_an_nvcc_without_headers_says_what_is_missing(tmp_path):
    _toolkit(tmp_path / "bare", headers=False)
    root, why = resolve_cuda_home({"PATH": str(tmp_path / "bare" / "bin")}, default=tmp_path / "none")
    assert root is None and "cuda_runtime.h" in why and str(tmp_path / "bare") in why


def test_no_toolkit_at_all(tmp_path):
    root, why = resolve_cuda_home({"PATH": str(tmp_path)}, default=tmp_path / "none")
    assert root is None and "no CUDA toolkit found" in why and "CUDA_HOME" in why


@pytest.mark.skipif(not os.path.exists("/usr/local/bin/nvcc"), reason="no /usr/local/bin/nvcc on this machine")
def test_this_machines_nvcc_resolves_to_a_full_toolkit():
    root, why = resolve_cuda_home({"PATH": "/usr/local/bin"}, default=Path("/nonexistent"))
    assert root is not None and toolkit_headers(root) is not None, why


NINJA_LOG = """\
[1/6] c++ -MMD -MF build/temp/csrc/torch_binding.o.d ... -std=c++17 -c csrc/torch_binding.cpp
FAILED: build/temp/csrc/torch_binding.o
c++ -MMD ... -c csrc/torch_binding.cpp -o build/temp/csrc/torch_binding.o
In file included from /venv/lib/python3.11/site-packages/torch/include/ATen/ATen.h:4,
/venv/lib/python3.11/site-packages/torch/include/c10/util/C++17.h:13:2: error: #error "C++20 or later compatible compiler is required to use PyTorch."
   13 | #error "C++20 or later compatible compiler is required to use PyTorch."
ninja: build stopped: subcommand failed.
Traceback (most recent call last):
RuntimeError: Error compiling objects for extension
"""


def test_the_first_compiler_error_is_the_cause():
    assert first_compiler_error(NINJA_LOG).endswith('error: #error "C++20 or later compatible compiler is required '
                                                   'to use PyTorch."')
    assert "no compiler error" in first_compiler_error("all fine\n")
