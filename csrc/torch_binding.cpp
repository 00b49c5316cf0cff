// torch op layer: the dash::fwd and dash::bwd schemas, argument checks, workspace from PyTorch's caching
// allocator, and the call into the kernel library (bwd_api.h). The Python layer
// (dash/interface.py) validates first with friendlier messages; these checks guard direct
// calls of torch.ops.dash.bwd.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <nvtx3/nvToolsExt.h>

#include <cstdlib>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

#include "bwd_api.h"
#include "fwd_api.h"

namespace {

using at::Tensor;

// An NVTX range per op call on the calling thread, named by kernel, problem and schedule,
// so that nsys timelines and `nsys stats --report nvtx_sum` tell DASH's calls apart (two
// layers of different shapes get different names). nvtxRangePushA is a no-op unless a
// profiler is attached; the name costs a few string appends.
struct NvtxRange {
  explicit NvtxRange(std::string const& name) { nvtxRangePushA(name.c_str()); }
  ~NvtxRange() { nvtxRangePop(); }
};

// "hd128 bf16 causal b4 h16/4 sq4096 sk4096" (the KV heads only under GQA).
std::string problem_label(Tensor const& q, Tensor const& k, bool causal) {
  std::string s = "hd" + std::to_string(q.size(3)) + (q.scalar_type() == at::kHalf ? " fp16" : " bf16") +
                  (causal ? " causal" : " full") + " b" + std::to_string(q.size(0)) + " h" +
                  std::to_string(q.size(2));
  if (k.size(2) != q.size(2)) { s += "/" + std::to_string(k.size(2)); }
  return s + " sq" + std::to_string(q.size(1)) + " sk" + std::to_string(k.size(1));
}

dash::BSHDStrides bshd_strides(Tensor const& t) {
  return {t.stride(0), t.stride(1), t.stride(2)};
}

// `op` ("dash.fwd", "dash.bwd") prefixes every message of the checks below.
void check_bshd(char const* op, Tensor const& t, char const* name) {
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must have 4 dims (batch, seqlen, heads, head_dim), got ", t.dim());
  TORCH_CHECK(t.stride(3) == 1, op, ": ", name, " must be contiguous in its last dim, got stride ", t.stride(3));
  // TMA needs 16-byte aligned base addresses and strides.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
              " must start 16-byte aligned (TMA), got a data pointer at storage offset ", t.storage_offset(),
              " elements; pass a copy (.clone())");
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK((t.stride(d) * t.element_size()) % 16 == 0 || t.size(d) == 1, op, ": ", name, " stride ",
                t.stride(d), " of dim ", d, " must be a multiple of 16 bytes");
  }
}

// What both ops check of q, k, v and the device, and the problem fields every params
// struct (dash::FwdParams, dash::BwdParams) shares: shape, dtype, grid, and the q, k, v
// pointers and strides.
struct Problem {
  dash::DType dtype;
  int64_t batch, seqlen_q, seqlen_k, heads, heads_k, head_dim;
  int num_ctas_max;  // SMs the persistent grid may use

  template <class Params>
  void fill(Params& p, Tensor const& q, Tensor const& k, Tensor const& v) const {
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.q_strides = bshd_strides(q);
    p.k_strides = bshd_strides(k);
    p.v_strides = bshd_strides(v);
    p.dtype = dtype;
    p.batch = int(batch);
    p.seqlen_q = int(seqlen_q);
    p.seqlen_k = int(seqlen_k);
    p.num_heads = int(heads);
    p.num_heads_k = int(heads_k);
    p.head_dim = int(head_dim);
    p.num_ctas_max = num_ctas_max;
  }
};

