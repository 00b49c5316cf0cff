// One translation unit per (head dim, dtype) bounds compile time and memory; the mask is
// a compile-time switch inside (see run_fwd_hdim).
#include "kernels/fwd_launch.h"

namespace dash {
template void run_fwd_hdim<64, cutlass::bfloat16_t>(FwdParams const&, cudaStream_t);
}  // namespace dash
