"""tools/check_kernels.py's SASS reading: the hot-loop report (no GPU, no compiler: synthetic SASS
in cuobjdump's format, addresses and branch targets as cuobjdump prints them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "check_kernels.py"


@pytest.fixture(scope="module")
def ck():
    spec = importlib.util.spec_from_file_location("check_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sass(lines: list[str]) -> str:
    """Instructions at 16-byte addresses, each followed by cuobjdump's encoding comment line."""
    out = []
    for i, ins in enumerate(lines):
        out.append(f"        /*{16 * i:04x}*/                   {ins} ;                /* 0x000 */")
        out.append("                                                                        /* 0x000 */")
    return "\n".join(out)


def loop_body(ex2_before_wait: int, ex2_after: int, moves: int, hgmma: int = 16) -> list[str]:
    body = ["BAR.SYNC.DEFER_BLOCKING R5, 0x100", "WARPGROUP.ARRIVE"]
    body += [f"HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24{', gsb0' if i == hgmma - 1 else ''}"
             for i in range(hgmma)]
    body += ["WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    body += ["MUFU.EX2 R7, R7"] * ex2_before_wait
    body += ["WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    body += ["MUFU.EX2 R8, R8", "F2FP.BF16.F32.PACK_AB R152, R8, R9"] * ex2_after
    body += ["IMAD.MOV.U32 R10, RZ, RZ, R11"] * moves
    return body


def test_hot_loop_counts_the_innermost_wgmma_loop(ck):
    head = ["S2R R0, SR_TID.X", "ISETP.NE.AND P0, PT, R0, RZ, PT"]
    inner = loop_body(ex2_before_wait=5, ex2_after=7, moves=3)
    start = len(head)
    # inner loop: back edge to its first instruction; an outer loop around it, back to 0.
    lines = head + inner + [f"@P0 BRA 0x{16 * start:x}", "IADD3 R1, R1, 0x1, RZ", "@!P1 BRA 0x0", "EXIT"]
    r = ck.hot_loop(sass(lines))
    assert r == {"instructions": len(inner) + 1, "hgmma": 16, "branches": 1, "moves": 3, "ex2_before_wait": 5,
                 "ex2": 12}


def test_hot_loop_is_not_fooled_by_a_retry_stub_branching_back(ck):
    """A barrier's retry stub after the last EXIT jumps back to its wait, here the tile end's wait
    for V before the last P·V GEMM (8 HGMMA): that closes a range with fewer instructions than the
    real loop, which carries a 300-instruction cold path (the forward's lazy max). The real loop
    must be reported."""
    inner = loop_body(ex2_before_wait=64, ex2_after=0, moves=0) + ["FMNMX R7, R7, R8, !PT"] * 300
    lines = inner + ["@P0 BRA 0x0"]
    wait = len(lines)
    lines += ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3", "@!P0 BRA 0xSTUB", "WARPGROUP.ARRIVE"]
    lines += [f"HGMMA.64x128x16.F32.BF16 R88, R120, gdesc[UR8].tnspB, R88{', gsb0' if i == 7 else ''}" for i in range(8)]
    lines += ["FMUL R88, R88, R3"] * 40 + ["EXIT"]
    stub = len(lines)
    lines += ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3", "@!P0 BRA 0x%x" % (16 * stub), "BRA 0x%x" % (16 * wait)]
    lines = [x.replace("0xSTUB", "0x%x" % (16 * stub)) for x in lines]
    r = ck.hot_loop(sass(lines))
    assert r["instructions"] == len(inner) + 1 and r["hgmma"] == 16 and r["ex2_before_wait"] == 64


def test_hot_loop_prefers_the_later_sibling_loop_with_more_wgmma(ck):
    """The hdim-128 forward has two block loops: the masked blocks' (exact softmax, 16 HGMMA,
    fewer instructions) and then the unmasked blocks', which with the lazy block max also holds
    its slow path's S GEMM (24 HGMMA). The latter is the hot one; on a tie, the later one."""
    masked = loop_body(ex2_before_wait=30, ex2_after=36, moves=0) + ["FMNMX R7, R7, R8, !PT"] * 64
    lazy = loop_body(ex2_before_wait=64, ex2_after=0, moves=0, hgmma=24) + ["FMNMX R7, R7, R8, !PT"] * 200
    lines = masked + ["@P0 BRA 0x0"]
    start = len(lines)
    lines += lazy + [f"@P0 BRA 0x{16 * start:x}", "EXIT"]
    r = ck.hot_loop(sass(lines))
    assert r["instructions"] == len(lazy) + 1 and r["hgmma"] == 24 and r["ex2_before_wait"] == 64
    tie = loop_body(ex2_before_wait=7, ex2_after=0, moves=0)
    lines = masked + ["@P0 BRA 0x0"] + tie + [f"@P0 BRA 0x{16 * start:x}", "EXIT"]
    r = ck.hot_loop(sass(lines))
    assert r["instructions"] == len(tie) + 1 and r["ex2_before_wait"] == 7


def test_hot_loop_ignores_loops_without_wgmma_and_forward_branches(ck):
    lines = ["MOV R1, 0x0", "IADD3 R1, R1, 0x1, RZ", "@P0 BRA 0x10",  # a loop with no HGMMA
             "@P1 BRA 0x50", "EXIT", "EXIT"]  # a forward branch
    assert ck.hot_loop(sass(lines)) is None


def test_hot_loop_without_a_full_wait_counts_every_exponential(ck):
    body = [x for x in loop_body(ex2_before_wait=4, ex2_after=2, moves=0) if x != "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    r = ck.hot_loop(sass(body + ["@P0 BRA 0x0"]))
    assert r["ex2_before_wait"] == r["ex2"] == 6


def test_short_names_of_both_passes(ck):
    fwd = ("void dash::fwd_main_kernel<dash::FwdTraits<128, false, cutlass::bfloat16_t> >"
           "(dash::FwdTraits<128>::MainParams)")
    bwd = "void dash::bwd_main_kernel<dash::BwdTraits<64, true, cutlass::half_t>, dash::ClaimedSchedule<> >(P)"
    assert ck.short_name(fwd) == "fwd_main_kernel hdim128 full bfloat16_t"
    fwd_cluster = ("void dash::fwd_main_kernel<dash::FwdTraits<128, false, cutlass::bfloat16_t, 2>>"
                   "(dash::FwdTraits<128, false, cutlass::bfloat16_t, 2>::MainParams)")
    assert ck.short_name(fwd_cluster) == "fwd_main_kernel hdim128 full bfloat16_t cluster2"
    assert ck.short_name(fwd_cluster.replace(", 2>", ", 1>")) == "fwd_main_kernel hdim128 full bfloat16_t"
    assert ck.short_name(fwd_cluster.replace(", 2>", ", 1, false>")) == "fwd_main_kernel hdim128 full bfloat16_t"
    fwd_varlen = ("void dash::fwd_main_kernel<dash::FwdTraits<64, true, cutlass::half_t, 1, true> >"
                  "(dash::FwdTraits<64, true, cutlass::half_t, 1, true>::MainParams)")
    assert ck.short_name(fwd_varlen) == "fwd_main_kernel hdim64 causal half_t varlen"
    assert ck.short_name(bwd) == "bwd_main_kernel hdim64 causal half_t claimed"
    real = ("void dash::bwd_main_kernel<dash::BwdTraits<128, true, cutlass::bfloat16_t>, dash::ClaimedSchedule<"
            "dash::TileGeometryT<dash::StaticBlocks<64, 128> > >, {}>(dash::BwdTraits<128, true, "
            "cutlass::bfloat16_t>::MainParams<dash::ClaimedSchedule<dash::TileGeometryT<dash::StaticBlocks<64, 128> > > >)")
    assert ck.short_name(real.format("true")) == "bwd_main_kernel hdim128 causal bfloat16_t claimed lse-early"
    assert ck.short_name(real.format("false")) == "bwd_main_kernel hdim128 causal bfloat16_t claimed"
    shift = real.format("false").replace("ClaimedSchedule", "ShiftSchedule")
    assert ck.short_name(shift) == "bwd_main_kernel hdim128 causal bfloat16_t shift"


def test_placed_pv_wait_is_read_from_the_table_per_forward_kernel(ck, monkeypatch):
    import dataclasses

    from dash import config as C

    rows = tuple(dataclasses.replace(c, pv_wait_after_exp2=7 if (c.head_dim, c.causal) == (64, True) else None)
                 for c in C.FWD_TILE_CONFIGS)
    monkeypatch.setattr(ck.dash_config, "FWD_TILE_CONFIGS", rows)
    assert ck.pv_wait_after_exp2("fwd_main_kernel hdim64 causal bfloat16_t") == 7
    assert ck.pv_wait_after_exp2("fwd_main_kernel hdim64 causal half_t varlen") == 7
    assert ck.pv_wait_after_exp2("fwd_main_kernel hdim64 full bfloat16_t") == 0
    assert ck.pv_wait_after_exp2("fwd_main_kernel hdim128 causal bfloat16_t") == 0
    assert ck.pv_wait_after_exp2("bwd_main_kernel hdim64 causal bfloat16_t claimed") == 0


def test_ptxas_wgmma_serialisation_is_attributed_to_its_kernel(ck):
    # The lines ptxas -v printed for a draft of the forward kernel whose last P V wait sat in a
    # second branch (docs/kernel-notes.md, thirteenth pass), beside a clean kernel.
    log = "\n".join([
        "ptxas info    : Compiling entry function '_Z3badv' for 'sm_90a'",
        "ptxas info    : (C7517) warpgroup.wait is injected in around line 10092 by compiler to allow use of "
        "registers defined by GMMA in function '_Z3badv'",
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
        "stage in the function '_Z3badv'",
        "ptxas info    : Used 168 registers, used 16 barriers",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Compiling entry function '_Z4goodv' for 'sm_90a'",
        "ptxas info    : Used 128 registers, used 16 barriers",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
    ])
    bad, good = ck.parse_ptxas(log)
    assert (bad["mangled"], bad["wgmma_serialised"], bad["registers"]) == ("_Z3badv", ["C7514", "C7517"], 168)
    assert (good["mangled"], good["wgmma_serialised"], good["spill_stores"]) == ("_Z4goodv", [], 0)


def test_ptxas_stack_frame_is_not_hidden_by_a_callee(ck):
    # ptxas -v of the varlen preprocess before its parameter became __grid_constant__: passing
    # the parameter by reference to a non-inlined helper copied it to the stack (336 B per
    # thread, ~4 GB of local stores per backward of a skewed batch), and the helper's own
    # "0 bytes stack frame", printed after the kernel's, used to overwrite the kernel's 336.
    log = "\n".join([
        "ptxas info    : Compiling entry function '_Z10preprocessv' for 'sm_90a'",
        "ptxas info    : Function properties for _Z10preprocessv",
        "    336 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Used 48 registers, used 0 barriers, 336 bytes cumulative stack size",
        "ptxas info    : Compile time = 35.556 ms",
        "ptxas info    : Function properties for _Z6helperRK6Params",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Compiling entry function '_Z5cleanv' for 'sm_90a'",
        "ptxas info    : Function properties for _Z5cleanv",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Used 31 registers, used 1 barriers, 1024 bytes smem",
    ])
    pre, clean = ck.parse_ptxas(log)
    assert (pre["mangled"], pre["stack"], pre["registers"]) == ("_Z10preprocessv", 336, 48)
    assert (clean["mangled"], clean["stack"], clean["spill_stores"]) == ("_Z5cleanv", 0, 0)
