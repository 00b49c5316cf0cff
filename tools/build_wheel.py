"""Build a DASH wheel with its CUDA kernels for one Python and one torch, on any Linux x86_64
machine with a CUDA toolkit (no GPU needed), and check what it holds.

    python tools/build_wheel.py --python 3.12 --torch 2.11.0                  # -> dist/
    python tools/build_wheel.py --python 3.11 --torch 2.13.0 --cuda-home /usr/local/cuda-13.0
    python tools/build_wheel.py --python 3.12 --torch 2.11.0 --index-url https://download.pytorch.org/whl/cu126
    python tools/build_wheel.py --python 3.12 --torch 2.11.0 --venv /path/to/existing/venv
    python tools/build_wheel.py --check dist/dash_attention-*.whl             # what a wheel holds and fits

Steps: find that Python (on PATH as pythonX.Y, or under ~/.pyenv/versions; or give its path);
make a virtual environment with it (build/wheel-venvs/pyX.Y-torchV, kept for the next build;
or --venv) holding exactly torch==V (from PyPI, whose Linux wheels are CUDA builds: torch
2.11 is built for CUDA 13.0; --index-url for another CUDA variant) and the rest of
requirements.txt; check that this torch is a CUDA build and that the toolkit's nvcc has its
CUDA major version; copy the checkout's files (git's tracked and untracked-but-not-ignored
ones) to build/wheel-stage/ and run ``pip wheel --no-build-isolation --no-deps`` there (setup.py
clears and rewrites dash/_C*.so and dash/_build_manifest.json in the tree it builds, so the
checkout's own kernels are left alone; git is pointed at the checkout so the manifest records
its commit); check the wheel: dash/_C*.so and dash/_build_manifest.json inside, kernels built,
for this Python and this torch; then give the wheel a local version naming the torch and CUDA
it was built against (0.1.0+torch2.11.cu130) and put it in --out.

Which wheel fits which environment: the extension is compiled against one torch's C++ ABI and
headers and one CPython ABI, so a wheel runs with the same CPython minor version (cp312), the
same torch minor release built for the same CUDA major version (torch.version.cuda), on Linux
x86_64 with a Hopper GPU (sm_90a) and a driver for that CUDA. The wheel's name says the
Python (cp312) and, in its local version, the torch and CUDA; ``--check`` prints all of it.

Exit status: 0 built (or checked) and fits; 1 the build could not be made or the wheel failed
the check (one message says which step and why, or what the wheel lacks); 2 bad arguments.
Environment: DASH_HDIMS / DASH_DTYPES / MAX_JOBS are passed to setup.py (also as --hdims,
--dtypes, --jobs); DASH_SKIP_CUDA_BUILD=1 builds a wheel without kernels, which the check
then rejects (that path exists to test this script on machines without a toolkit).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "dash/_build_manifest.json"
SO_RE = re.compile(r"^dash/_C(\.[A-Za-z0-9_\-]+)*\.so$")
WHEEL_RE = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-(?P<build>\d[^-]*))?-(?P<py>[^-]+)-(?P<abi>[^-]+)-"
                      r"(?P<plat>[^-]+)\.whl$")


class BuildError(RuntimeError):
    """A step that cannot go on; the message says which and why, on its own."""


class WheelCheckError(BuildError):
    """The wheel lacks something a working DASH install needs."""


# ---------------------------------------------------------------------------------------
# Versions and requirements
# ---------------------------------------------------------------------------------------
def release(version: str) -> tuple[int, ...]:
    """(2, 11, 0) for '2.11.0+cu130' or '2.11.0rc1': the numeric release part."""
    m = re.match(r"\d+(\.\d+)*", version.strip().lstrip("v"))
    if not m:
        raise ValueError(f"{version!r} is not a version number")
    return tuple(int(x) for x in m.group(0).split("."))


def _cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return (a > b) - (a < b)


def satisfies(version: str, spec: str) -> bool:
    """Whether ``version`` meets a simple specifier list such as '>=2.11,<2.16' (the forms
    requirements.txt uses: >=, >, <=, <, ==, !=)."""
    v = release(version)
    for part in filter(None, (s.strip() for s in spec.split(","))):
        m = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)", part)
        if not m:
            raise ValueError(f"cannot read the version specifier {part!r}")
        c = _cmp(v, release(m.group(2)))
        ok = {">=": c >= 0, "<=": c <= 0, ">": c > 0, "<": c < 0, "==": c == 0, "!=": c != 0}[m.group(1)]
        if not ok:
            return False
    return True


def read_requirements(path: Path = ROOT / "requirements.txt") -> dict[str, str]:
    """{package: specifier} from a requirements file ('' when unpinned); comments skipped."""
    reqs = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)$", line)
        if m:
            reqs[m.group(1).lower()] = m.group(2).strip()
    return reqs


def local_version(torch_version: str, torch_cuda: str) -> str:
    """The local version label naming what a wheel was built against: torch2.11.cu130."""
    major_minor = ".".join(str(x) for x in release(torch_version)[:2])
    return f"torch{major_minor}.cu{torch_cuda.replace('.', '')}"


# ---------------------------------------------------------------------------------------
# Finding Python, making the environment
# ---------------------------------------------------------------------------------------
def python_candidates(spec: str, path_env: Optional[str] = None, pyenv_root: Optional[Path] = None) -> list[Path]:
    """Where to look for Python ``spec`` (a version 'X.Y', or a path): PATH's pythonX.Y, then
    ~/.pyenv/versions/X.Y.*/bin/pythonX.Y (newest patch first), then /usr/bin, /usr/local/bin."""
    if "/" in spec:
        return [Path(spec)]
    exe = f"python{spec}"
    out = []
    found = shutil.which(exe, path=path_env)
    if found:
        out.append(Path(found))
    root = pyenv_root if pyenv_root is not None else Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    versions = sorted(root.glob(f"versions/{spec}.*"), key=lambda p: release(p.name) if re.match(r"\d", p.name)
                      else (0,), reverse=True)
    out += [v / "bin" / exe for v in versions]
    out += [Path("/usr/bin") / exe, Path("/usr/local/bin") / exe]
    return [p for p in dict.fromkeys(out) if p.is_file() and os.access(p, os.X_OK)]


def python_version_of(exe: Path) -> str:
    p = subprocess.run([str(exe), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0:
        raise BuildError(f"{exe} does not run: {p.stderr.strip()[:300]}")
    return p.stdout.strip()


def find_python(spec: str, **kw) -> tuple[Path, str]:
    """(interpreter, 'X.Y') for ``spec``; BuildError naming where it looked."""
    if "/" in spec:
        exe = Path(spec)
        if not exe.is_file() or not os.access(exe, os.X_OK):
            raise BuildError(f"--python {spec}: no such executable")
        return exe, python_version_of(exe)
    if not re.fullmatch(r"3\.\d+", spec):
        raise BuildError(f"--python {spec!r}: give a version such as 3.12, or the path of an interpreter")
    skipped = []
    for exe in python_candidates(spec, **kw):
        try:
            version = python_version_of(exe)
        except (BuildError, OSError, subprocess.SubprocessError) as e:  # e.g. a pyenv shim of an inactive version
            skipped.append(f"{exe}: {str(e).splitlines()[0]}")
            continue
        if version == spec:
            return exe, version
        skipped.append(f"{exe} is Python {version}")
    raise BuildError(f"--python {spec}: no Python {spec} found (looked for python{spec} on PATH, under "
                     "$PYENV_ROOT/versions or ~/.pyenv/versions, in /usr/bin and /usr/local/bin"
                     + (f"; skipped {'; '.join(skipped)}" if skipped else "") + f"); install it "
                     f"(e.g. pyenv install {spec}) or pass the interpreter's path")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def run(cmd: Sequence[str], what: str, env: Optional[dict] = None, cwd: Optional[Path] = None,
        log: Optional[Path] = None) -> None:
    """Run a step, its output on our stdout (and in ``log``); BuildError naming the step."""
    print(f"$ {' '.join(str(c) for c in cmd)}", flush=True)
    if log is None:
        p = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd)
    else:
        with open(log, "w") as f:
            p = subprocess.Popen([str(c) for c in cmd], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            for line in p.stdout:
                sys.stdout.write(line)
                f.write(line)
            p.wait()
    if p.returncode != 0:
        raise BuildError(f"{what} failed (exit status {p.returncode})" + (f"; full log: {log}" if log else ""))


def probe_torch(python: Path) -> dict:
    """torch's version and CUDA version as the environment's Python sees them."""
    code = ("import json, sys\ntry:\n import torch\nexcept Exception as e:\n print(json.dumps({'error': repr(e)}))\n"
            " sys.exit(0)\nprint(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda}))")
    p = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise BuildError(f"{python} could not be asked for torch's version: {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def prepare_venv(venv: Path, python: Path, py_version: str, torch_version: str, index_url: Optional[str],
                 reuse_only: bool) -> dict:
    """Make (or reuse) the build environment; returns probe_torch's answer."""
    vpy = venv_python(venv)
    if vpy.exists():
        have = python_version_of(vpy)
        if have != py_version:
            raise BuildError(f"{venv} has Python {have}, not {py_version}; remove it or pick another --venv")
        info = probe_torch(vpy)
        if "version" in info and release(info["version"])[:3] == release(torch_version)[:3]:
            print(f"reusing {venv}: Python {have}, torch {info['version']} (CUDA {info['cuda']})")
            return info
        if reuse_only:
            raise BuildError(f"--venv {venv} holds torch {info.get('version', '(none)')}, not {torch_version}; "
                             "install it there or leave --venv out to get a fresh environment")
    else:
        if reuse_only:
            raise BuildError(f"--venv {venv}: no environment there ({vpy} missing)")
        run([python, "-m", "venv", venv], f"creating the environment {venv}")
    reqs = read_requirements()
    rest = [f"{name}{spec}" for name, spec in reqs.items() if name != "torch"]
    torch_cmd = [vpy, "-m", "pip", "install", f"torch=={torch_version}"]
    if index_url:
        torch_cmd += ["--index-url", index_url]
    run(torch_cmd, f"installing torch=={torch_version}" + (f" from {index_url}" if index_url else " from PyPI"))
    run([vpy, "-m", "pip", "install", *rest], "installing the build requirements (requirements.txt)")
    return probe_torch(vpy)


