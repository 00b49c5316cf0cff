"""Fingerprints of a training run for bitwise run-to-run comparison: a loss curve as float32
bit patterns, a tensor as a SHA-256 of its dtype, shape and bytes, a model as one SHA-256 over
its named tensors' digests. Used by benchmarks/bench_e2e.py and tools/train_multigpu.py."""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Sequence


def float32_bits(values: Sequence[float]) -> list[str]:
    """Hex strings of float32 values (exact for values that are float32, e.g. a loss's .tolist())."""
    return [f"{struct.unpack('<I', struct.pack('<f', v))[0]:08x}" for v in values]


def tensor_digest(t: Any) -> str:
    """SHA-256 of a tensor's dtype, shape and raw bytes (so -0.0 != 0.0 and NaN payloads count)."""
    import torch

    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(memoryview(data))
    return h.hexdigest()


def combined_digest(param_digests: dict[str, str]) -> str:
    """One SHA-256 over name -> digest pairs, in name order."""
    h = hashlib.sha256()
    for name in sorted(param_digests):
        h.update(f"{name}={param_digests[name]};".encode())
    return h.hexdigest()
