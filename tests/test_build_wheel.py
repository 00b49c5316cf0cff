"""tools/build_wheel.py on the CPU: version rules, finding Python, staging, the wheel-content
check (on synthetic wheels), the local-version rename (pip accepts the result), the argument
errors, and the whole build path with DASH_SKIP_CUDA_BUILD=1, whose kernel-less wheel the check
must reject with a clear message while the checkout's own kernels stay untouched. The real
kernel build is `python tools/build_wheel.py --python 3.12 --torch 2.11.0` on a machine with a
CUDA toolkit (a few minutes; no GPU needed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "build_wheel.py"


def _load():
    spec = importlib.util.spec_from_file_location("build_wheel", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_wheel"] = mod
    spec.loader.exec_module(mod)
    return mod


bw = _load()

GOOD_MANIFEST = {"kernels_built": True, "reason_not_built": None, "head_dims": [64, 128],
                 "dtypes": ["bfloat16", "float16"], "arch": "sm_90a", "git_commit": "abc123", "python": "3.12.1",
                 "torch": "2.11.0+cu130", "torch_cuda": "13.0"}
SO = "dash/_C.cpython-312-x86_64-linux-gnu.so"


def make_wheel(folder: Path, files: dict, name: str = "dash_attention-0.1.0-cp312-cp312-linux_x86_64.whl") -> Path:
    """A minimal wheel: ``files`` (name -> bytes/str/dict) plus METADATA, WHEEL and RECORD."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    version = name.split("-")[1]
    info = f"dash_attention-{version}.dist-info"
    content = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: dash-attention\nVersion: {version}\n",
               f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                                "Tag: cp312-cp312-linux_x86_64\n"}
    records = []
    with zipfile.ZipFile(path, "w") as z:
        for fname, data in content.items():
            data = json.dumps(data).encode() if isinstance(data, dict) else data
            data = data.encode() if isinstance(data, str) else data
            zi = zipfile.ZipInfo(fname, date_time=(2026, 1, 1, 0, 0, 0))
            zi.external_attr = (0o755 if fname.endswith(".so") else 0o644) << 16
            z.writestr(zi, data)
            records.append(f"{fname},{bw._record_hash(data)},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join(records + [f"{info}/RECORD,,"]) + "\n")
    return path


def good_wheel(folder: Path, **manifest) -> Path:
    return make_wheel(folder, {"dash/__init__.py": "", SO: b"\x7fELF fake", bw.MANIFEST: {**GOOD_MANIFEST, **manifest}})


# ---------------------------------------------------------------------------------------
# Versions and requirements
# ---------------------------------------------------------------------------------------
def test_versions():
    assert bw.release("2.11.0+cu130") == (2, 11, 0) and bw.release("2.15.0rc1") == (2, 15, 0)
    assert bw.satisfies("2.11.0", ">=2.11,<2.16") and bw.satisfies("2.15.9", ">=2.11,<2.16")
    assert not bw.satisfies("2.16.0", ">=2.11,<2.16") and not bw.satisfies("2.10.2", ">=2.11,<2.16")
    assert bw.satisfies("4.2.0.0", "==4.2.0.0") and not bw.satisfies("4.2.1", "==4.2")
    assert bw.satisfies("1.0", "")
    with pytest.raises(ValueError, match="cannot read the version specifier '~=2.1'"):
        bw.satisfies("2.1", "~=2.1")
    assert bw.local_version("2.11.0+cu130", "13.0") == "torch2.11.cu130"
    assert bw.local_version("2.13.1", "12.6") == "torch2.13.cu126"


def test_read_requirements_of_the_checkout():
    reqs = bw.read_requirements()
    assert bw.satisfies("2.11.0", reqs["torch"])
    assert reqs["nvidia-cutlass"].startswith("==") and "ninja" in reqs and "wheel" in reqs


def test_check_toolkit():
    assert bw.check_toolkit("13.0", "13.0", Path("/cuda")) is None
    assert "same major version" in bw.check_toolkit("13.0", "13.2", Path("/cuda"))
    with pytest.raises(bw.BuildError, match=r"the CUDA toolkit at /cuda is 12\.4, but this torch is built for CUDA "
                                            r"13\.0: use a CUDA 13\.x toolkit"):
        bw.check_toolkit("13.0", "12.4", Path("/cuda"))


# ---------------------------------------------------------------------------------------
# Finding Python
# ---------------------------------------------------------------------------------------
def _fake_python(path: Path, version: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


def test_find_python_on_path_then_pyenv(tmp_path):
    pyenv = tmp_path / "pyenv"
    old = _fake_python(pyenv / "versions" / "3.12.1" / "bin" / "python3.12", "3.12")
    new = _fake_python(pyenv / "versions" / "3.12.10" / "bin" / "python3.12", "3.12")
    _fake_python(pyenv / "versions" / "3.11.7" / "bin" / "python3.11", "3.11")
    found = bw.python_candidates("3.12", path_env=str(tmp_path / "empty"), pyenv_root=pyenv)
    assert found[:2] == [new, old]  # newest patch release first
    on_path = _fake_python(tmp_path / "bin" / "python3.12", "3.12")
    assert bw.find_python("3.12", path_env=str(tmp_path / "bin"), pyenv_root=pyenv) == (on_path, "3.12")
    # A candidate that does not run (a pyenv shim of an inactive version) or is another
    # version is passed over.
    shim = tmp_path / "shims" / "python3.12"
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    assert bw.find_python("3.12", path_env=str(shim.parent), pyenv_root=pyenv) == (new, "3.12")
    assert bw.find_python(str(new)) == (new, "3.12")


def test_find_python_errors(tmp_path):
    with pytest.raises(bw.BuildError, match=r"--python 3\.99: no Python 3\.99 found \(looked for python3\.99 on PATH"):
        bw.find_python("3.99", path_env=str(tmp_path), pyenv_root=tmp_path)
    with pytest.raises(bw.BuildError, match="give a version such as 3.12"):
        bw.find_python("python3")
    with pytest.raises(bw.BuildError, match="no such executable"):
        bw.find_python(str(tmp_path / "nope" / "python"))
    wrong = _fake_python(tmp_path / "bin" / "python3.13", "3.12")  # lies about its name
    with pytest.raises(bw.BuildError, match=r"skipped .*python3\.13 is Python 3\.12"):
        bw.find_python("3.13", path_env=str(wrong.parent), pyenv_root=tmp_path)


# ---------------------------------------------------------------------------------------
# The wheel-content check
# ---------------------------------------------------------------------------------------
def test_check_accepts_a_wheel_with_kernels_and_manifest(tmp_path):
    info = bw.check_wheel(good_wheel(tmp_path), expect_python="3.12", expect_torch="2.11.0")
    assert info.so == SO and info.python_tag == "cp312" and info.platform == "linux_x86_64"
    fits = info.fits()
    assert "CPython 3.12 (cp312) on linux_x86_64; torch 2.11.x built for CUDA 13.0" in fits
    assert "sm_90a" in fits and "[64, 128]" in fits and "abc123" in fits


def test_check_rejects_a_wheel_without_kernels(tmp_path):
    manifest = {"kernels_built": False, "reason_not_built": "DASH_SKIP_CUDA_BUILD is set", "python": "3.12.1"}
    wheel = make_wheel(tmp_path, {"dash/__init__.py": "", bw.MANIFEST: manifest})
    why = r"Its manifest says the kernels were not built: DASH_SKIP_CUDA_BUILD is set"
    with pytest.raises(bw.WheelCheckError, match=r"has no dash/_C\*\.so: the wheel holds no CUDA kernels\. " + why):
        bw.check_wheel(wheel)


@pytest.mark.parametrize("change,message", [
    (dict(drop_manifest=True), r"has dash/_C\.cpython-312-x86_64-linux-gnu\.so but no dash/_build_manifest\.json"),
    (dict(kernels_built=False, reason_not_built="x"), "says kernels_built is false"),
    (dict(python="3.11.7"), "is tagged cp312 but its kernels were built by Python 3.11.7"),
    (dict(torch=None), "does not say which torch and CUDA"),
    (dict(expect_python="3.13"), r"was built for Python 3\.12\.1, not 3\.13"),
    (dict(expect_torch="2.13.0"), r"was built against torch 2\.11\.0\+cu130, not 2\.13\.0"),
])
def test_check_rejects(change, message, tmp_path):
    change = dict(change)
    expect = {k: change.pop(k) for k in ("expect_python", "expect_torch") if k in change}
    files = {"dash/__init__.py": "", SO: b"x", bw.MANIFEST: {**GOOD_MANIFEST, **change}}
    if change.pop("drop_manifest", False):
        del files[bw.MANIFEST]
    with pytest.raises(bw.WheelCheckError, match=message):
        bw.check_wheel(make_wheel(tmp_path, files), **expect)


def test_check_rejects_unreadable_files(tmp_path):
    bad = tmp_path / "dash_attention-0.1.0-cp312-cp312-linux_x86_64.whl"
    bad.write_text("not a zip")
    with pytest.raises(bw.WheelCheckError, match="cannot be read as a wheel"):
        bw.check_wheel(bad)
    with pytest.raises(bw.WheelCheckError, match="is not a wheel file name"):
        bw.check_wheel(tmp_path / "dash.zip")
    so_mismatch = make_wheel(tmp_path, {"dash/_C.cpython-311-x86_64-linux-gnu.so": b"x", bw.MANIFEST: GOOD_MANIFEST})
    with pytest.raises(bw.WheelCheckError, match="is for CPython 3.11 but the manifest says Python 3.12.1"):
        bw.check_wheel(so_mismatch)


# ---------------------------------------------------------------------------------------
# The local version
# ---------------------------------------------------------------------------------------
def test_local_version_rename(tmp_path):
    src = good_wheel(tmp_path / "raw")
    dst = bw.with_local_version(src, "torch2.11.cu130", tmp_path / "dist")
    assert dst.name == "dash_attention-0.1.0+torch2.11.cu130-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(dst) as z:
        names = z.namelist()
        info = "dash_attention-0.1.0+torch2.11.cu130.dist-info"
        assert f"{info}/METADATA" in names and not any(n.startswith("dash_attention-0.1.0.dist-info") for n in names)
        assert "Version: 0.1.0+torch2.11.cu130" in z.read(f"{info}/METADATA").decode()
        assert (z.getinfo(SO).external_attr >> 16) & 0o777 == 0o755
        for line in z.read(f"{info}/RECORD").decode().splitlines():
            fname, digest, size = line.split(",")
            if fname != f"{info}/RECORD":
                data = z.read(fname)
                assert digest == bw._record_hash(data) and int(size) == len(data)
        assert z.read(SO) == b"\x7fELF fake"
    assert bw.check_wheel(dst, expect_python="3.12").version == "0.1.0+torch2.11.cu130"
    with pytest.raises(bw.WheelCheckError, match="already has a local version"):
        bw.with_local_version(dst, "x", tmp_path / "again")


def test_pip_accepts_the_renamed_wheel(tmp_path):
    """pip checks that the file name, the .dist-info folder and METADATA agree on the version."""
    src = make_wheel(tmp_path / "raw", {"dash/__init__.py": "", bw.MANIFEST: GOOD_MANIFEST},
                     name="dash_attention-0.1.0-py3-none-any.whl")
    dst = bw.with_local_version(src, "torch2.11.cu130", tmp_path / "dist")
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                        str(tmp_path / "site"), str(dst)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "site" / "dash_attention-0.1.0+torch2.11.cu130.dist-info" / "METADATA").exists()
    assert (tmp_path / "site" / "dash" / "_build_manifest.json").exists()


# ---------------------------------------------------------------------------------------
# Staging
# ---------------------------------------------------------------------------------------
def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_stage_copies_tracked_and_untracked_files_not_ignored_ones(tmp_path):
    repo = tmp_path / "repo"
    (repo / "dash").mkdir(parents=True)
    (repo / ".gitignore").write_text("*.so\nbuild/\n/dash/_build_manifest.json\n")
    (repo / "setup.py").write_text("")
    (repo / "dash" / "a.py").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "x")
    (repo / "dash" / "new.py").write_text("")  # untracked: a build of this checkout needs it
    (repo / "dash" / "_C.so").write_text("")  # ignored build outputs stay behind
    (repo / "dash" / "_build_manifest.json").write_text("{}")
    (repo / "build").mkdir()
    (repo / "build" / "x.o").write_text("")
    (repo / "setup.py").unlink()  # deleted but still tracked: not copied
    assert bw.source_files(repo) == [".gitignore", "dash/a.py", "dash/new.py"]
    dest = tmp_path / "stage"
    (dest / "stale").mkdir(parents=True)
    assert bw.stage(dest, repo) == 3
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        ".gitignore", "dash/a.py", "dash/new.py"]


