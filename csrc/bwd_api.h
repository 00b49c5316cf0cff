// Entry points of the kernel library for the torch binding. No torch, no CuTe.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kernels/bwd_params.h"

namespace dash {

// Whether this build compiled the backward for (head_dim, dtype).
bool bwd_is_built(int head_dim, DType dtype);
// Head dims / dtypes compiled into this build, e.g. "64, 128" and "bfloat16, float16".
std::string bwd_built_head_dims();
std::string bwd_built_dtypes();
// "DASH <pass>: head_dim=96 with dtype bfloat16 is not built; built head dims: ..." (both
// passes are built for the same units).
std::string not_built_message(char const* pass, int head_dim, DType dtype);

// Workspace the caller must allocate (any contents: the preprocess kernel initialises it),
// region by region ...
BwdWorkspaceSizes bwd_workspace_sizes(BwdParams const& params);
// ... and as one allocation of this many bytes (16-byte aligned), which bwd_set_workspace
// carves into the regions, each starting 16-byte aligned.
size_t bwd_workspace_bytes(BwdParams const& params);
void bwd_set_workspace(BwdParams& params, void* workspace);

// kBlockN of the backward's tiles: columns of a head = ceil(seqlen_k / kBlockN).
int bwd_block_n(BwdParams const& params);

// GQA: true if the kernel sums each group's dK/dV in ordered chains and writes dk/dv
// (deterministic, or groups of at most the config's kNondetdKVChainsMaxGroup query heads);
// false if the heads add into a zeroed dk_accum / dv_accum that the caller casts.
bool bwd_dkv_ordered(BwdParams const& params);

// GQA dK/dV accumulation chains of an ordered run (the config's kdKVChains, at most
// heads / heads_k - 1); 1 otherwise. dk_accum / dv_accum hold this many copies of k's shape.
int bwd_dkv_chains(BwdParams const& params);

// (column, Q tile) steps of the whole problem: the number of records a traced run writes.
int64_t bwd_trace_steps(BwdParams const& params);

// Enqueue preprocess, main and dQ-convert kernels on `stream`. Throws std::runtime_error
// (naming what was asked and what is built) for an unsupported combination, and on any
// launch error.
void run_bwd(BwdParams const& params, cudaStream_t stream);

}  // namespace dash
