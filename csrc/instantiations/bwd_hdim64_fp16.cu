// One translation unit per (head dim, dtype) bounds compile time and memory; the mask is
// a compile-time switch inside (see run_bwd_hdim).
#include "kernels/bwd_launch.h"

namespace dash {
template void run_bwd_hdim<64, cutlass::half_t>(BwdParams const&, cudaStream_t);
}  // namespace dash