# ---------------------------------------------------------------------------------------
# The toolkit
# ---------------------------------------------------------------------------------------
def nvcc_release(cuda_home: Path) -> str:
    """'13.0' from the toolkit's ``nvcc --version``."""
    p = subprocess.run([str(cuda_home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=120)
    m = re.search(r"release (\d+\.\d+)", p.stdout)
    if p.returncode != 0 or not m:
        raise BuildError(f"{cuda_home}/bin/nvcc --version did not say its release: {(p.stdout + p.stderr)[-300:]}")
    return m.group(1)


def check_toolkit(torch_cuda: str, nvcc: str, cuda_home: Path) -> Optional[str]:
    """A warning (or BuildError) when the toolkit does not fit torch's CUDA: the major versions
    must be equal (torch's extension builder refuses otherwise); another minor only warns."""
    if release(torch_cuda)[0] != release(nvcc)[0]:
        raise BuildError(f"the CUDA toolkit at {cuda_home} is {nvcc}, but this torch is built for CUDA {torch_cuda}: "
                         f"use a CUDA {release(torch_cuda)[0]}.x toolkit (--cuda-home), or a torch built for CUDA "
                         f"{release(nvcc)[0]} (--index-url https://download.pytorch.org/whl/cuXY)")
    if release(torch_cuda)[:2] != release(nvcc)[:2]:
        return f"the toolkit is CUDA {nvcc} and torch's is {torch_cuda}: same major version, the build goes on"
    return None


# ---------------------------------------------------------------------------------------
# Staging and building
# ---------------------------------------------------------------------------------------
_NOT_STAGED = {".git", "build", "dist", ".whl", ".devbuild", "__pycache__", ".pytest_cache", ".hypothesis",
               ".ruff_cache", ".anchors"}


def source_files(root: Path = ROOT) -> list[str]:
    """The checkout's files a build may read: git's tracked and untracked-but-not-ignored ones
    (what a clean clone plus your edits holds); without git, everything but build outputs."""
    try:
        p = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, timeout=120)
        if p.returncode == 0:
            names = [n for n in p.stdout.decode().split("\0") if n]
            return sorted(n for n in names if (root / n).is_file())
    except (OSError, subprocess.SubprocessError):
        pass
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _NOT_STAGED and not d.endswith(".egg-info")]
        for f in filenames:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if not (f.endswith(".so") or f.endswith(".pyc") or rel == MANIFEST):
                out.append(rel)
    return sorted(out)


