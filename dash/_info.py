"""``python -m dash info``: what this install compiled, and which GPU is present."""

from __future__ import annotations

import argparse
import json


def gpu_info() -> dict:
    try:
        import torch
    except ImportError:
        return {"present": False, "reason": "torch is not installed"}
    if not torch.cuda.is_available():
        why = "torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        return {"present": False, "reason": why}
    props = torch.cuda.get_device_properties(0)
    cc = (props.major, props.minor)
    return {
        "present": True,
        "name": props.name,
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{cc[0]}.{cc[1]}",
        "supported_by_dash": cc == (9, 0),
        "memory_gib": round(props.total_memory / 2**30, 1),
    }


def run(args: argparse.Namespace) -> int:
    from dash import __version__
    from dash._ext import kernels_status, manifest

    info = dict(manifest())
    gpu = gpu_info()
    loaded, why_not = kernels_status() if info.get("kernels_built") else (False, None)
    if args.json:
        print(json.dumps({"version": __version__, "build": info, "kernels_loaded": loaded, "gpu": gpu}, indent=2))
        return 0
    print(f"DASH {__version__}")
    from dash._ext import _CHECKOUT_ROOT, _PACKAGE_DIR

    where = "source checkout" if _CHECKOUT_ROOT is not None else "installed package"
    print(f"  package     : {_PACKAGE_DIR} ({where})")
    if info.get("kernels_built"):
        print(f"  kernels     : built for {info.get('arch')}, head dims {info.get('head_dims')}, "
              f"dtypes {info.get('dtypes')}")
        status = "yes" if loaded else f"NO ({why_not})"
        print(f"  loaded      : {status}")
        schedules = info.get("schedules") or ["fa3"]
        from dash.schedules.auto import CAUSAL_KERNEL_CANDIDATES, PORTABLE_KERNEL_SCHEDULES

        portable = [s for s in schedules if s in PORTABLE_KERNEL_SCHEDULES]
        other = [s for s in schedules if s not in PORTABLE_KERNEL_SCHEDULES]
        print(f"  schedules   : {', '.join(portable)} (portable: same bits on any GPU; deterministic auto picks "
              f"among these, under a causal mask among {', '.join(CAUSAL_KERNEL_CANDIDATES)})"
              + (f"; {', '.join(other)} (full mask only; bits depend on the SM count)" if other else "")
              + f", for head dims {info.get('head_dims')}")
        from dash.validation import VARLEN_KERNEL_SCHEDULES

        varlen = [s for s in schedules if s in VARLEN_KERNEL_SCHEDULES]
        print(f"  varlen      : flash_attn_varlen_func, forward and backward (schedules {', '.join(varlen)})")
    else:
        print(f"  kernels     : NOT built: {info.get('reason_not_built')}")
    print(f"  built with  : torch {info.get('torch')} (CUDA {info.get('torch_cuda')}), {info.get('nvcc', 'no nvcc')}, "
          f"python {info.get('python')}")
    print(f"  commit      : {info.get('git_commit')}   built {info.get('built_at')}")
    if gpu["present"]:
        ok = "supported" if gpu["supported_by_dash"] else "NOT supported (DASH needs compute capability 9.0)"
        print(f"  GPU         : {gpu['name']}, {gpu['sm_count']} SMs, compute capability "
              f"{gpu['compute_capability']} ({ok}), {gpu['memory_gib']} GiB")
    else:
        print(f"  GPU         : none ({gpu['reason']})")
    return 0
