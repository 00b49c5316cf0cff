// The persistent, warp-specialised kernel shell that both passes run on: roles, register
// reallocation, the shared-storage view and the one-time setup. What a pass computes lives in
// its kernel type (FwdMainKernel, BwdMainKernel), which the shell calls by role:
//
//   warpgroup 0 (producer warpgroup): gives registers back (setmaxnreg.dec to
//       Kernel::kProducerRegisters). Warp 0, one elected lane: Kernel::producer -- claims the
//       CTA's work and issues the TMA loads. Warps 1..3: Kernel::producer_warpgroup_warp
//       (the backward's dQ writers; nothing in the forward).
//   warpgroups 1..W (MMA warpgroups): take the registers (setmaxnreg.inc to
//       Kernel::kMmaRegisters), then Kernel::mma with a thread index in [0, 128 * W).
//
// Before the roles split, one elected lane of warp 0 runs Kernel::init_shared (TMA descriptor
// prefetch, mbarrier and work-ring init); the mbarrier-init fence and __syncthreads make those
// inits visible to every role (and to the TMA unit) before anyone waits on them.
//
// A Kernel provides: Params, SharedStorage, NumMmaWarpGroups, kProducerRegisters, kMmaRegisters, kClusterSize
// (CTAs per cluster; above 1 the shell syncs the cluster after setup, and the kernel keeps
// each CTA alive until its peers are done signalling it), and static
// __device__ init_shared(params, ss), producer(params, ss), producer_warpgroup_warp(params,
// ss, warp) for warp in 1..3, mma(params, ss, mma_tidx). The __global__ entry of each pass
// keeps its own name (fwd_main_kernel, bwd_main_kernel: what profilers show) and calls run().
#pragma once

#include <cute/arch/util.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "kernels/ptx.h"

namespace dash {

// setmaxnreg moves registers between the warpgroups of a CTA, within what the CTA was launched
// with: 65536 / threads per thread, rounded down to the allocation unit of 8. A budget above
// that passes a register-file check but the MMA warpgroups' setmaxnreg.inc waits forever (it
// did, with a 32-register producer at 2 x 240 in the forward).
constexpr int launch_registers_per_thread(int warpgroups) { return (65536 / (128 * warpgroups)) / 8 * 8; }

template <class Kernel>
struct PersistentShell {
  using Params = typename Kernel::Params;
  using SharedStorage = typename Kernel::SharedStorage;

  static constexpr int kWarpGroups = Kernel::NumMmaWarpGroups + 1;
  static constexpr int kLaunchRegisters = launch_registers_per_thread(kWarpGroups);
  static_assert(Kernel::kProducerRegisters + Kernel::NumMmaWarpGroups * Kernel::kMmaRegisters <=
                    kWarpGroups * kLaunchRegisters,
                "setmaxnreg budget exceeds the registers the CTA is launched with");

  static __device__ __forceinline__ void run(Params const& params) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    auto& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

    int const warp_idx = threadIdx.x / 32;
    if (warp_idx == 0 && cute::elect_one_sync()) {
      Kernel::init_shared(params, ss);
      ptx::fence_mbar_init();
    }
    __syncthreads();
    // The peers' barriers are initialised before anyone signals them. (At the end no cluster
    // barrier: the kernel's producer waits until its peers are done with its barriers.)
    if constexpr (Kernel::kClusterSize > 1) { ptx::cluster_sync(); }

    if (warp_idx < 4) {
      cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegisters>();
      if (warp_idx == 0) {
        if (cute::elect_one_sync()) { Kernel::producer(params, ss); }
      } else {
        Kernel::producer_warpgroup_warp(params, ss, warp_idx);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Kernel::kMmaRegisters>();
      Kernel::mma(params, ss, threadIdx.x - 128);
    }
  }
};

}  // namespace dash
