// Thin wrappers over the sm_90 PTX that the kernels need and CuTe does not expose
// directly: mbarriers, named barriers, bulk (non-tensor) copies and reduce-adds, the
// global-memory semaphore used by the deterministic dQ reduction, and a WGMMA wait that
// ptxas cannot hoist.
//
// Memory-ordering notes live beside each primitive; the deterministic protocols that
// combine them are documented at BwdMainKernel::dq_writer and BwdMainKernel::store_dkv
// (kernels/bwd_main_kernel.h).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace dash::ptx {

__device__ __forceinline__ uint32_t smem_addr(void const* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------------------------------
// mbarrier (shared-memory transaction barrier)
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrive_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrive_count));
}

// Makes mbarrier initialisation visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of TMA transactions for the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Blocks until the phase with parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  uint32_t const addr = smem_addr(bar);
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(addr),
      "r"(phase)
      : "memory");
}

// Arrives on the mbarrier at the same shared-memory offset in the cluster's CTA `cta_rank`
// if `pred` (the forward's K/V multicast: a consumer frees a stage in its peer, whose TMA
// writes into this CTA's copy of it). The stage's readers are WGMMAs the caller has waited for
// (wgmma.wait_group), and its next writer is the peer's TMA, issued after the peer's producer
// sees this arrival: CUTLASS's cluster pipelines (PipelineTmaAsync::consumer_release) release
// such a stage with this same default-semantics arrive. Not .release.cluster: that form made
// ptxas put a cluster-scope memory barrier before every arrival, and the forward's warps then
// stalled on it (ncu: 1.9 "membar" stall cycles per issued instruction, the kernel 1.4x slower).
// Predicated inside the asm rather than branched around, so the caller's loop body stays one
// basic block.
__device__ __forceinline__ void mbar_arrive_cluster_if(uint64_t* bar, uint32_t cta_rank, bool pred) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      ".reg .b32 remote;\n"
      "setp.ne.b32 p, %2, 0;\n"
      "@p mapa.shared::cluster.u32 remote, %0, %1;\n"
      "@p mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(cta_rank), "r"(uint32_t(pred))
      : "memory");
}

// ---------------------------------------------------------------------------------------
// Clusters
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster, converged (.aligned). Release/acquire: what each
// CTA wrote before it (its mbarrier inits) is visible to its peers after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// ---------------------------------------------------------------------------------------
// Named barriers (bar.sync / bar.arrive). Id 0 is __syncthreads; ours start at 1.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void named_sync(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(num_threads) : "memory");
}
__device__ __forceinline__ void named_arrive(uint32_t id, uint32_t num_threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(num_threads) : "memory");
}

// bar.sync that also ORs a predicate over the `num_threads` threads it waits for and returns
// the result to each of them (bar.red.or.pred): a decision every thread of a warpgroup takes the
// same way, as the WGMMA it may lead to needs. Like bar.sync, .aligned: every thread of each
// participating warp executes it, converged.
__device__ __forceinline__ bool named_sync_or(uint32_t id, uint32_t num_threads, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n"
      ".reg .pred p, q;\n"
      "setp.ne.b32 p, %1, 0;\n"
      "bar.red.or.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n"
      "}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "r"(id), "r"(num_threads)
      : "memory");
  return any != 0;
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy
// (TMA, WGMMA, bulk copy) reads of the same shared memory. Needed before a barrier that
// hands smem written with st.shared to wgmma or cp.reduce.async.bulk.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Orders async-proxy global accesses of this thread against its generic-proxy ones.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// ---------------------------------------------------------------------------------------
// Bulk (non-tensor) copies. Sizes are multiples of 16 bytes, addresses 16-byte aligned.
// ---------------------------------------------------------------------------------------
// Global -> shared, completion counted as transaction bytes on `bar`.
__device__ __forceinline__ void bulk_copy_g2s(void* smem_dst, void const* gmem_src, uint32_t bytes,
                                              uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// gmem[i] += smem[i] (fp32), performed by the async proxy as one bulk operation; each
// element receives exactly one atomic add. Tracked by the bulk async-group of the
// issuing thread.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem_dst, float const* smem_src, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem_dst),
      "r"(smem_addr(smem_src)), "r"(bytes)
      : "memory");
}

// gmem[i] = smem[i], the same bulk operation without the add (bulk async-group as above).
__device__ __forceinline__ void bulk_store(void* gmem_dst, void const* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gmem_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until at most N bulk groups still *read shared memory*: the source buffer may be
// reused. Says nothing about the writes to global memory.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// Waits until at most N bulk groups are pending *at all*: their writes to global memory
// have been performed. This is the wait a deterministic release needs.
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------------------------------
// GPU-scope semaphore for ordered dQ accumulation.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ int ld_acquire_gpu(int const* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// GPU-scope fence, cumulative: writes this thread has observed (through a CTA barrier, the
// other threads' writes too) are ordered before its later writes at GPU scope.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// gmem[0..1] += (a, b): one relaxed GPU-scope atomic add of a float pair (sm_90), 8-byte aligned.
__device__ __forceinline__ void red_add_v2_f32(float* gmem, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(gmem), "f"(a), "f"(b) : "memory");
}

// gmem[0..1] = (a, b): a plain 8-byte store of a float pair, 8-byte aligned.
__device__ __forceinline__ void st_v2_f32(float* gmem, float a, float b) {
  asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(gmem), "f"(a), "f"(b) : "memory");
}

// x, as a value the compiler cannot see through: what is computed from it stays where it is
// written instead of being hoisted out of the enclosing loops (where it would hold registers).
__device__ __forceinline__ int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Waits for every WGMMA group this warpgroup committed, placed after `after` is computed.
// ptxas may move a plain wgmma.wait_group up (waiting earlier is always legal), and does so to
// where it first reuses the registers an in-flight GEMM reads: in the hdim-64 forward, the P
// fragment of the P V GEMM, above the block's first exponential. A wait guarded by a predicate
// computed from `after` cannot be issued before `after` exists. The guard is always true: the
// forward passes a partial sum of exp2 results, and no FADD or MUFU result has the bit pattern
// 0xffffffff (a NaN they produce is the canonical 0x7fffffff), so it is warp-uniform, as the
// .aligned wait requires. The unguarded wait behind it is what ptxas's own register analysis
// sees (with the guarded one alone it cannot tell that the groups drained and serialises the
// loop's WGMMAs, C7514); it finds nothing left to wait for.
__device__ __forceinline__ void wgmma_wait_all_after(float after) {
  asm volatile(
      "{\n"
      " .reg .pred p;\n"
      " setp.ne.b32 p, %0, 0xffffffff;\n"
      " @p wgmma.wait_group.sync.aligned 0;\n"
      " wgmma.wait_group.sync.aligned 0;\n"
      "}\n" ::"r"(__float_as_uint(after))
      : "memory");
}

// Programmatic dependent launch (sm_90). launch_dependents: this CTA lets the grid queued
// after it on the stream with the programmatic-serialization attribute start once every CTA
// of this grid has said so or exited; it orders no memory. grid_dependency_wait: blocks until
// the grids this one depends on have completed and their writes are visible; a no-op in a
// grid launched without the attribute.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// Nanoseconds since an arbitrary epoch, common to all SMs (trace mode only).
__device__ __forceinline__ int64_t globaltimer_ns() {
  int64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

}  // namespace dash::ptx