def stage(dest: Path, root: Path = ROOT) -> int:
    """Copy the source files to ``dest`` (emptied first); returns how many."""
    if dest.exists():
        shutil.rmtree(dest)
    files = source_files(root)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    return len(files)


def build_env(base: dict, cuda_home: Optional[Path], hdims: Optional[str], dtypes: Optional[str],
              jobs: Optional[int], root: Path = ROOT) -> dict:
    env = dict(base)
    # git answers for the checkout, not the staging copy: the manifest's git_commit (with
    # "-dirty" for uncommitted changes to tracked files) is the checkout's.
    if (root / ".git").exists():
        env["GIT_DIR"] = str(root / ".git")
        env["GIT_WORK_TREE"] = str(root)
    if cuda_home is not None:
        env["CUDA_HOME"] = str(cuda_home)
    for key, value in (("DASH_HDIMS", hdims), ("DASH_DTYPES", dtypes), ("MAX_JOBS", jobs)):
        if value is not None:
            env[key] = str(value)
    env.pop("PYTHONPATH", None)  # the build imports only the staged tree and the environment's packages
    env["PIP_NO_INPUT"] = "1"
    return env


# ---------------------------------------------------------------------------------------
# The wheel: what it holds, its name
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WheelInfo:
    path: Path
    version: str
    python_tag: str
    platform: str
    so: str
    manifest: dict

    def fits(self) -> str:
        m = self.manifest
        py = m.get("python") or "?"
        torch_v = m.get("torch") or "?"
        mm = ".".join(str(x) for x in release(torch_v)[:2]) if torch_v != "?" else "?"
        return (f"CPython {'.'.join(py.split('.')[:2])} ({self.python_tag}) on {self.platform}; torch {mm}.x built for "
                f"CUDA {m.get('torch_cuda')} (built against torch {torch_v}); a Hopper GPU ({m.get('arch')}) with a "
                f"driver for CUDA {m.get('torch_cuda')}; kernels for head dims {m.get('head_dims')}, dtypes "
                f"{m.get('dtypes')}; sources {m.get('git_commit')}")


