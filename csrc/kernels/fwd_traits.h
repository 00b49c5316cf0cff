// Compile-time description of the Hopper forward for one (head dim, mask, element type):
// tile sizes (from the generated config table), WGMMA tilings, shared-memory layouts, the
// shared-storage struct and the kernel parameters. Types and constants only.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/numeric_types.h>

#include "generated/tile_config.h"
#include "kernels/fwd_params.h"
#include "kernels/mma_utils.h"
#include "kernels/persistent_shell.h"  // launch_registers_per_thread
#include "kernels/varlen.h"
#include "kernels/work_ring.h"
#include "schedule/fwd_tile_order.h"  // FwdTileOrder
#include "schedule/schedule.h"  // TileGeometryT

namespace dash {

using namespace cute;

// A varlen Q tile as the producer hands it to the MMA warpgroups: the work item, and where the
// tile's sequence lies (read from cu_seqlens once per tile, by the producer).
struct FwdSeqTile {
  int item;    // >= the order's num_tiles: no more work
  int bh, m;   // FwdTileOrder::tile(item)
  SeqPlace seq;
};

// A padded Q tile as the producer hands it to the MMA warpgroups when the tile ends with a TMA
// store (FwdTileConfig.kTmaStoreOut): the work item and its Q tile decoded once
// (FwdTileOrder::tile and the batch / head split are integer divisions that every MMA warp
// repeated per tile otherwise, ~90 instructions).
struct FwdWorkItem {
  int t;           // >= the order's num_tiles: no more work
  int bh, m_pair;  // FwdTileOrder::tile(t) (m_pair: the order's Q block, a pair of tiles with clusters)
  int b, h;        // bh = b * num_heads + h
};

// Stands in for the output's TMA descriptor in kernels that store rows from registers.
struct NoTmaStore {};

// kClusterM_ = 2: the kernel runs in clusters of two CTAs that work on adjacent Q tiles of one
// head (tiles 2p and 2p + 1 of the pair order) and load every K and V block once for both:
// each CTA's producer loads half of the block and multicasts it into both CTAs' shared memory
// (FwdTileConfig.kv_multicast says where this pays). Full masks only: both tiles of a pair
// then walk the same KV blocks in lockstep.
// kVarlen_: a variable-length batch (FwdParams::cu_seqlens_q): the sequences lie packed along
// the rows of q, k, v and out, and each Q tile reads its sequence's offsets and lengths.
template <int kHeadDim_, bool Is_causal_, class Element_, int kClusterM_ = 1, bool kVarlen_ = false>
struct FwdTraits {
  using Config = FwdTileConfig<kHeadDim_, Is_causal_>;
  using Element = Element_;
  using ElementAccum = float;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool Is_causal = Is_causal_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int NumMmaWarpGroups = Config::NumMmaWarpGroups;
  static constexpr int NumMmaThreads = NumMmaWarpGroups * 128;
  static constexpr int NumThreads = NumMmaThreads + 128;  // + one producer warpgroup
  static constexpr int kStages = Config::kStagesKV;
  static constexpr int kStagesQ = Config::kStagesQ;
  static constexpr bool kPingPong = Config::kPingPong && NumMmaWarpGroups > 1;
  static constexpr bool kOverlapTileEnd = Config::kOverlapTileEnd;
  static constexpr bool kWaitVInTurn = Config::kWaitVInTurn;
  static constexpr bool kConditionalRescale = Config::kConditionalRescale;
  static constexpr float kRescaleMaxGrowthLog2 = Config::kRescaleMaxGrowthLog2;
  // Lazy block max (FwdTileConfig.lazy_max_sum_log2): raised by the conditional rule's growth.
  static constexpr bool kLazyMax = Config::kLazyMax;
  static constexpr float kLazyMaxSumBound = Config::kLazyMaxSumBound;
  static_assert(!kLazyMax || kConditionalRescale, "the lazy block max raises by the conditional rescale's rule");
  static constexpr long long kL2SectionBytes = Config::kL2SectionBytes;
  static constexpr int kClusterM = kClusterM_;
  static_assert(kClusterM == 1 || (kClusterM == 2 && !Is_causal),
                "K/V multicast pairs Q tiles that walk the same KV blocks: full masks, clusters of 2");
  static constexpr bool kVarlen = kVarlen_;
  static_assert(!kVarlen || kClusterM == 1, "a varlen pair of Q tiles may span two sequences: one CTA per tile");
  // The tile's end (FwdTileConfig.kTmaStoreOut): output rows staged in shared memory and stored
  // by TMA, the decoded tile handed over by the producer. Varlen keeps the row stores: a TMA
  // store of a tile's 64 rows would overwrite the next sequence's first rows.
  static constexpr bool kTmaStoreOut = Config::kTmaStoreOut && !kVarlen;
  static constexpr bool kRowLimitMask = Config::kRowLimitMask;
  // FwdTileConfig.pv_wait_after_exp2 (0: none): a middle block waits for its P V GEMM after
  // this many of the thread's exponentials (fewer than its kBlockN / 2: exp2_rows asserts it).
  static constexpr int kPvWaitAfterExp2 = Config::kPvWaitAfterExp2;
  static_assert(kPvWaitAfterExp2 == 0 || !kLazyMax, "the placed P V wait is the exact softmax's");
  static constexpr int kMmaRegisters = Config::kMmaRegisters;
  // Varlen: what the CTA's launch budget leaves beside the MMA warpgroups, up to 32 (hdim 64:
  // 4 x 128 - 3 x 160 = 32; hdim 128: 3 x 168 - 2 x 240 = 24; launch_registers_per_thread says
  // why the budget is binding). The varlen producer decodes each claimed item's sequence, section
  // width and tile (FwdTileOrder::tile_in_sequence); at 24 registers the hdim-64 full-mask kernel
  // spilled 8 B of pipeline state per tile.
  static constexpr int kRegistersLeft =
      launch_registers_per_thread(NumMmaWarpGroups + 1) * (NumMmaWarpGroups + 1) - NumMmaWarpGroups * kMmaRegisters;
  static constexpr int kProducerRegisters = kVarlen ? (kRegistersLeft < 32 ? kRegistersLeft : 32) : 24;
  static_assert(kBlockM == 64 * NumMmaWarpGroups, "each MMA warpgroup owns 64 rows of the Q tile");
  static_assert(NumMmaWarpGroups <= 4, "named barriers kTurn0 + w, kOutSlab0 + w and kLazyMaxVote0 + w (FwdBarrier)");

