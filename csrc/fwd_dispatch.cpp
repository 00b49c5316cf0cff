// Dispatch from runtime (head dim, dtype) to the forward translation units this build
// compiled (the generated list in generated/dispatch.h, as for the backward).
#include "fwd_api.h"

#include <stdexcept>
#include <string>

#include "generated/dispatch.h"
#include "bwd_api.h"  // bwd_is_built / bwd_built_*: the (head dim, dtype) set both passes share

namespace cutlass {
struct bfloat16_t;
struct half_t;
}  // namespace cutlass

namespace dash {

template <int kHeadDim, class Element>
void run_fwd_hdim(FwdParams const& params, cudaStream_t stream);

void run_fwd(FwdParams const& p, cudaStream_t stream) {
  if (!bwd_is_built(p.head_dim, p.dtype)) {
    throw std::invalid_argument(not_built_message("forward", p.head_dim, p.dtype));
  }
#define DASH_RUN_CASE(D, T, E) \
  if (p.head_dim == D && p.dtype == DType::E) return run_fwd_hdim<D, T>(p, stream);
  DASH_FOR_EACH_BUILT_UNIT(DASH_RUN_CASE)
#undef DASH_RUN_CASE
  throw std::logic_error("DASH forward: head_dim=" + std::to_string(p.head_dim) +
                         " passed the build check but has no dispatch case");
}

}  // namespace dash
