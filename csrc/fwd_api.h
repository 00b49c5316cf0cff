// Entry point of the forward kernel library for the torch binding. No torch, no CuTe.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/fwd_params.h"

namespace dash {

// Enqueue the forward on `stream`: writes every element of params.out and params.lse.
// A build compiles the forward and the backward for the same (head dim, dtype) pairs
// (bwd_is_built in bwd_api.h). Throws std::invalid_argument for an unsupported problem
// (naming what was asked and what is built) and std::runtime_error on a launch error.
void run_fwd(FwdParams const& params, cudaStream_t stream);

}  // namespace dash