// Call under a CUDAGuard for q's device (the device properties are the current device's).
Problem check_problem(char const* op, Tensor const& q, Tensor const& k, Tensor const& v, int64_t sm_margin) {
  for (auto const& [name, t] : {std::pair<char const*, Tensor const*>{"q", &q}, {"k", &k}, {"v", &v}}) {
    TORCH_CHECK(t->is_cuda(), op, ": ", name, " must be on a CUDA device, got ", t->device());
    TORCH_CHECK(t->device() == q.device(), op, ": ", name, " is on ", t->device(), " but q on ", q.device(),
                "; q, k, v must be on one device");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), op, ": ", name, " is ", t->scalar_type(), " but q ",
                q.scalar_type(), "; q, k, v must share one dtype");
  }
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, op,
              ": dtype must be bfloat16 or float16, got ", q.scalar_type());
  check_bshd(op, q, "q");
  check_bshd(op, k, "k");
  check_bshd(op, v, "v");
  Problem pr;
  pr.dtype = q.scalar_type() == at::kBFloat16 ? dash::DType::kBFloat16 : dash::DType::kFloat16;
  pr.batch = q.size(0);
  pr.seqlen_q = q.size(1);
  pr.heads = q.size(2);
  pr.head_dim = q.size(3);
  pr.seqlen_k = k.size(1);
  pr.heads_k = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k and v must have the same shape, got k ", k.sizes(), " and v ",
              v.sizes());
  TORCH_CHECK(k.size(0) == pr.batch && k.size(3) == pr.head_dim, op,
              ": k must be (batch, seqlen_k, heads_k, head_dim) with q's batch and head_dim, got q ", q.sizes(),
              " and k ", k.sizes());
  TORCH_CHECK(pr.heads_k > 0 && pr.heads % pr.heads_k == 0, op, ": heads of q (", pr.heads,
              ") must be divisible by heads of k/v (", pr.heads_k, ")");
  TORCH_CHECK(pr.batch > 0 && pr.seqlen_q > 0 && pr.seqlen_k > 0 && pr.heads > 0, op,
              ": empty inputs are not supported, got q ", q.sizes(), " and k ", k.sizes());
  TORCH_CHECK(pr.seqlen_q < (1 << 30) && pr.seqlen_k < (1 << 30), op, ": seqlen_q=", pr.seqlen_q, " and seqlen_k=",
              pr.seqlen_k, " must each be below 2^30");
  auto const* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(props->major == 9 && props->minor == 0, op,
              ": needs a compute capability 9.0 GPU (H100/H200/H800/H20), got ", props->name, " with ",
              props->major, ".", props->minor);
  TORCH_CHECK(sm_margin >= 0 && sm_margin < props->multiProcessorCount, op, ": sm_margin=", sm_margin,
              " must be in [0, ", props->multiProcessorCount, ")");
  pr.num_ctas_max = int(props->multiProcessorCount - sm_margin);
  TORCH_CHECK(dash::bwd_is_built(int(pr.head_dim), pr.dtype), op, ": head_dim=", pr.head_dim, " with dtype ",
              q.scalar_type(), " is not built; built head dims: ", dash::bwd_built_head_dims(),
              "; built dtypes: ", dash::bwd_built_dtypes());
  return pr;
}

// Test hook: DASH_POISON_OUTPUTS=1 fills the outputs with NaN (all-ones bytes) on the stream
// before the launch, so a test can prove the kernels wrote every element. Read per call: the
// tests switch it between calls.
bool poison_requested() {
  char const* poison = std::getenv("DASH_POISON_OUTPUTS");
  return poison != nullptr && poison[0] == '1';
}

void poison_outputs_if_requested(std::initializer_list<Tensor*> outputs) {
  if (!poison_requested()) { return; }
  for (Tensor* t : outputs) {
    if (t->defined()) {
      C10_CUDA_CHECK(cudaMemsetAsync(t->data_ptr(), 0xFF, t->nbytes(), at::cuda::getCurrentCUDAStream()));
    }
  }
}

// The same hook for the backward's fp32 dQ accumulators: every chain's first contribution
// stores, later ones add, the preprocess zeroes what the non-deterministic mode adds into,
// and the convert reads only chains that received a store. NaN there makes the test catch a
// chain read before any store (or a missing zeroing), which fresh, usually-zero workspace
// memory from the caching allocator would hide.
void poison_dq_accum_if_requested(dash::BwdParams const& p) {
  if (!poison_requested()) { return; }
  size_t const bytes = dash::bwd_workspace_sizes(p).dq_accum_floats * sizeof(float);
  C10_CUDA_CHECK(cudaMemsetAsync(p.dq_accum, 0xFF, bytes, at::cuda::getCurrentCUDAStream()));
}