def test_stage_without_git(tmp_path):
    root = tmp_path / "tree"
    for rel in ("setup.py", "dash/a.py", "dash/_C.cpython-312-x86_64-linux-gnu.so", "dash/_build_manifest.json",
                "build/lib/x.py", "dash/__pycache__/a.pyc", "x.egg-info/PKG-INFO"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    env_path = os.environ.get("PATH")
    try:
        os.environ["PATH"] = str(tmp_path / "no-git-here")
        assert bw.source_files(root) == ["dash/a.py", "setup.py"]
    finally:
        os.environ["PATH"] = env_path


def test_build_env():
    env = bw.build_env({"PYTHONPATH": "/x", "HOME": "/h"}, Path("/cuda"), "64", "bf16", 3)
    assert env["GIT_DIR"] == str(ROOT / ".git") and env["GIT_WORK_TREE"] == str(ROOT)
    assert env["CUDA_HOME"] == "/cuda" and env["DASH_HDIMS"] == "64" and env["DASH_DTYPES"] == "bf16"
    assert env["MAX_JOBS"] == "3" and "PYTHONPATH" not in env and env["HOME"] == "/h"
    assert "DASH_HDIMS" not in bw.build_env({}, None, None, None, None)


# ---------------------------------------------------------------------------------------
# Arguments and main
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    ([], "--python and --torch are required to build (or use --check WHEEL)"),
    (["--python", "3.12"], "--python and --torch are required"),
    (["--python", "3.12", "--torch", "latest"], "argument --torch: 'latest' is not a version number"),
    (["--python", "3.12", "--torch", "2.11"], "give the exact release, e.g. 2.11.0"),
    (["--python", "3.12", "--torch", "2.9.1"], "2.9.1 is outside what requirements.txt supports (torch>=2.11"),
    (["--python", "3.12", "--torch", "2.11.0", "--dtypes", "fp8"], "argument --dtypes: 'fp8': choose from bf16, fp16"),
    (["--python", "3.12", "--torch", "2.11.0", "--hdims", "64,big"], "argument --hdims: '64,big': give head dims"),
    (["--python", "3.12", "--torch", "2.11.0", "--jobs", "0"], "argument --jobs: 0 is not a positive integer"),
    (["--check", "/nonexistent.whl"], "argument --check: /nonexistent.whl is not a wheel file"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bw.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_main_check(tmp_path, capsys):
    assert bw.main(["--check", str(good_wheel(tmp_path))]) == 0
    assert "fits: CPython 3.12 (cp312)" in capsys.readouterr().out
    empty = make_wheel(tmp_path, {"dash/__init__.py": ""}, name="dash_attention-0.1.0-py3-none-any.whl")
    assert bw.main(["--check", str(empty)]) == 1
    assert "build_wheel.py: wheel check failed: dash_attention-0.1.0-py3-none-any.whl has no dash/_C*.so" in \
        capsys.readouterr().err


def test_build_without_kernels_is_rejected_and_leaves_the_checkout_alone(tmp_path):
    """The whole build path in this environment, with DASH_SKIP_CUDA_BUILD=1: staging, pip
    wheel, then the check, which must fail naming the missing kernels and why."""
    torch = pytest.importorskip("torch")
    for mod in ("setuptools", "wheel"):
        pytest.importorskip(mod, reason=f"pip wheel --no-build-isolation needs {mod} in this environment")
    version = ".".join(str(x) for x in bw.release(torch.__version__)[:3])
    spec = bw.read_requirements().get("torch", "")
    if spec and not bw.satisfies(version, spec):
        pytest.skip(f"this torch {version} is outside requirements.txt's torch{spec}")
    watched = [ROOT / "dash" / "_build_manifest.json", *sorted((ROOT / "dash").glob("_C*.so"))]
    before = {p: p.stat().st_mtime_ns for p in watched if p.exists()}
    env = dict(os.environ, DASH_SKIP_CUDA_BUILD="1")
    p = subprocess.run([sys.executable, str(SCRIPT), "--python", sys.executable, "--torch", version, "--venv",
                        sys.prefix, "--out", str(tmp_path / "dist")], capture_output=True, text=True, env=env,
                       timeout=900)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "building WITHOUT kernels" in p.stdout
    assert "build_wheel.py: wheel check failed: dash_attention-0.1.0-" in p.stderr
    assert "has no dash/_C*.so: the wheel holds no CUDA kernels. Its manifest says the kernels were not built: " \
           "DASH_SKIP_CUDA_BUILD is set" in p.stderr
    assert not (tmp_path / "dist").exists()  # nothing that failed the check is handed out
    assert {q: q.stat().st_mtime_ns for q in watched if q.exists()} == before
