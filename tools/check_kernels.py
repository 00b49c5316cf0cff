"""Compile every kernel translation unit for sm_90a and check its resources.

    python tools/check_kernels.py            # every TU (rendered into csrc/generated/instantiations)
    python tools/check_kernels.py --sass     # also check the SASS (needs cuobjdump)

For each kernel prints registers, spill bytes and stack frame (from ptxas -v), and exits
non-zero if any shipped kernel spills, uses a stack frame or draws one of ptxas' C75xx notes
on its WGMMA pipeline (serialised WGMMAs, an injected wait). With --sass it also checks that
the main kernel issues HGMMA and TMA loads (UTMALDG) and has no local-memory traffic
(LDL/STL), and that a forward whose table places its P V wait (pv_wait_after_exp2) has at
least that many exponentials ahead of the hot loop's wait. Needs nvcc (CUDA 12.3+) and the
CUTLASS headers (nvidia-cutlass, or DASH_CUTLASS_DIR); no GPU and no torch.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dash import config as dash_config  # noqa: E402

FUNC_RE = re.compile(r"Compiling entry function '(\S+)' for 'sm_90a'")
# ptxas's C75xx notes about a kernel's WGMMA pipeline: it serialised the WGMMAs (C7512 at hdim
# 64 for a deferred-Q-release draft of the backward; C7514 when the accumulator is read while
# the GEMM is in flight) or injected a warpgroup.wait (C7517). Each costs the GEMMs' overlap,
# silently (a draft of the forward's tile end drew C7514 + C7517).
WGMMA_SERIAL_RE = re.compile(r"\((C75\d\d)\)[^\n]*(?:wgmma|warpgroup)[^\n]*function '(\w+)'", re.IGNORECASE)
# ptxas prints a "Function properties for NAME" line, then NAME's stack frame and spills, for each
# entry and for each non-inlined device function it calls: the numbers belong to NAME, which is
# not always the entry being compiled (a callee's "0 bytes stack frame" once hid a kernel's 336).
PROPS_FOR_RE = re.compile(r"Function properties for (\S+)")
PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# The entry's stack including its callees' (a kernel parameter copied to local memory, e.g.).
CUMULATIVE_STACK_RE = re.compile(r"(\d+) bytes cumulative stack size")
REGS_RE = re.compile(r"Used (\d+) registers")


def find_nvcc() -> str:
    home = os.environ.get("CUDA_HOME")
    for cand in ((home + "/bin/nvcc") if home else "", shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    raise SystemExit("check_kernels: nvcc not found (set CUDA_HOME)")


def find_cutlass() -> Path:
    override = os.environ.get("DASH_CUTLASS_DIR")
    if override:
        return Path(override) / "include"
    try:
        import cutlass_library
    except ImportError:
        raise SystemExit("check_kernels: CUTLASS headers not found (pip install nvidia-cutlass==4.2.0.0 "
                         "or set DASH_CUTLASS_DIR)")
    return Path(cutlass_library.source_path) / "include"


def demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def short_name(demangled: str) -> str:
    """'void dash::bwd_main_kernel<dash::BwdTraits<128, true, cutlass::bfloat16_t>>(...)' (or FwdTraits)
    -> 'bwd_main_kernel hdim128 causal bfloat16_t'. A forward names its cluster size (above 1) and
    'varlen' (FwdTraits' kVarlen). A backward main kernel also names its schedule
    class and, when it is the mainloop that loads the LSE early (kLseEarly), 'lse-early': the kernels
    of one translation unit differ only there ('..., dash::ShiftSchedule<...>, false>')."""
    m = re.search(r"dash::(\w+)<dash::(?:Bwd|Fwd)Traits<(\d+), (true|false), cutlass::(\w+)(?:, (\d+))?"
                  r"(?:, (true|false))?>", demangled)
    if not m:
        return demangled[:100]
    kernel, hdim, causal, dtype, cluster, varlen = m.groups()
    name = f"{kernel} hdim{hdim} {'causal' if causal == 'true' else 'full'} {dtype}"
    if cluster is not None and cluster != "1":
        name += f" cluster{cluster}"
    if varlen == "true":  # FwdTraits' kVarlen: sequences packed along the rows
        return name + " varlen"
    schedule = re.search(r"dash::(\w+)Schedule<", demangled)
    if schedule:
        name += f" {schedule.group(1).lower()}"
    # The kernel's own template arguments end at the first '>(' (the parameter list follows).
    args = demangled.split(">(", 1)[0]
    if re.search(r", (?:\(bool\))?(?:true|1)$", args):
        name += " lse-early"
    return name


def pv_wait_after_exp2(name: str) -> int:
    """The table's pv_wait_after_exp2 for a forward main kernel named by short_name (0 for others)."""
    m = re.match(r"fwd_main_kernel hdim(\d+) (causal|full) ", name)
    if not m:
        return 0
    return dash_config.fwd_tile_config(int(m.group(1)), m.group(2) == "causal").pv_wait_after_exp2 or 0


def compile_tu(nvcc: str, cutlass: Path, tu: Path, outdir: Path) -> tuple[Path, str, Path]:
    obj = outdir / (tu.stem + ".o")
    cmd = [
        nvcc, "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
        "-DNDEBUG", "-Xptxas", "-v", "-I", str(ROOT / "csrc"), "-I", str(cutlass), "-c", str(tu), "-o", str(obj),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tu.name} failed to compile:\n{proc.stderr[-4000:]}")
    return tu, proc.stderr, obj


def parse_ptxas(log: str) -> list[dict]:
    kernels = []
    current = None
    props_for = None  # the function the next stack / spill line describes
    serialised: dict[str, list[str]] = {}
    for line in log.splitlines():
        m = WGMMA_SERIAL_RE.search(line)
        if m:
            serialised.setdefault(m.group(2), []).append(m.group(1))
            continue
        m = FUNC_RE.search(line)
        if m:
            props_for = None
            current = {"mangled": m.group(1)}
            kernels.append(current)
            continue
        m = PROPS_FOR_RE.search(line)
        if m:
            props_for = m.group(1)
            continue
        if current is None:
            continue
        m = PROPS_RE.search(line)
        if m:
            stack, stores, loads = map(int, m.groups())
            if props_for in (None, current["mangled"]):
                current["stack"] = max(current.get("stack", 0), stack)
            # a callee's spills are the kernel's too (it runs them)
            current["spill_stores"] = current.get("spill_stores", 0) + stores
            current["spill_loads"] = current.get("spill_loads", 0) + loads
        m = CUMULATIVE_STACK_RE.search(line)
        if m:
            current["stack"] = max(current.get("stack", 0), int(m.group(1)))
        m = REGS_RE.search(line)
        if m:
            current["registers"] = int(m.group(1))
    for k in kernels:
        k["wgmma_serialised"] = sorted(set(serialised.get(k["mangled"], [])))
    return kernels


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia

        for base in nvidia.__path__:
            for cand in Path(base).glob("**/bin/cuobjdump"):
                return str(cand)
    except ImportError:
        pass
    cand = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuobjdump"
    return str(cand) if cand.exists() else None


def sass_by_function(cuobjdump: str, obj: Path) -> dict[str, str]:
    # cuobjdump runs nvdisasm, which the nvidia-cuda-nvdisasm wheel puts next to it.
    env = dict(os.environ, PATH=str(Path(cuobjdump).parent) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run([cuobjdump, "--dump-sass", str(obj)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {obj.name}: {proc.stderr.strip()[:500]}")
    text = proc.stdout
    parts = re.split(r"\n\s*Function : (\S+)\n", text)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def hot_loop(code: str) -> dict | None:
    """The innermost loop holding the kernel's per-block WGMMA work (of the loops with at least 8
    HGMMA that hold no other such loop, the one with the most HGMMA, the later one on a tie: the
    forward's unmasked loop follows its masked one, and with the lazy block max it also holds the
    slow path's S GEMM; back edges after the kernel's last EXIT are not loops but
    the retry stubs of barrier waits, which jump back to their wait and so would close a "loop"
    around whatever lies between, e.g. a tile end's last P·V GEMM), as counts: instructions,
    branches, register moves, and the MUFU.EX2 issued before the loop's first wait for all
    WGMMA groups (``WARPGROUP.DEPBAR.LE gsb0, 0x0``). The last number says how much of the
    softmax ptxas left under the GEMM still in flight: the source waits after the softmax,
    but ptxas may hoist the wait (docs/kernel-notes.md, fifth pass)."""
    instrs, index = [], {}
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;", code):
        index[int(m.group(1), 16)] = len(instrs)
        instrs.append(m.group(2).strip())
    exits = [i for i, ins in enumerate(instrs) if re.sub(r"^@!?U?P[T0-9]+\s+", "", ins).split()[:1] == ["EXIT"]]
    last_exit = exits[-1] if exits else len(instrs)
    loops = []
    for i, ins in enumerate(instrs[:last_exit]):
        m = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)", ins)
        if m and index.get(int(m.group(1), 16), i + 1) <= i:
            lo = index[int(m.group(1), 16)]
            loops.append((sum("HGMMA" in x for x in instrs[lo:i + 1]), lo, i))
    loops = [lp for lp in loops if lp[0] >= 8]
    if not loops:
        return None
    innermost = [lp for lp in loops if not any(o is not lp and lp[1] <= o[1] and o[2] <= lp[2] for o in loops)]
    most, lo, hi = max(innermost, key=lambda lp: (lp[0], lp[1]))
    body = [re.sub(r"^@!?U?P[T0-9]+\s+", "", x) for x in instrs[lo:hi + 1]]
    ops = [x.split()[0] for x in body]
    waits = [j for j, x in enumerate(body) if x.startswith("WARPGROUP.DEPBAR.LE") and x.endswith("0x0")]
    before = ops[:waits[0]] if waits else ops
    return {"instructions": len(body), "hgmma": most, "branches": ops.count("BRA"),
            "moves": sum(o.startswith("IMAD.MOV") or o == "MOV" for o in ops),
            "ex2_before_wait": sum(o.startswith("MUFU.EX2") for o in before),
            "ex2": sum(o.startswith("MUFU.EX2") for o in ops)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sass", action="store_true", help="also check HGMMA/UTMALDG present and no LDL/STL")
    p.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 4))
    p.add_argument("tus", nargs="*", type=Path,
                   help="translation units (default: every unit dash/config.py renders, all head dims and dtypes)")
    args = p.parse_args(argv)

    nvcc, cutlass = find_nvcc(), find_cutlass()
    units = dash_config.write_generated(str(ROOT / "csrc" / "generated"))
    tus = args.tus or [Path(u) for u in units]
    cuobjdump = find_cuobjdump() if args.sass else None
    if args.sass and cuobjdump is None:
        print("check_kernels: --sass requested but cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
        return 2

    failures = []
    rows = []
    with tempfile.TemporaryDirectory() as tmp, cf.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(compile_tu, nvcc, cutlass, tu, Path(tmp)) for tu in tus]
        results = []
        for fut in cf.as_completed(futures):
            try:
                results.append(fut.result())
            except RuntimeError as e:
                failures.append(str(e))
        for tu, log, obj in sorted(results):
            kernels = parse_ptxas(log)
            names = demangle([k["mangled"] for k in kernels])
            sass = sass_by_function(cuobjdump, obj) if cuobjdump else {}
            for k in kernels:
                name = short_name(names[k["mangled"]])
                spills = k.get("spill_stores", 0) + k.get("spill_loads", 0)
                note = []
                if spills or k.get("stack", 0):
                    failures.append(f"{tu.name}: {name} spills {spills} B, stack {k.get('stack', 0)} B")
                    note.append("SPILLS")
                if k["wgmma_serialised"]:
                    codes = "/".join(k["wgmma_serialised"])
                    failures.append(f"{tu.name}: {name}: ptxas {codes} on its WGMMA pipeline (serialised or waited; see -Xptxas -v)")
                    note.append(f"WGMMA {codes}")
                main_kernel = "bwd_main_kernel" in name or "fwd_main_kernel" in name
                code = sass.get(k["mangled"], "") if cuobjdump else ""
                # No local memory in any kernel, small ones included (a parameter copied to the
                # stack is STL in every thread of every block, hot loop or not).
                local = len(re.findall(r"\b(LDL|STL)\b", code))
                if cuobjdump and not main_kernel and local:
                    failures.append(f"{tu.name}: {name} SASS: LDL/STL {local}")
                    note.append(f"LDL/STL {local}")
                if cuobjdump and main_kernel:
                    hgmma, utma = code.count("HGMMA"), code.count("UTMALDG")
                    note.append(f"HGMMA {hgmma}, UTMALDG {utma}, LDL/STL {local}")
                    if hgmma == 0 or utma == 0 or local:
                        failures.append(f"{tu.name}: {name} SASS: HGMMA {hgmma}, UTMALDG {utma}, LDL/STL {local}")
                    loop = hot_loop(code)
                    if loop:  # reported: what ptxas made of the mainloop
                        note.append(f"loop {loop['instructions']} instr, {loop['branches']} BRA, {loop['moves']} MOV, "
                                    f"EX2 before the WGMMA wait {loop['ex2_before_wait']}/{loop['ex2']}")
                    # Checked where the table places the forward's P V wait (pv_wait_after_exp2): the
                    # exponentials it asks for precede the loop's first wait for all WGMMA groups.
                    wanted = pv_wait_after_exp2(name)
                    if wanted and (not loop or loop["ex2_before_wait"] < wanted):
                        got = loop["ex2_before_wait"] if loop else "no loop found"
                        failures.append(f"{tu.name}: {name}: {got} exponentials before the P V wait, "
                                        f"the table asks for {wanted} (pv_wait_after_exp2)")
                rows.append((tu.name, name, k.get("registers", -1), spills, k.get("stack", 0), "; ".join(note)))

    print(f"{'translation unit':<24} {'kernel':<60} {'regs':>5} {'spill B':>8} {'stack B':>8}  notes")
    for row in rows:
        print(f"{row[0]:<24} {row[1]:<60} {row[2]:>5} {row[3]:>8} {row[4]:>8}  {row[5]}")
    if failures:
        print("\nFAILED:")
        for f in failures:
            print("  " + f)
        return 1
    print(f"\n{len(rows)} kernels in {len(tus)} translation units: no spills, no stack frames, no serialised WGMMAs.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