// `op` names the caller: dash.fwd carries the schedule for the backward it saves, so a bad
// one is refused there, before the forward's activations are kept for a backward that cannot run.
dash::BwdScheduleKind parse_schedule(char const* op, c10::string_view schedule, bool causal) {
  dash::BwdScheduleKind kind;
  if (schedule == "fa3") {
    kind = dash::BwdScheduleKind::kFa3;
  } else if (schedule == "interleaved") {
    kind = dash::BwdScheduleKind::kInterleaved;
  } else if (schedule == "descending") {
    kind = dash::BwdScheduleKind::kDescending;
  } else if (schedule == "shift") {
    kind = dash::BwdScheduleKind::kShift;
  } else {
    TORCH_CHECK_NOT_IMPLEMENTED(false, op, ": schedule '", std::string(schedule),
                                "' is not implemented by the kernel; implemented: fa3, interleaved, descending, shift");
  }
  // NotImplementedError, as the Python layer raises for the same request.
  TORCH_CHECK_NOT_IMPLEMENTED(!(causal && kind == dash::BwdScheduleKind::kShift), op,
                              ": schedule 'shift' is for full masks; for causal use 'descending', 'interleaved', "
                              "'fa3' or 'auto'");
  return kind;
}

// A gradient reaches the backward as whatever view the autograd graph produced: cat's or
// narrow's backward hands over a contiguous slice at an arbitrary storage offset, which the
// TMA loads cannot take and the caller cannot change. Such a tensor is copied; an aligned one
// is used in place.
Tensor tma_ready(Tensor const& t) {
  Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// The library reports problems it cannot run as std::invalid_argument (a value outside what
// is supported) and anything else (a CUDA error, a grid that does not fit) as another
// exception; torch gets them as ValueError / RuntimeError, like the Python layer's checks.
template <class F>
void call_library(F&& f) {
  try {
    f();
  } catch (std::invalid_argument const& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (std::exception const& e) {
    TORCH_CHECK(false, e.what());
  }
}

// flash_attn_varlen_func's batch description (FwdParams / BwdParams): int32 offsets of the
// sequences in the packed rows and the longest lengths. Its checks (values are not read on the
// host: that would synchronise; the Python layer checks offsets on the CPU).
struct VarlenBatch {
  Tensor cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;

  int64_t batch() const { return cu_seqlens_q.size(0) - 1; }

  void check(char const* op, Tensor const& q, Tensor const& k) const {
    for (auto const& [name, t] :
         {std::pair<char const*, Tensor const*>{"cu_seqlens_q", &cu_seqlens_q}, {"cu_seqlens_k", &cu_seqlens_k}}) {
      TORCH_CHECK(t->scalar_type() == at::kInt, op, ": ", name, " must be int32, got ", t->scalar_type());
      TORCH_CHECK(t->dim() == 1 && t->size(0) >= 2, op, ": ", name,
                  " must be 1-D with batch + 1 >= 2 entries, got shape ", t->sizes());
      TORCH_CHECK(t->device() == q.device(), op, ": ", name, " is on ", t->device(), " but q on ", q.device());
      TORCH_CHECK(t->is_contiguous(), op, ": ", name, " must be contiguous");
    }
    TORCH_CHECK(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), op, ": cu_seqlens_q has ", cu_seqlens_q.size(0),
                " entries and cu_seqlens_k ", cu_seqlens_k.size(0), "; both must be batch + 1");
    TORCH_CHECK(max_seqlen_q >= 1 && max_seqlen_q < (1 << 30) && max_seqlen_k >= 1 && max_seqlen_k < (1 << 30), op,
                ": max_seqlen_q=", max_seqlen_q, " and max_seqlen_k=", max_seqlen_k, " must each be in [1, 2^30)");
    TORCH_CHECK(q.size(0) < (int64_t(1) << 31) && k.size(0) < (int64_t(1) << 31), op, ": total_q=", q.size(0),
                " and total_k=", k.size(0), " must each be below 2^31");
  }

  // The packed problem as `pr` (checked as one batch of total rows) describes it, made varlen.
  template <class Params>
  void fill(Params& p, Tensor const& q, Tensor const& k) const {
    p.batch = int(batch());
    p.seqlen_q = int(max_seqlen_q);
    p.seqlen_k = int(max_seqlen_k);
    p.total_q = int(q.size(0));
    p.total_k = int(k.size(0));
    p.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
    p.cu_seqlens_k = cu_seqlens_k.data_ptr<int>();
  }

  std::string label(Tensor const& q, bool causal) const {
    return "hd" + std::to_string(q.size(2)) + (q.scalar_type() == at::kHalf ? " fp16" : " bf16") +
           (causal ? " causal" : " full") + " varlen b" + std::to_string(batch()) + " h" + std::to_string(q.size(1)) +
           " maxsq" + std::to_string(max_seqlen_q) + " maxsk" + std::to_string(max_seqlen_k);
  }
};

// The backward; with `trace`, also the per-step trace as an int64 (steps, 8) tensor of
// dash::BwdTraceRecord rows (unwritten rows stay -1). With `varlen` (dash.bwd_varlen) the
// tensors are packed (total rows, heads, head_dim) and softmax_lse is (heads, total_q).
std::tuple<Tensor, Tensor, Tensor, Tensor> run_backward(Tensor const& dout_in, Tensor const& q, Tensor const& k,
                                                        Tensor const& v, Tensor const& out_in,
                                                        Tensor const& softmax_lse,
                                                        double softmax_scale, bool causal, bool deterministic,
                                                        c10::string_view schedule, int64_t sm_margin, bool trace,
                                                        VarlenBatch const* varlen = nullptr) {
  char const* op = varlen ? "dash.bwd_varlen" : "dash.bwd";
  dash::BwdScheduleKind const kind = parse_schedule(op, schedule, causal);
  int64_t const dims = varlen ? 3 : 4;
  for (auto const* t : {&dout_in, &q, &k, &v, &out_in}) {
    TORCH_CHECK(t->dim() == dims, op, ": q, k, v, out, dout must have ",
                varlen ? "3 dims (total_tokens, heads, head_dim)" : "4 dims (batch, seqlen, heads, head_dim)",
                ", got ", t->sizes());
  }
  if (varlen) {
    varlen->check(op, q, k);
    TORCH_CHECK(!trace, op, ": no trace of a varlen backward");
    TORCH_CHECK(kind != dash::BwdScheduleKind::kShift, op,
                ": schedule 'shift' is not built for varlen batches; use 'fa3', 'interleaved', 'descending' or 'auto'");
  }
  // Varlen tensors as one batch of total rows, for the checks and strides of the padded op.
  auto as_bshd = [&](Tensor const& t) { return varlen ? t.unsqueeze(0) : t; };
  // Opened before the GQA accumulators are zero-filled, so those fills count as the op's.
  NvtxRange range(std::string(op) + " " + (varlen ? varlen->label(q, causal) : problem_label(q, k, causal)) +
                  (deterministic ? " det " : " nondet ") + std::string(schedule) + (trace ? " trace" : ""));
  c10::cuda::CUDAGuard device_guard(q.device());
  Problem const pr = check_problem(op, as_bshd(q), as_bshd(k), as_bshd(v), sm_margin);
  for (auto const& [name, t] : {std::pair<char const*, Tensor const*>{"out", &out_in}, {"dout", &dout_in}}) {
    TORCH_CHECK(t->is_cuda() && t->device() == q.device(), op, ": ", name, " must be on q's device (",
                q.device(), "), got ", t->device());
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), op, ": ", name, " must have q's dtype (", q.scalar_type(),
                "), got ", t->scalar_type());
    TORCH_CHECK(t->sizes() == q.sizes(), op, ": ", name, " must have q's shape ", q.sizes(), ", got ",
                t->sizes());
  }
  Tensor const out = tma_ready(out_in);
  Tensor const dout = tma_ready(dout_in);
  check_bshd(op, as_bshd(out), "out");
  check_bshd(op, as_bshd(dout), "dout");
  int64_t const batch = varlen ? varlen->batch() : pr.batch, seqlen_q = pr.seqlen_q, heads = pr.heads;
  int64_t const heads_k = pr.heads_k;
  if (varlen) {
    TORCH_CHECK(softmax_lse.scalar_type() == at::kFloat && softmax_lse.dim() == 2 && softmax_lse.size(0) == heads &&
                    softmax_lse.size(1) == seqlen_q && softmax_lse.stride(1) == 1,
                op, ": softmax_lse must be float32 (heads, total_q) = (", heads, ", ", seqlen_q,
                ") with unit row stride, got ", softmax_lse.scalar_type(), " ", softmax_lse.sizes(), " strides ",
                softmax_lse.strides());
  } else {
    TORCH_CHECK(softmax_lse.scalar_type() == at::kFloat && softmax_lse.dim() == 3 && softmax_lse.size(0) == batch &&
                    softmax_lse.size(1) == heads && softmax_lse.size(2) == seqlen_q && softmax_lse.stride(2) == 1,
                op, ": softmax_lse must be float32 (batch, heads, seqlen_q) = (", batch, ", ", heads, ", ", seqlen_q,
                ") with unit seqlen stride, got ", softmax_lse.scalar_type(), " ", softmax_lse.sizes(), " strides ",
                softmax_lse.strides());
  }
  TORCH_CHECK(softmax_lse.device() == q.device(), op, ": softmax_lse must be on q's device (", q.device(),
              "), got ", softmax_lse.device());
  TORCH_CHECK(batch <= 65535 && heads <= 65535, op, ": batch (", batch, ") and heads (", heads,
              ") must each be at most 65535");

  dash::BwdParams p;
  pr.fill(p, as_bshd(q), as_bshd(k), as_bshd(v));
  if (varlen) { varlen->fill(p, q, k); }  // batch and the longest lengths size the grids below
  // Before any sizing call below: the tile shape (bwd_block_n) may depend on the mask.
  p.causal = causal;
  p.deterministic = deterministic;
  p.schedule = kind;
  p.convert_under_main = sm_margin == 0;  // bwd_params.h: waiting CTAs would sit on the SMs left free

  Tensor dq = at::empty_like(q);
  bool const gqa = heads != heads_k;
  // empty_like keeps k's and v's layout (a permuted k gets a permuted dk), as the op's fake
  // for torch.compile promises.
  Tensor dk = at::empty_like(k);
  Tensor dv = at::empty_like(v);
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dk_strides = bshd_strides(as_bshd(dk));
  p.dv_strides = bshd_strides(as_bshd(dv));
  Tensor dk_accum, dv_accum, dkv_semaphore;
  bool const dkv_ordered = gqa && dash::bwd_dkv_ordered(p);
  if (gqa) {
    // The query heads of a KV group sum their dK/dV in fp32 in the kernel (csrc/kernels/
    // bwd_epilogue.h, store_dkv). Ordered (deterministic, or a small group): in chains that the
    // group's last query head sums into dk/dv (any contents: each chain's first add stores).
    // Otherwise: adds into one zeroed accumulator, cast below.
    auto const f32 = k.options().dtype(at::kFloat);
    int64_t const chains = dkv_ordered ? dash::bwd_dkv_chains(p) : 1;
    int64_t const numel = k.numel();  // (batch, seqlen_k, heads_k, d), or varlen (total_k, heads_k, d)
    // dK's chains, then dV's: one allocation (and, unordered, one fill).
    Tensor const dkv_accum = dkv_ordered ? at::empty({2, chains * numel}, f32) : at::zeros({2, numel}, f32);
    dk_accum = dkv_accum[0];
    dv_accum = dkv_accum[1];
    p.dk_accum = dk_accum.data_ptr<float>();
    p.dv_accum = dv_accum.data_ptr<float>();
    p.dkv_accum_strides = bshd_strides(as_bshd(dk_accum.narrow(0, 0, numel).view(k.sizes())));
    p.dkv_chain_stride = numel;
    if (dkv_ordered) {  // the chains' turn counters; unordered adds need none
      int64_t const block_n = dash::bwd_block_n(p);
      int64_t const n_blocks = (int64_t(p.seqlen_k) + block_n - 1) / block_n;  // varlen: the longest sequence's
      dkv_semaphore = at::zeros({batch * heads_k * n_blocks * chains}, k.options().dtype(at::kInt));
      p.dkv_semaphore = dkv_semaphore.data_ptr<int>();
    }
  }

  p.out = out.data_ptr();
  p.dout = dout.data_ptr();
  p.out_strides = bshd_strides(as_bshd(out));
  p.dout_strides = bshd_strides(as_bshd(dout));
  p.dq = dq.data_ptr();
  p.dq_strides = bshd_strides(as_bshd(dq));
  p.lse = softmax_lse.data_ptr<float>();
  p.lse_batch_stride = varlen ? 0 : softmax_lse.stride(0);
  p.lse_head_stride = varlen ? softmax_lse.stride(0) : softmax_lse.stride(1);
  p.softmax_scale = float(softmax_scale);

  Tensor workspace = at::empty({int64_t(dash::bwd_workspace_bytes(p) / 4)}, q.options().dtype(at::kFloat));
  dash::bwd_set_workspace(p, workspace.data_ptr());

  Tensor trace_records;
  if (trace) {
    int64_t const steps = dash::bwd_trace_steps(p);
    trace_records = at::full({steps, int64_t(sizeof(dash::BwdTraceRecord) / 8)}, -1, q.options().dtype(at::kLong));
    p.trace = reinterpret_cast<dash::BwdTraceRecord*>(trace_records.data_ptr<int64_t>());
    p.trace_capacity = steps;
  } else {
    trace_records = at::empty({0, int64_t(sizeof(dash::BwdTraceRecord) / 8)}, q.options().dtype(at::kLong));
  }

  poison_outputs_if_requested({&dq, &dk, &dv});
  poison_dq_accum_if_requested(p);
  call_library([&] { dash::run_bwd(p, at::cuda::getCurrentCUDAStream()); });
  if (gqa && !dkv_ordered) {  // the kernel left the sums in the accumulators
    dk.copy_(dk_accum.view(k.sizes()));
    dv.copy_(dv_accum.view(v.sizes()));
  }
  return {dq, dk, dv, trace_records};
}