def check_wheel(path: Path, expect_python: Optional[str] = None, expect_torch: Optional[str] = None) -> WheelInfo:
    """What a DASH wheel holds; WheelCheckError when it lacks the kernels or the manifest, or was
    built for another Python or torch than expected."""
    path = Path(path)
    m = WHEEL_RE.match(path.name)
    if not m:
        raise WheelCheckError(f"{path.name} is not a wheel file name (name-version-python-abi-platform.whl)")
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            manifest_text = z.read(MANIFEST).decode() if MANIFEST in names else None
    except (OSError, zipfile.BadZipFile) as e:
        raise WheelCheckError(f"{path} cannot be read as a wheel: {e}") from None
    manifest = None
    if manifest_text is not None:
        try:
            manifest = json.loads(manifest_text)
        except json.JSONDecodeError as e:
            raise WheelCheckError(f"{path.name}: {MANIFEST} is not JSON ({e})") from None
    sos = [n for n in names if SO_RE.match(n)]
    if not sos:
        why = ""
        if manifest is not None and not manifest.get("kernels_built"):
            why = f" Its manifest says the kernels were not built: {manifest.get('reason_not_built')}."
        raise WheelCheckError(f"{path.name} has no dash/_C*.so: the wheel holds no CUDA kernels.{why} A wheel without "
                              "them imports, but every attention call fails; build where torch is a CUDA build and a "
                              "CUDA toolkit is found (CUDA_HOME), without DASH_SKIP_CUDA_BUILD")
    if manifest is None:
        raise WheelCheckError(f"{path.name} has {sos[0]} but no {MANIFEST}: dash cannot tell what was built and will "
                              "not load the kernels; setup.py's build_ext writes it beside the extension")
    if not manifest.get("kernels_built"):
        raise WheelCheckError(f"{path.name}: {MANIFEST} says kernels_built is false "
                              f"({manifest.get('reason_not_built')}) although {sos[0]} is there")
    py = str(manifest.get("python") or "")
    py_mm = ".".join(py.split(".")[:2])
    tag = m.group("py")
    if tag.startswith("cp") and py_mm and tag != "cp" + py_mm.replace(".", ""):
        raise WheelCheckError(f"{path.name} is tagged {tag} but its kernels were built by Python {py}")
    so_abi = re.search(r"cpython-(\d)(\d+)", sos[0])
    if so_abi and py_mm and f"{so_abi.group(1)}.{so_abi.group(2)}" != py_mm:
        raise WheelCheckError(f"{path.name}: {sos[0]} is for CPython {so_abi.group(1)}.{so_abi.group(2)} but the "
                              f"manifest says Python {py}")
    if expect_python and py_mm != expect_python:
        raise WheelCheckError(f"{path.name} was built for Python {py}, not {expect_python}")
    torch_built = str(manifest.get("torch") or "")
    if not torch_built or not manifest.get("torch_cuda"):
        raise WheelCheckError(f"{path.name}: the manifest does not say which torch and CUDA the kernels were built "
                              f"against (torch={manifest.get('torch')!r}, torch_cuda={manifest.get('torch_cuda')!r})")
    if expect_torch and release(torch_built)[:3] != release(expect_torch)[:3]:
        raise WheelCheckError(f"{path.name} was built against torch {torch_built}, not {expect_torch}")
    return WheelInfo(path, m.group("version"), tag, m.group("plat"), sos[0], manifest)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def with_local_version(src: Path, label: str, out_dir: Path) -> Path:
    """A copy of wheel ``src`` whose version carries ``+label`` (METADATA, the .dist-info folder,
    RECORD and the file name all agree, as pip checks), in ``out_dir``."""
    m = WHEEL_RE.match(src.name)
    if not m:
        raise WheelCheckError(f"{src.name} is not a wheel file name")
    old_version = m.group("version")
    if "+" in old_version:
        raise WheelCheckError(f"{src.name} already has a local version ({old_version})")
    new_version = f"{old_version}+{label}"
    name = m.group("name")
    old_info, new_info = f"{name}-{old_version}.dist-info", f"{name}-{new_version}.dist-info"
    build = f"-{m.group('build')}" if m.group("build") else ""
    dst = out_dir / f"{name}-{new_version}{build}-{m.group('py')}-{m.group('abi')}-{m.group('plat')}.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    tmp = dst.with_suffix(".whl.tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            fname = item.filename
            if fname.startswith(old_info + "/"):
                fname = new_info + fname[len(old_info):]
            if fname == f"{new_info}/RECORD":
                continue
            data = zin.read(item)
            if fname == f"{new_info}/METADATA":
                text, n = re.subn(r"(?m)^Version: .*$", f"Version: {new_version}", data.decode("utf-8"), count=1)
                if n != 1:
                    raise WheelCheckError(f"{src.name}: METADATA has no Version line")
                data = text.encode("utf-8")
            info = zipfile.ZipInfo(fname, date_time=item.date_time)
            info.external_attr = item.external_attr  # keeps the extension's permission bits
            info.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(info, data)
            records.append(f"{fname},{_record_hash(data)},{len(data)}")
        records.append(f"{new_info}/RECORD,,")
        info = zipfile.ZipInfo(f"{new_info}/RECORD", date_time=(2026, 1, 1, 0, 0, 0))
        info.external_attr = 0o644 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(info, "\n".join(records) + "\n")
    os.replace(tmp, dst)
    return dst


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="build_wheel.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", help="Python version (3.12) or interpreter path to build for")
    p.add_argument("--torch", help="exact torch version to build against (2.11.0)")
    p.add_argument("--index-url", help="where to get torch (default PyPI; e.g. https://download.pytorch.org/whl/cu126)")
    p.add_argument("--cuda-home", type=Path,
                   help="CUDA toolkit root (default: CUDA_HOME, nvcc on PATH, /usr/local/cuda)")
    p.add_argument("--venv", type=Path, help="an existing environment to build in (it must hold that Python and torch)")
    p.add_argument("--out", type=Path, default=ROOT / "dist", help="where the wheel goes (default dist/)")
    p.add_argument("--hdims", help="head dims to compile, e.g. 64,128 (default: all; DASH_HDIMS)")
    p.add_argument("--dtypes", help="element types to compile, e.g. bf16 (default: both; DASH_DTYPES)")
    p.add_argument("--jobs", type=int, help="parallel compile jobs (default: setup.py's choice; MAX_JOBS)")
    p.add_argument("--no-local-version", action="store_true",
                   help="keep setup.py's version (the file name then does not say the torch / CUDA)")
    p.add_argument("--keep-stage", action="store_true", help="keep build/wheel-stage/... after the build")
    p.add_argument("--check", type=Path, metavar="WHEEL", help="only check a wheel and say what it fits")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check is not None:
        if args.check.is_dir() or not args.check.exists():
            parser.error(f"argument --check: {args.check} is not a wheel file")
        return args
    if not args.python or not args.torch:
        parser.error("--python and --torch are required to build (or use --check WHEEL)")
    try:
        release(args.torch)
    except ValueError:
        parser.error(f"argument --torch: {args.torch!r} is not a version number (e.g. 2.11.0)")
    if len(release(args.torch)) < 3:
        parser.error(f"argument --torch: give the exact release, e.g. {args.torch}.0: the wheel is tied to it")
    spec = read_requirements().get("torch", "")
    if spec and not satisfies(args.torch, spec):
        parser.error(f"argument --torch: {args.torch} is outside what requirements.txt supports (torch{spec})")
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"argument --jobs: {args.jobs} is not a positive integer")
    for flag, value, allowed in (("--hdims", args.hdims, None), ("--dtypes", args.dtypes, ("bf16", "fp16"))):
        if value is not None:
            items = [x.strip() for x in value.split(",") if x.strip()]
            bad = [x for x in items if (allowed and x not in allowed) or (not allowed and not x.isdigit())]
            if not items or bad:
                parser.error(f"argument {flag}: {value!r}: " + (f"choose from {', '.join(allowed)}" if allowed
                                                                 else "give head dims such as 64,128"))
    return args


