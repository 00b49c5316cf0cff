// Compile-time description of the Hopper backward for one (head dim, mask, element type):
// tile sizes (from the generated config table), WGMMA tilings, shared-memory layouts and
// the shared-storage struct. Everything here is types and constants; no code runs.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/numeric_types.h>

#include "generated/tile_config.h"
#include "kernels/bwd_params.h"
#include "kernels/mma_utils.h"
#include "kernels/varlen.h"
#include "kernels/work_ring.h"
#include "schedule/schedule.h"

namespace dash {

using namespace cute;

// kVarlen_: a variable-length batch (BwdParams::cu_seqlens_q; kernels/varlen.h).
template <int kHeadDim_, bool Is_causal_, class Element_, bool kVarlen_ = false>
struct BwdTraits {
  using Config = BwdTileConfig<kHeadDim_, Is_causal_>;
  using Element = Element_;
  using ElementAccum = float;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool Is_causal = Is_causal_;
  static constexpr bool kVarlen = kVarlen_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int NumMmaWarpGroups = Config::NumMmaWarpGroups;
  static constexpr int NumMmaThreads = NumMmaWarpGroups * 128;
  static constexpr int NumThreads = NumMmaThreads + 128;  // + one producer warpgroup
  static constexpr int kStagesQ = Config::kStagesQ;
  static constexpr int kStagesdO = Config::kStagesdO;
  static constexpr int kStagesdS = Config::kStagesdS;
  static constexpr int kStagesdQ = Config::kStagesdQ;
  static constexpr int kExp2FmaEvery = Config::kExp2FmaEvery;  // see BwdTileConfig.exp2_fma_every
  static constexpr int kdQChains = Config::kdQChains;  // deterministic dQ accumulation chains
  static constexpr int kdKVChains = Config::kdKVChains;  // ordered GQA dK/dV accumulation chains (max)
  // Non-deterministic GQA groups of at most this many query heads sum dK/dV in the chains too.
  static constexpr int kNondetdKVChainsMaxGroup = Config::kNondetdKVChainsMaxGroup;
  // Which launches run the mainloop that loads a step's LSE into registers before its S^T GEMM
  // is issued (BwdMainKernel's kLseEarly; BwdTileConfig.lse_early_nondet / lse_early_det).
  static constexpr bool kLseEarlyNondet = Config::kLseEarlyNondet;
  static constexpr bool kLseEarlyDet = Config::kLseEarlyDet;
  static constexpr bool dQ_split_rows = Config::dQ_split_rows;
  static constexpr bool dQ_transposed = Config::dQ_transposed;  // dQ^T = K^T dS^T (BwdTileConfig.dq_transposed)

  static_assert(NumMmaWarpGroups == 2, "the register budget (24/240) assumes two MMA warpgroups");
  static_assert(kBlockN == 64 * NumMmaWarpGroups, "each MMA warpgroup owns 64 keys of the column");
  // Two dS buffers let tile t+1 write dS while a slower warpgroup still reads tile t's dS in
  // its dQ GEMM; with one buffer that write would need an extra barrier.
  static_assert(kStagesdS == 2, "the consumer's barrier placement assumes double-buffered dS");
  static_assert(kStagesQ == kStagesdO, "Q and dO advance in lock step");
  // The two dQ writers take alternate steps; with two staging buffers each writer owns one.
  static_assert(kStagesdQ == 1 || kStagesdQ == 2, "dQ staging: one buffer, or one per writer");

  // Register budget after setmaxnreg: 128*24 + 256*240 = 64512 = 384 threads * 168 (what
  // the launch allocates, so the MMA warpgroups' increase is always satisfiable).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kMmaRegisters = 240;