std::tuple<Tensor, Tensor, Tensor> bwd_cuda(Tensor const& dout, Tensor const& q, Tensor const& k, Tensor const& v,
                                            Tensor const& out, Tensor const& softmax_lse, double softmax_scale,
                                            bool causal, bool deterministic, c10::string_view schedule,
                                            int64_t sm_margin) {
  auto r = run_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, schedule, sm_margin,
                        /*trace=*/false);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> bwd_trace_cuda(Tensor const& dout, Tensor const& q, Tensor const& k,
                                                          Tensor const& v, Tensor const& out, Tensor const& softmax_lse,
                                                          double softmax_scale, bool causal, bool deterministic,
                                                          c10::string_view schedule, int64_t sm_margin) {
  return run_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, schedule, sm_margin,
                      /*trace=*/true);
}

// The forward's outputs and launch, for p filled from q, k, v: out like q (contiguous) and a
// float32 softmax_lse of `lse_shape`; `packed`: q is varlen (total_q, heads, d), one batch of
// rows for the kernel's strides.
std::tuple<Tensor, Tensor> launch_forward(dash::FwdParams& p, Tensor const& q, at::IntArrayRef lse_shape,
                                          double softmax_scale, bool causal, bool packed) {
  Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor lse = at::empty(lse_shape, q.options().dtype(at::kFloat));
  Tensor tile_counter = at::empty({1}, q.options().dtype(at::kInt));  // zeroed by run_fwd on the stream
  p.tile_counter = tile_counter.data_ptr<int>();
  p.out = out.data_ptr();
  p.out_strides = bshd_strides(packed ? out.unsqueeze(0) : out);
  p.lse = lse.data_ptr<float>();
  p.softmax_scale = float(softmax_scale);
  p.causal = causal;

  poison_outputs_if_requested({&out, &lse});
  call_library([&] { dash::run_fwd(p, at::cuda::getCurrentCUDAStream()); });
  return {out, lse};
}