  // ---- WGMMA tilings -------------------------------------------------------------------
  // S = Q K^T: Q and K from smem. O += P V: P from registers (the S accumulator converted
  // in place, no smem round trip), V^T as an MN-major view of the K-major V tile.
  using AtomLayoutRows = Layout<Shape<Int<NumMmaWarpGroups>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockN>, Int<kHeadDim>>,
                           GMMA::Major::K, GMMA::Major::K>(),
      AtomLayoutRows{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayoutRows{}));
  static_assert(kOneWgmmaWide<TiledMmaQK, kBlockN> && kOneWgmmaWide<TiledMmaPV, kHeadDim>,
                "a GEMM tile would be split into narrow WGMMAs (mma_utils.h, kOneWgmmaWide)");

  // ---- Shared-memory layouts -----------------------------------------------------------
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesQ>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                 Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));

  // The output tile staged for the TMA store (kTmaStoreOut): one 64-row slab per MMA warpgroup
  // (each stores its own rows when its softmax is done), slabs one after another.
  using SmemLayoutOSlab = decltype(tile_to_shape(SmemAtom{}, Shape<_64, Int<kHeadDim>>{}));
  using SmemLayoutO = decltype(tile_to_shape(SmemLayoutOSlab{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  static constexpr int kSlabElemsO = cosize_v<SmemLayoutOSlab>;

  // ---- TMA -------------------------------------------------------------------------------
  using ShapeBSHD = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen, d, head, batch)
  using StrideBSHD = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeBSHD{},
                                          StrideBSHD{}));
  using TMA_Q = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                       Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  // K and V: with a cluster, each CTA's TMA loads 1/kClusterM of the block and multicasts it.
  using TmaKVOp = std::conditional_t<kClusterM == 1, SM90_TMA_LOAD, SM90_TMA_LOAD_MULTICAST>;
  using TMA_KV = decltype(make_tma_copy(TmaKVOp{}, GmemTensor{}, take<0, 2>(SmemLayoutK{}),
                                        Shape<Int<kBlockN>, Int<kHeadDim>>{}, Int<kClusterM>{}));
  using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeBSHD{},
                                             StrideBSHD{}));
  using TMA_O = std::conditional_t<kTmaStoreOut,
                                   decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutOSlab{},
                                                          Shape<_64, Int<kHeadDim>>{}, _1{})),
                                   NoTmaStore>;
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  // Bytes that land in one CTA's K (or V) stage: the whole block, its own slice and its peers'.
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);

  // ---- Shared storage --------------------------------------------------------------------
  // 1024-byte alignment: the 128B swizzle is a function of absolute smem address bits.
  struct SharedStorage {
    alignas(1024) Element smem_q[cosize_v<SmemLayoutQ>];
    alignas(1024) Element smem_k[cosize_v<SmemLayoutK>];
    alignas(1024) Element smem_v[cosize_v<SmemLayoutV>];
    alignas(1024) Element smem_o[kTmaStoreOut ? cosize_v<SmemLayoutO> : 8];  // 8: unused
    alignas(8) uint64_t bar_q_full[kStagesQ];
    uint64_t bar_q_empty[kStagesQ];
    uint64_t bar_k_full[kStages];
    uint64_t bar_k_empty[kStages];
    uint64_t bar_v_full[kStages];
    uint64_t bar_v_empty[kStages];
    // producer -> MMA warpgroups: the CTA's next Q tile; varlen: with its sequence's place;
    // with the TMA-store tile end: decoded
    WorkRingT<std::conditional_t<kVarlen, FwdSeqTile, std::conditional_t<kTmaStoreOut, FwdWorkItem, int>>> work;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared storage exceeds the sm_90 per-block limit");

  struct MainParams {
    TMA_Q tma_q;
    TMA_KV tma_k, tma_v;
    ShapeBSHD shape_q, shape_k;
    Element* out;
    BSHDStrides out_strides;
    float* lse;  // (b, h, seqlen_q) contiguous
    float softmax_scale_log2;
    TileGeometryT<StaticBlocks<kBlockM, kBlockN>> geo;  // KV blocks per Q tile, which blocks need a mask
    int num_heads, heads_per_kv_head;
    FwdTileOrder order;  // with kClusterM = 2: the order of tile pairs (num_m_blocks / 2 per head)
    int* tile_counter;   // work items claimed beyond the first gridDim.x; zero at launch (kClusterM = 1)
    // kVarlen only (FwdParams): each sequence's first row in the packed q / k ((batch + 1) each),
    // and lse's head stride (total_q: lse is (heads, total_q)). shape_q / shape_k are then
    // (total rows, d, heads, 1) and geo holds the longest sequence's lengths.
    int const* cu_seqlens_q;
    int const* cu_seqlens_k;
    int64_t lse_head_stride;
    // kTmaStoreOut only: out (seqlen_q, d, heads, batch) as the epilogue's TMA store
    // destination. Last, so that the other fields keep their constant-bank offsets.
    TMA_O tma_o;
  };
};

// Named barriers of the forward (id 0 is __syncthreads): kTurn0 + w is MMA warpgroup w's
// turn to issue its GEMMs (ping-pong); kOutSlab0 + w gathers warpgroup w's 128 threads around
// the staging of its output slab (kTmaStoreOut).
// Named barriers of the MMA warpgroups, four ids per kind (one per warpgroup); id 0 is
// __syncthreads and the hardware has 16.
enum class FwdBarrier : uint32_t { kTurn0 = 1, kOutSlab0 = 5, kLazyMaxVote0 = 9 };

}  // namespace dash