def print_fit(info: WheelInfo) -> None:
    print(f"\n{info.path}\n  version {info.version}; extension {info.so}\n  fits: {info.fits()}")


def build(args: argparse.Namespace) -> Path:
    skip_kernels = os.environ.get("DASH_SKIP_CUDA_BUILD", "0") not in ("", "0")
    python, py_version = find_python(args.python)
    print(f"Python {py_version}: {python}")
    tag = f"py{py_version}-torch{args.torch}"
    venv = args.venv or ROOT / "build" / "wheel-venvs" / tag
    info = prepare_venv(venv, python, py_version, args.torch, args.index_url, reuse_only=args.venv is not None)
    if "version" not in info:
        raise BuildError(f"torch does not import in {venv}: {info.get('error')}")
    cuda_home = None
    if skip_kernels:
        print("DASH_SKIP_CUDA_BUILD is set: building WITHOUT kernels; the wheel check will reject the wheel")
    else:
        if not info.get("cuda"):
            raise BuildError(f"torch {info['version']} in {venv} is a CPU-only build: the kernels need a CUDA build "
                             "of torch (PyPI's Linux wheels are; or --index-url https://download.pytorch.org/whl/cuXY)")
        sys.path.insert(0, str(ROOT))
        from dash._build import resolve_cuda_home  # pure Python: finds the real toolkit root

        env = dict(os.environ)
        if args.cuda_home:
            env["CUDA_HOME"] = str(args.cuda_home)
        cuda_home, why = resolve_cuda_home(env)
        if cuda_home is None:
            raise BuildError(f"no CUDA toolkit: {why}")
        nvcc = nvcc_release(cuda_home)
        warning = check_toolkit(info["cuda"], nvcc, cuda_home)
        if warning:
            print(f"note: {warning}")
        print(f"torch {info['version']} (CUDA {info['cuda']}), toolkit {cuda_home} (nvcc {nvcc})")
    stage_root = ROOT / "build" / "wheel-stage" / tag
    src = stage_root / "src"
    n = stage(src)
    print(f"staged {n} files in {src}")
    raw = stage_root / "wheel"
    if raw.exists():
        shutil.rmtree(raw)
    raw.mkdir(parents=True)
    env = build_env(os.environ, cuda_home, args.hdims, args.dtypes, args.jobs)
    run([venv_python(venv), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", raw, src],
        "pip wheel", env=env, cwd=src, log=stage_root / "build.log")
    wheels = sorted(raw.glob("*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"pip wheel made {len(wheels)} wheels in {raw}, expected 1")
    checked = check_wheel(wheels[0], expect_python=py_version, expect_torch=args.torch)
    if args.no_local_version:
        args.out.mkdir(parents=True, exist_ok=True)
        final = args.out / wheels[0].name
        shutil.copy2(wheels[0], final)
    else:
        label = local_version(checked.manifest["torch"], checked.manifest["torch_cuda"])
        final = with_local_version(wheels[0], label, args.out)
    checked = check_wheel(final, expect_python=py_version, expect_torch=args.torch)
    if not args.keep_stage:
        shutil.rmtree(stage_root, ignore_errors=True)
    print_fit(checked)
    return final


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if args.check is not None:
            print_fit(check_wheel(args.check))
            return 0
        build(args)
        return 0
    except WheelCheckError as e:
        print(f"build_wheel.py: wheel check failed: {e}", file=sys.stderr)
        return 1
    except BuildError as e:
        print(f"build_wheel.py: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