// The forward: out (shaped like q, contiguous) and softmax_lse (float32, (batch, heads,
// seqlen_q)). `deterministic` and `schedule` only travel with the op so that autograd can
// hand them to the backward (the forward's result never depends on them); the schedule is
// checked here all the same.
std::tuple<Tensor, Tensor> fwd_cuda(Tensor const& q, Tensor const& k, Tensor const& v, double softmax_scale,
                                    bool causal, bool deterministic, c10::string_view schedule, int64_t sm_margin) {
  (void)deterministic;
  (void)parse_schedule("dash.fwd", schedule, causal);
  for (auto const* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 4, "dash.fwd: q, k, v must have 4 dims (batch, seqlen, heads, head_dim)");
  }
  NvtxRange range("dash.fwd " + problem_label(q, k, causal));
  c10::cuda::CUDAGuard device_guard(q.device());
  Problem const pr = check_problem("dash.fwd", q, k, v, sm_margin);
  int64_t const batch = pr.batch, seqlen_q = pr.seqlen_q, heads = pr.heads;
  dash::FwdParams p;
  pr.fill(p, q, k, v);

  return launch_forward(p, q, {batch, heads, seqlen_q}, softmax_scale, causal, /*packed=*/false);
}

// The varlen forward (FA3's flash_attn_varlen_func): q (total_q, heads, d) and k, v (total_k,
// heads_k, d) hold the sequences packed along the rows (VarlenBatch). Returns out (total_q,
// heads, d), contiguous, and softmax_lse (heads, total_q) float32, FA3's varlen layout. A
// sequence longer than max_seqlen_q gets NaN in its rows past it (FwdParams). `deterministic`
// and `schedule` travel with the op for its backward (dash.bwd_varlen), as dash.fwd's do.
std::tuple<Tensor, Tensor> fwd_varlen_cuda(Tensor const& q, Tensor const& k, Tensor const& v,
                                           Tensor const& cu_seqlens_q, Tensor const& cu_seqlens_k,
                                           int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                           bool causal, bool deterministic, c10::string_view schedule,
                                           int64_t sm_margin) {
  char const* op = "dash.fwd_varlen";
  (void)deterministic;
  dash::BwdScheduleKind const kind = parse_schedule(op, schedule, causal);
  TORCH_CHECK(kind != dash::BwdScheduleKind::kShift, op,
              ": schedule 'shift' is not built for varlen batches; use 'fa3', 'interleaved', 'descending' or 'auto'");
  for (auto const& [name, t] : {std::pair<char const*, Tensor const*>{"q", &q}, {"k", &k}, {"v", &v}}) {
    TORCH_CHECK(t->dim() == 3, op, ": ", name, " must have 3 dims (total_tokens, heads, head_dim), got ", t->dim());
  }
  VarlenBatch const varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  varlen.check(op, q, k);
  NvtxRange range(std::string(op) + " " + varlen.label(q, causal));
  c10::cuda::CUDAGuard device_guard(q.device());
  // The packed tensors as one batch of total rows: the checks of the padded forward apply.
  Problem const pr = check_problem(op, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), sm_margin);
  dash::FwdParams p;
  pr.fill(p, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0));
  varlen.fill(p, q, k);

  return launch_forward(p, q, {q.size(1), q.size(0)}, softmax_scale, causal, /*packed=*/true);
}