  // ---- WGMMA tilings -------------------------------------------------------------------
  // S^T = K Q^T and dP^T = V dO^T, keys on the M side: the accumulators hold P^T / dS^T,
  // whose register layout is directly the A operand of the dV / dK GEMMs (no shuffle).
  using AtomLayoutKeys = Layout<Shape<Int<NumMmaWarpGroups>, _1, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockM>, Int<kHeadDim>>,
                           GMMA::Major::K, GMMA::Major::K>(),
      AtomLayoutKeys{}));
  // dV += P^T dO and dK += dS^T Q: A (P^T, dS^T) from registers, B (dO^T, Q^T) from smem.
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDim>, Int<kBlockM>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayoutKeys{}));
  // dQ = dS K, dS read from smem (its rows are spread over both warpgroups' registers).
  // With kBlockM = 128 each warpgroup takes 64 query rows; with kBlockM = 64 each takes
  // half of the head dim. With a kBlockM that is not a multiple of 64 (80) the query rows
  // cannot be a WGMMA's M side: dQ^T = K^T dS^T instead, each warpgroup 64 head-dim rows
  // (A = K^T, MN-major view of sK) times all kBlockM queries (B = dS, K-major).
  static_assert(!dQ_transposed || kHeadDim == 64 * NumMmaWarpGroups,
                "transposed dQ splits the head dim into one 64-row WGMMA per warpgroup");
  using TileShapeAtomdQ = std::conditional_t<
      dQ_transposed, Shape<_64, Int<kBlockM>, Int<kBlockN>>,
      std::conditional_t<dQ_split_rows, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                         Shape<Int<kBlockM>, Int<kHeadDim / NumMmaWarpGroups>, Int<kBlockN>>>>;
  using AtomLayoutdQ = std::conditional_t<dQ_split_rows || dQ_transposed, Layout<Shape<Int<NumMmaWarpGroups>, _1, _1>>,
                                          Layout<Shape<_1, Int<NumMmaWarpGroups>, _1>>>;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, TileShapeAtomdQ,
                           dQ_transposed ? GMMA::Major::MN : GMMA::Major::K,
                           dQ_transposed ? GMMA::Major::K : GMMA::Major::MN>(),
      AtomLayoutdQ{}));
  // The dQ accumulator's (row, col) tile: (query, head dim), or (head dim, query) transposed.
  using TileShapedQAcc = std::conditional_t<dQ_transposed, Shape<Int<kHeadDim>, Int<kBlockM>>,
                                            Shape<Int<kBlockM>, Int<kHeadDim>>>;
  static_assert(kOneWgmmaWide<TiledMmaSdP, kBlockM> && kOneWgmmaWide<TiledMmadKV, kHeadDim> &&
                    kOneWgmmaWide<TiledMmadQ, size<1>(TileShapeAtomdQ{})>,
                "a GEMM tile would be split into narrow WGMMAs (mma_utils.h, kOneWgmmaWide)");

  // ---- Shared-memory layouts -----------------------------------------------------------
  // All operand tiles are K-major with the 128-byte swizzle (rows of 64 bf16). The
  // transposed views used as MN-major B operands are layout compositions over the same
  // bytes, not copies.
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesQ>>{}));
  using SmemLayoutdO = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesdO>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutdS = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kStagesdS>>{}));

  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStagesQ>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStagesdO>>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kStagesdS>>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kBlockN>>{})));

  // dS^T accumulator -> sdS with transposing stmatrix (keys are contiguous in sdS).
  static constexpr int kdSValuesPerThread = kBlockM * kBlockN / NumMmaThreads;
  static_assert(kdSValuesPerThread % 8 == 0);
  using SmemCopyAtomdS = Copy_Atom<SM90_U16x8_STSM_T, Element>;

  // dQ partial staging: per warpgroup a linear slice in which thread t stores its
  // accumulator values i = 4j..4j+3 as the float4 at index j*128 + t. The fp32 dQaccum
  // workspace receives these slices verbatim, so it is in this "fragment order" too;
  // the convert kernel undoes it with the same TiledMmadQ partition. Step g of a CTA uses
  // staging buffer g % kStagesdQ (warpgroup w's slice at (buffer * NumMmaWarpGroups + w)).
  static constexpr int kdQSliceFloats = kBlockM * kHeadDim / NumMmaWarpGroups;
  static constexpr int kdQValuesPerThread = kdQSliceFloats / 128;
  static_assert(kdQValuesPerThread % 4 == 0);

  // ---- TMA ---------------------------------------------------------------------------
  using ShapeBSHD = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen, d, head, batch)
  using StrideBSHD = Stride<int64_t, _1, int64_t, int64_t>;
  using TMA_QdO = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeBSHD{}, StrideBSHD{}),
      take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TMA_KV = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeBSHD{}, StrideBSHD{}),
      SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesRowStats = kBlockM * sizeof(float);  // one LSE or D tile

  // ---- Shared storage ------------------------------------------------------------------
  // 1024-byte alignment: the 128B swizzle pattern is a function of absolute smem address
  // bits 4..9, which TMA and WGMMA both assume start at a 1024-byte boundary.
  struct SharedStorage {
    alignas(1024) Element smem_k[cosize_v<SmemLayoutK>];
    alignas(1024) Element smem_v[cosize_v<SmemLayoutV>];
    alignas(1024) Element smem_q[cosize_v<SmemLayoutQ>];
    alignas(1024) Element smem_do[cosize_v<SmemLayoutdO>];
    alignas(1024) Element smem_ds[cosize_v<SmemLayoutdS>];
    alignas(128) float smem_dq[kStagesdQ * kBlockM * kHeadDim];
    alignas(128) float smem_lse[kStagesQ * kBlockM];
    alignas(128) float smem_dpsum[kStagesdO * kBlockM];
    alignas(8) uint64_t bar_k_full;
    uint64_t bar_v_full;
    uint64_t bar_k_empty;
    uint64_t bar_v_empty;
    uint64_t bar_q_full[kStagesQ];
    uint64_t bar_q_empty[kStagesQ];
    uint64_t bar_do_full[kStagesdO];
    uint64_t bar_do_empty[kStagesdO];
    WorkRingT<ScheduledColumn> work;  // producer -> MMA warpgroups + dQ writers: the CTA's next column
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared storage exceeds the sm_90 per-block limit");

  // ---- Kernel parameters -----------------------------------------------------------------
  // Filled member by member by the launch layer (bwd_launch.h); the tile geometry lives in
  // the schedule only.
  template <class Schedule>
  struct MainParams {
    TMA_QdO tma_q, tma_do;
    TMA_KV tma_k, tma_v;
    ShapeBSHD shape_q, shape_k;
    float const* lse_log2;  // (b, h, seqlen_q_rounded); varlen (h, tiles per head * kBlockM)
    float const* dpsum;
    int64_t stats_bh_stride;  // = seqlen_q_rounded (varlen: per head, dq_tiles_per_head * kBlockM)
    float* dq_accum;
    int* dq_semaphore;
    int dq_chain_tiles;  // deterministic: chain c of dQ tile t is tile c * dq_chain_tiles + t
    int* counters;  // BwdCounter: work items claimed, trace records; zeroed by the preprocess kernel
    Element* dk;
    Element* dv;
    BSHDStrides dk_strides, dv_strides;
    float* dk_accum;  // GQA: fp32 group sums (chains of k's shape); null without GQA
    float* dv_accum;
    BSHDStrides dkv_accum_strides;  // of one chain
    int64_t dkv_chain_stride;       // floats from one chain to the next
    bool dkv_ordered;               // GQA: chains (bwd_params.h dkv_ordered_for), else adds
    int dkv_chains;                 // GQA + ordered: chains of heads 0 ... G - 2 (store_dkv)
    int* dkv_semaphore;             // GQA + ordered: (b, heads_k, num_n_blocks, dkv_chains)
    BwdTraceRecord* trace;  // trace mode, else null
    int64_t trace_capacity;
    float softmax_scale;
    float softmax_scale_log2;
    int num_heads, num_heads_k, heads_per_kv_head;
    bool deterministic;
    Schedule schedule;
    // kVarlen only: the sequences' first rows ((batch + 1) each); shape_q / shape_k are then
    // (total rows, d, heads, 1) and the schedule's geometry is the longest sequence's.
    int const* cu_seqlens_q;
    int const* cu_seqlens_k;
    // kVarlen only: the workspace's Q tiles per head (kernels/varlen.h), as a parameter: the dQ
    // writer multiplies by it straight from the constant bank (a value derived in the kernel
    // took a register, which spilled beside the sequence's lengths in the writer's 24). The
    // LSE / D rows of head h start at h * stats_bh_stride, which is this times kBlockM.
    int dq_tiles_per_head;
    // kVarlen only: the columns inside their sequence's keys, in claim order, then their count
    // (num_columns + 1 ints, written by bwd_varlen_live_columns_kernel before this kernel runs).
    int const* live_columns;
  };
};

// Named barriers (id 0 is __syncthreads).
enum class BwdBarrier : uint32_t {
  kdSReady = 1,     // all MMA threads: dS of both warpgroups is in smem
  kdQEmpty0 = 2,    // + 2w + p: warpgroup w's dQ staging slice may be overwritten (MMA WG + the writer of parity p)
  kdQFull0 = 6,     // + 2w + p: warpgroup w's slice holds the partial of a step of parity p (MMA WG + that writer)
  kdKVOrder = 10,   // all MMA threads: GQA dK/dV adds, around the group's turn (store_dkv)
};

}  // namespace dash