// The varlen backward: dq, dk, dv packed like q, k, v. Claimed schedules only (the static
// shift waves assume equal heads).
std::tuple<Tensor, Tensor, Tensor> bwd_varlen_cuda(Tensor const& dout, Tensor const& q, Tensor const& k,
                                                   Tensor const& v, Tensor const& out, Tensor const& softmax_lse,
                                                   Tensor const& cu_seqlens_q, Tensor const& cu_seqlens_k,
                                                   int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                                   bool causal, bool deterministic, c10::string_view schedule,
                                                   int64_t sm_margin) {
  VarlenBatch const varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  auto r = run_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, schedule, sm_margin,
                        /*trace=*/false, &varlen);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dash, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, bool deterministic, str schedule, "
      "int sm_margin) -> (Tensor out, Tensor softmax_lse)");
  // The same on variable-length sequences packed along the rows (FA3's varlen layout); the
  // forward's autograd (dash.ops) runs bwd_varlen.
  m.def(
      "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, float softmax_scale, bool causal, bool deterministic, str schedule, int sm_margin) -> "
      "(Tensor out, Tensor softmax_lse)");
  m.def(
      "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, bool deterministic, "
      "str schedule, int sm_margin) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, float softmax_scale, "
      "bool causal, bool deterministic, str schedule, int sm_margin) -> (Tensor dq, Tensor dk, Tensor dv)");
  // The same backward, recording every (column, Q tile) step (python -m dash trace).
  m.def(
      "bwd_trace(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, float softmax_scale, "
      "bool causal, bool deterministic, str schedule, int sm_margin) -> (Tensor dq, Tensor dk, Tensor dv, "
      "Tensor trace)");
}

TORCH_LIBRARY_IMPL(dash, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("fwd_varlen", &fwd_varlen_cuda);
  m.impl("bwd_varlen", &bwd_varlen_cuda);
  m.impl("bwd", &bwd_cuda);
  m.impl("bwd_trace", &bwd_trace_cuda);
}

// A plain extension module so that `import dash._C` loads the library and runs the
// registrations above.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "DASH CUDA kernels (ops under torch.ops.dash)", -1,
                               nullptr};
  return PyModule_Create(&module);
}
