// dash_bwd_runner: DASH's backward kernels (and, with --pass fwd, its forward) without
// Python, for Nsight Compute and Nsight Systems, and for timing a shape in isolation.
//
//   cmake -S . -B build/cmake && cmake --build build/cmake --target dash_bwd_runner
//   build/cmake/dash_bwd_runner --seqlen-q 4096 --hdim 128 --causal --iters 20
//   ncu --profile-from-start off --clock-control none -k regex:bwd_main_kernel -c 1 --set full \
//       --import-source yes -o dash-bwd build/cmake/dash_bwd_runner --seqlen-q 4096 --hdim 128 --causal
//
// It calls dash::run_bwd (csrc/bwd_api.h), the entry point the torch op calls, on buffers it
// allocates with cudaMalloc exactly as csrc/torch_binding.cpp lays them out, filled with a
// deterministic pseudo-random pattern.
//
// --pass fwd runs dash::run_fwd (csrc/fwd_api.h) on the same kind of inputs; it needs no
// synthetic statistics (first run on the H200 on 2026-11-30:
// benchmarks/results/logs/2026-11-30-NVIDIA-H200-bwd-runner-ebf9e4a.log).
//
// TIMING AND PROFILING ONLY (the backward). The softmax_lse handed to the kernels is synthetic: the constant
// log(seqlen_k), which is about what a forward over these small random inputs would give, not
// the log-sum-exp of an actual forward. Every exp() stays finite and the kernels do exactly
// the work they do on real inputs (the same tiles, the same instructions, the same
// synchronisation), but the gradients are not those of any attention forward. Correctness
// is tested through Python (tests/test_bwd_gpu.py).
//
// The timed iterations lie between cudaProfilerStart and cudaProfilerStop, each in an NVTX
// start/end range "dash_bwd_runner iter <i>" (as python -m dash profile marks its
// iterations, so one ncu filter syntax serves both: --nvtx --nvtx-include 'dash_bwd_runner
// iter 0'), so `ncu --profile-from-start off` and `nsys profile
// --capture-range=cudaProfilerApi` see them and not the warm-ups.
//
// Exit status: 0 done, 1 the GPU or a CUDA call failed, 2 bad arguments (as python -m dash).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bwd_api.h"
#include "fwd_api.h"

namespace {

constexpr char kProg[] = "dash_bwd_runner";

// A bad command line or a shape the kernels do not support: exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A failed CUDA call, or a GPU the kernels cannot run on: exit status 1.
struct RunError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check_cuda(cudaError_t err, std::string const& what) {
  if (err != cudaSuccess) {
    throw RunError(what + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

// ---------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------
// The kernel's schedules in the order of BwdScheduleKind (csrc/schedule/schedule.h), which
// is the order of dash.config.KERNEL_SCHEDULES.
constexpr char const* kScheduleNames[] = {"fa3", "interleaved", "descending", "shift"};
constexpr int kNumSchedules = int(sizeof(kScheduleNames) / sizeof(kScheduleNames[0]));

struct Options {
  // Which pass to time: "bwd" (dash::run_bwd) or "fwd" (dash::run_fwd); see make_pass().
  std::string pass = "bwd";
  // 0 means "derive": batch 16384 / seqlen_q tokens and heads 2048 / hdim (the training
  // shape of python -m dash bench), heads_kv = heads, seqlen_k = seqlen_q.
  int batch = 0, heads = 0, heads_kv = 0;
  int seqlen_q = 4096, seqlen_k = 0;
  int hdim = 128;
  bool causal = false;
  dash::DType dtype = dash::DType::kBFloat16;
  bool deterministic = true;
  int schedule = 0;  // index into kScheduleNames
  int iters = 20;
  int warmup = 3;
};

char const* dtype_name(dash::DType t) { return t == dash::DType::kBFloat16 ? "bf16" : "fp16"; }

constexpr char kUsage[] =
    "usage: dash_bwd_runner [--pass bwd|fwd] [--batch B] [--heads H] [--heads-kv HKV] [--seqlen-q SQ]\n"
    "                       [--seqlen-k SK] [--hdim D] [--causal | --no-causal] [--dtype bf16|fp16]\n"
    "                       [--deterministic | --no-deterministic] [--schedule NAME] [--iters K] [--warmup W]\n"
    "\n"
    "Times DASH's backward kernels (dash::run_bwd), or with --pass fwd its forward (dash::run_fwd), on\n"
    "synthetic inputs; for ncu / nsys without Python. The backward's softmax_lse is a synthetic constant:\n"
    "its results are for timing and profiling only.\n"
    "\n"
    "  --pass        bwd (default) or fwd\n"
    "  --batch       default 16384 / seqlen-q (16k tokens), at least 1\n"
    "  --heads       query heads, default 2048 / hdim (hidden 2048)\n"
    "  --heads-kv    key/value heads (GQA/MQA), default --heads; must divide --heads\n"
    "  --seqlen-q    default 4096\n"
    "  --seqlen-k    default --seqlen-q\n"
    "  --hdim        head dim, default 128\n"
    "  --causal      bottom-right aligned causal mask (default: full)\n"
    "  --dtype       bf16 (default) or fp16\n"
    "  --deterministic / --no-deterministic   bitwise reproducible dQ (default: deterministic)\n"
    "  --schedule    fa3 (default), interleaved, descending or shift (full masks only); 'auto' is\n"
    "                Python's choice: python -m dash profile prints the name it picks for a shape\n"
    "  --iters       timed iterations, default 20 (the median is reported)\n"
    "  --warmup      untimed iterations first, default 3\n";

int parse_int(std::string const& option, std::string const& text, int lo) {
  errno = 0;
  char* end = nullptr;
  long long const value = std::strtoll(text.c_str(), &end, 10);
  bool const whole = !text.empty() && end != nullptr && *end == '\0';
  if (!whole || errno == ERANGE || value < lo || value > INT_MAX) {
    std::string const wanted = lo == 0 ? "a non-negative integer" : lo == 1 ? "a positive integer"
                                                                             : "an integer >= " + std::to_string(lo);
    throw UsageError("argument " + option + ": " + text + " is not " + wanted +
                     (value > INT_MAX && whole ? " that fits in 32 bits" : ""));
  }
  return int(value);
}

bool is_value_option(std::string const& name) {
  for (char const* known : {"--pass", "--batch", "--heads", "--heads-kv", "--seqlen-q", "--seqlen-k", "--hdim",
                            "--dtype", "--schedule", "--iters", "--warmup"}) {
    if (name == known) return true;
  }
  return false;
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    // "--name=value" is "--name value".
    std::string value;
    bool inline_value = false;
    size_t const eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      inline_value = true;
    }
    bool* flag = arg == "--causal" || arg == "--no-causal"                 ? &o.causal
                 : arg == "--deterministic" || arg == "--no-deterministic" ? &o.deterministic
                                                                           : nullptr;
    if (flag != nullptr) {
      if (inline_value) throw UsageError("argument " + arg + ": takes no value (got '" + value + "')");
      *flag = arg.rfind("--no-", 0) != 0;
      continue;
    }
    if (!is_value_option(arg)) throw UsageError("unrecognized argument " + arg + " (see --help)");
    if (!inline_value) {
      if (i + 1 >= argc) throw UsageError("argument " + arg + ": expected a value");
      value = argv[++i];
    }
    if (arg == "--pass") {
      if (value != "bwd" && value != "fwd") {
        throw UsageError("argument --pass: '" + value + "' is not a pass this runner has; choose bwd or fwd");
      }
      o.pass = value;
    } else if (arg == "--batch") {
      o.batch = parse_int(arg, value, 1);
    } else if (arg == "--heads") {
      o.heads = parse_int(arg, value, 1);
    } else if (arg == "--heads-kv") {
      o.heads_kv = parse_int(arg, value, 1);
    } else if (arg == "--seqlen-q") {
      o.seqlen_q = parse_int(arg, value, 1);
    } else if (arg == "--seqlen-k") {
      o.seqlen_k = parse_int(arg, value, 1);
    } else if (arg == "--hdim") {
      o.hdim = parse_int(arg, value, 1);
    } else if (arg == "--dtype") {
      if (value == "bf16" || value == "bfloat16") {
        o.dtype = dash::DType::kBFloat16;
      } else if (value == "fp16" || value == "float16") {
        o.dtype = dash::DType::kFloat16;
      } else {
        throw UsageError("argument --dtype: '" + value + "' is not supported; choose bf16 or fp16");
      }
    } else if (arg == "--schedule") {
      if (value == "auto") {
        throw UsageError("argument --schedule: 'auto' is chosen by DASH's Python model; run python -m dash profile "
                         "with this shape (it prints the schedule auto picks) and pass that name");
      }
      o.schedule = -1;
      std::string known;
      for (int s = 0; s < kNumSchedules; ++s) {
        if (value == kScheduleNames[s]) o.schedule = s;
        known += std::string(s ? ", " : "") + kScheduleNames[s];
      }
      if (o.schedule < 0) {
        throw UsageError("argument --schedule: '" + value + "' is not a kernel schedule; choose " + known);
      }
    } else if (arg == "--iters") {
      o.iters = parse_int(arg, value, 1);
    } else if (arg == "--warmup") {
      o.warmup = parse_int(arg, value, 0);
    }
  }

  // Derived defaults, then the checks that involve several options.
  if (o.seqlen_k == 0) o.seqlen_k = o.seqlen_q;
  if (o.batch == 0) o.batch = std::max(16384 / o.seqlen_q, 1);
  if (o.heads == 0) o.heads = std::max(2048 / o.hdim, 1);
  if (o.heads_kv == 0) o.heads_kv = o.heads;
  if (!dash::bwd_is_built(o.hdim, o.dtype)) {
    bool const hdim_built = dash::bwd_is_built(o.hdim, dash::DType::kBFloat16) ||
                            dash::bwd_is_built(o.hdim, dash::DType::kFloat16);
    if (!hdim_built) {
      throw UsageError("argument --hdim: " + std::to_string(o.hdim) + " is not built; built head dims: " +
                       dash::bwd_built_head_dims());
    }
    throw UsageError(std::string("argument --dtype: ") + dtype_name(o.dtype) + " is not built; built dtypes: " +
                     dash::bwd_built_dtypes());
  }
  if (o.heads % o.heads_kv != 0) {
    throw UsageError("argument --heads-kv: " + std::to_string(o.heads_kv) + " does not divide the " +
                     std::to_string(o.heads) + " query heads (GQA needs heads % heads-kv == 0)");
  }
  if (o.causal && std::string(kScheduleNames[o.schedule]) == "shift") {
    throw UsageError("argument --schedule: 'shift' is for full masks; with --causal use fa3, interleaved or "
                     "descending");
  }
  return o;
}

// ---------------------------------------------------------------------------------------
// Device memory and synthetic inputs
// ---------------------------------------------------------------------------------------
// One cudaMalloc'd buffer, freed when it goes out of scope (also when a later step throws).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, char const* what) : bytes_(bytes) {
    cudaError_t const err = cudaMalloc(&ptr_, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // an allocation failure is not sticky; clear it for the message below
      char gib[32];
      std::snprintf(gib, sizeof(gib), "%.2f", double(bytes) / double(1ull << 30));
      throw RunError(std::string("cudaMalloc of ") + gib + " GiB for " + what + " failed: " +
                     cudaGetErrorString(err) + " (lower --batch or --seqlen-q/--seqlen-k)");
    }
  }
  DeviceBuffer(DeviceBuffer const&) = delete;
  DeviceBuffer& operator=(DeviceBuffer const&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  void* get() const { return ptr_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A stateless hash of (seed, index) to a float in [-1, 1): the same values on every run,
// GPU and grid shape, so two profiles of one shape see the same data. Not zeros or a
// constant: the tensor cores' power draw, and so the clocks, depend on the data, and such
// inputs run faster than real ones. splitmix64's finaliser.
__device__ float hash_to_unit_interval(uint64_t seed, uint64_t index) {
  uint64_t x = (index + 1) * 0x9E3779B97F4A7C15ull ^ (seed + 1) * 0xD1B54A32D192ED03ull;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return float(x >> 40) * (2.0f / 16777216.0f) - 1.0f;  // the top 24 bits, scaled to [-1, 1)
}

__device__ void store_as(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ void store_as(__half* p, float v) { *p = __float2half_rn(v); }

template <class T>
__global__ void fill_pseudo_random_kernel(T* dst, size_t count, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    store_as(dst + i, hash_to_unit_interval(seed, i));
  }
}

__global__ void fill_constant_kernel(float* dst, size_t count, float value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = value;
  }
}

constexpr int kFillThreads = 256;
constexpr int kFillBlocks = 1024;  // grid-stride loops: any size, no overflow of gridDim

void fill_pseudo_random(DeviceBuffer const& buf, dash::DType dtype, size_t count, uint64_t seed, cudaStream_t stream) {
  if (dtype == dash::DType::kBFloat16) {
    fill_pseudo_random_kernel<<<kFillBlocks, kFillThreads, 0, stream>>>(buf.as<__nv_bfloat16>(), count, seed);
  } else {
    fill_pseudo_random_kernel<<<kFillBlocks, kFillThreads, 0, stream>>>(buf.as<__half>(), count, seed);
  }
  check_cuda(cudaGetLastError(), "launch of the input fill kernel");
}

// ---------------------------------------------------------------------------------------
// Passes
// ---------------------------------------------------------------------------------------
// FLOPs of the attention forward as python -m dash bench counts them (dash/bench.py,
// FA3's convention): 4 * b * h * sq * sk * d, halved for a causal mask (exact for sq == sk,
// which is what bench runs; for sq != sk it is the same convention, not an exact count).
double attention_fwd_flops(Options const& o) {
  double const full = 4.0 * o.batch * o.heads * double(o.seqlen_q) * o.seqlen_k * o.hdim;
  return o.causal ? full / 2.0 : full;
}

// One attention pass the runner times. A pass allocates and fills its buffers once; each
// enqueue() is one call, including the per-call resets the library needs before it.
class TimedPass {
 public:
  virtual ~TimedPass() = default;
  virtual std::string describe() const = 0;
  virtual double flops() const = 0;
  virtual char const* ncu_kernel_filter() const = 0;
  virtual void enqueue(cudaStream_t stream) = 0;
};

dash::BSHDStrides contiguous_bshd(int seqlen, int heads, int head_dim) {
  return {int64_t(seqlen) * heads * head_dim, int64_t(heads) * head_dim, int64_t(head_dim)};
}

// The fields FwdParams and BwdParams share, from the command line: shape, dtype, mask, the
// default softmax scale, and the torch op's default grid (sm_margin = 0).
template <class Params>
void fill_problem(Options const& o, int num_sms, Params& p) {
  p.dtype = o.dtype;
  p.batch = o.batch;
  p.seqlen_q = o.seqlen_q;
  p.seqlen_k = o.seqlen_k;
  p.num_heads = o.heads;
  p.num_heads_k = o.heads_kv;
  p.head_dim = o.hdim;
  p.softmax_scale = 1.0f / std::sqrt(float(o.hdim));
  p.causal = o.causal;
  p.num_ctas_max = num_sms;
}

class BackwardPass final : public TimedPass {
 public:
  BackwardPass(Options const& o, int num_sms, cudaStream_t stream) : o_(o) {
    size_t const elem = 2;  // bf16 and fp16
    size_t const q_elems = size_t(o.batch) * o.seqlen_q * o.heads * o.hdim;
    size_t const kv_elems = size_t(o.batch) * o.seqlen_k * o.heads_kv * o.hdim;
    size_t const lse_floats = size_t(o.batch) * o.heads * o.seqlen_q;

    dash::BwdParams& p = params_;
    fill_problem(o, num_sms, p);
    p.deterministic = o.deterministic;
    p.schedule = static_cast<dash::BwdScheduleKind>(o.schedule);
    p.convert_under_main = true;  // as the torch op with sm_margin = 0

    q_ = DeviceBuffer(q_elems * elem, "q");
    k_ = DeviceBuffer(kv_elems * elem, "k");
    v_ = DeviceBuffer(kv_elems * elem, "v");
    out_ = DeviceBuffer(q_elems * elem, "out");
    dout_ = DeviceBuffer(q_elems * elem, "dout");
    lse_ = DeviceBuffer(lse_floats * sizeof(float), "softmax_lse");
    dq_ = DeviceBuffer(q_elems * elem, "dq");
    // Distinct seeds: q, k, v, out and dout must not be copies of one another (q == k would
    // make every diagonal score the row maximum).
    fill_pseudo_random(q_, o.dtype, q_elems, 1, stream);
    fill_pseudo_random(k_, o.dtype, kv_elems, 2, stream);
    fill_pseudo_random(v_, o.dtype, kv_elems, 3, stream);
    fill_pseudo_random(out_, o.dtype, q_elems, 4, stream);
    fill_pseudo_random(dout_, o.dtype, q_elems, 5, stream);
    // The synthetic LSE (see the top of this file). With entries in [-1, 1), scale * q.k is
    // at most sqrt(hdim) (11.3 for hdim 128), so exp(scale * s - lse) <= exp(11.3) is finite;
    // log(seqlen_k) is close to the real LSE of near-uniform attention, so P is about 1 / sk.
    fill_constant_kernel<<<kFillBlocks, kFillThreads, 0, stream>>>(lse_.as<float>(), lse_floats,
                                                                   std::log(float(o.seqlen_k)));
    check_cuda(cudaGetLastError(), "launch of the softmax_lse fill kernel");

    auto const q_strides = contiguous_bshd(o.seqlen_q, o.heads, o.hdim);
    auto const kv_strides = contiguous_bshd(o.seqlen_k, o.heads_kv, o.hdim);
    p.q = q_.get();
    p.k = k_.get();
    p.v = v_.get();
    p.out = out_.get();
    p.dout = dout_.get();
    p.q_strides = p.out_strides = p.dout_strides = p.dq_strides = q_strides;
    p.k_strides = p.v_strides = kv_strides;
    p.dq = dq_.get();
    p.lse = lse_.as<float>();
    p.lse_batch_stride = int64_t(o.heads) * o.seqlen_q;
    p.lse_head_stride = o.seqlen_q;

    dk_ = DeviceBuffer(kv_elems * elem, "dk");
    dv_ = DeviceBuffer(kv_elems * elem, "dv");
    p.dk = dk_.get();
    p.dv = dv_.get();
    p.dk_strides = p.dv_strides = kv_strides;
    if (gqa()) {
      // As the torch op (csrc/torch_binding.cpp): the query heads of a KV group sum their dK/dV
      // in fp32. Ordered (deterministic, or a small group; dash::bwd_dkv_ordered): in chains of
      // any contents, with per-(batch, KV head, column, chain) turn counters that must be zero
      // before every call; the kernel writes dk/dv. Otherwise: into one accumulator that must be
      // zero before every call (enqueue() clears what applies), left in fp32 (no cast here).
      dkv_ordered_ = dash::bwd_dkv_ordered(p);
      size_t const chains = size_t(dkv_ordered_ ? dash::bwd_dkv_chains(p) : 1);
      dk_accum_ = DeviceBuffer(chains * kv_elems * sizeof(float), "dk_accum");
      dv_accum_ = DeviceBuffer(chains * kv_elems * sizeof(float), "dv_accum");
      p.dk_accum = dk_accum_.as<float>();
      p.dv_accum = dv_accum_.as<float>();
      p.dkv_accum_strides = kv_strides;
      p.dkv_chain_stride = int64_t(kv_elems);
      if (dkv_ordered_) {
        size_t const semaphore_ints = size_t(o.batch) * o.heads_kv * chains *
                                      ((o.seqlen_k + dash::bwd_block_n(p) - 1) / dash::bwd_block_n(p));
        dkv_semaphore_ = DeviceBuffer(semaphore_ints * sizeof(int), "dkv_semaphore");
        p.dkv_semaphore = dkv_semaphore_.as<int>();
      }
    }

    // One workspace, carved by the library as for the torch op. The preprocess kernel
    // initialises it on every call, so it is never cleared here.
    workspace_ = DeviceBuffer(dash::bwd_workspace_bytes(p), "the backward workspace");
    dash::bwd_set_workspace(p, workspace_.get());
  }

  std::string describe() const override {
    std::string s = std::string("backward ") + dtype_name(o_.dtype) + " hdim" + std::to_string(o_.hdim) +
                    (o_.causal ? " causal" : " full") + ", batch " + std::to_string(o_.batch) + " heads " +
                    std::to_string(o_.heads);
    if (gqa()) s += "/" + std::to_string(o_.heads_kv) + " (GQA)";
    s += " seqlen_q " + std::to_string(o_.seqlen_q) + " seqlen_k " + std::to_string(o_.seqlen_k) + ", ";
    s += o_.deterministic ? std::string("deterministic, schedule ") + kScheduleNames[o_.schedule]
                          : std::string("non-deterministic (visit order of schedule ") +
                                kScheduleNames[o_.schedule] + ")";
    return s;
  }

  // dash/bench.py: the backward is 2.5 forwards.
  double flops() const override { return 2.5 * attention_fwd_flops(o_); }

  char const* ncu_kernel_filter() const override { return "regex:bwd_main_kernel"; }

  void enqueue(cudaStream_t stream) override {
    if (gqa() && dkv_ordered_) {
      // What at::zeros does in the torch op before each call. The turn counters must be reset:
      // a chain's add waits until its counter equals its turn, and the last call left the
      // counters at their final counts, so the next call would spin forever.
      check_cuda(cudaMemsetAsync(dkv_semaphore_.get(), 0, dkv_semaphore_.bytes(), stream),
                 "cudaMemsetAsync(dkv_semaphore)");
    } else if (gqa()) {
      check_cuda(cudaMemsetAsync(dk_accum_.get(), 0, dk_accum_.bytes(), stream), "cudaMemsetAsync(dk_accum)");
      check_cuda(cudaMemsetAsync(dv_accum_.get(), 0, dv_accum_.bytes(), stream), "cudaMemsetAsync(dv_accum)");
    }
    // run_bwd throws std::invalid_argument for a shape it cannot run (checked before any
    // launch) and std::runtime_error for a failed launch; main() reports both.
    dash::run_bwd(params_, stream);
    // Not done here: the torch op's final cast of unordered GQA accumulators to bf16/fp16 (an
    // elementwise PyTorch kernel, not DASH's).
  }

 private:
  bool gqa() const { return o_.heads != o_.heads_kv; }

  Options o_;
  dash::BwdParams params_;
  DeviceBuffer q_, k_, v_, out_, dout_, lse_, dq_, dk_, dv_, dk_accum_, dv_accum_, dkv_semaphore_, workspace_;
  bool dkv_ordered_ = false;  // GQA: dash::bwd_dkv_ordered
};

// The forward (dash::run_fwd) on pseudo-random q, k, v: unlike the backward it needs no
// synthetic statistics, so its inputs are as real as any.
class ForwardPass final : public TimedPass {
 public:
  ForwardPass(Options const& o, int num_sms, cudaStream_t stream) : o_(o) {
    size_t const elem = 2;  // bf16 and fp16
    size_t const q_elems = size_t(o.batch) * o.seqlen_q * o.heads * o.hdim;
    size_t const kv_elems = size_t(o.batch) * o.seqlen_k * o.heads_kv * o.hdim;
    q_ = DeviceBuffer(q_elems * elem, "q");
    k_ = DeviceBuffer(kv_elems * elem, "k");
    v_ = DeviceBuffer(kv_elems * elem, "v");
    out_ = DeviceBuffer(q_elems * elem, "out");
    lse_ = DeviceBuffer(size_t(o.batch) * o.heads * o.seqlen_q * sizeof(float), "softmax_lse");
    tile_counter_ = DeviceBuffer(sizeof(int), "tile counter");
    fill_pseudo_random(q_, o.dtype, q_elems, 1, stream);
    fill_pseudo_random(k_, o.dtype, kv_elems, 2, stream);
    fill_pseudo_random(v_, o.dtype, kv_elems, 3, stream);

    dash::FwdParams& p = params_;
    fill_problem(o, num_sms, p);
    p.q = q_.get();
    p.k = k_.get();
    p.v = v_.get();
    p.q_strides = p.out_strides = contiguous_bshd(o.seqlen_q, o.heads, o.hdim);
    p.k_strides = p.v_strides = contiguous_bshd(o.seqlen_k, o.heads_kv, o.hdim);
    p.out = out_.get();
    p.lse = lse_.as<float>();
    p.tile_counter = tile_counter_.as<int>();  // run_fwd zeroes it on the stream
  }

  std::string describe() const override {
    std::string s = std::string("forward ") + dtype_name(o_.dtype) + " hdim" + std::to_string(o_.hdim) +
                    (o_.causal ? " causal" : " full") + ", batch " + std::to_string(o_.batch) + " heads " +
                    std::to_string(o_.heads);
    if (o_.heads != o_.heads_kv) s += "/" + std::to_string(o_.heads_kv) + " (GQA)";
    return s + " seqlen_q " + std::to_string(o_.seqlen_q) + " seqlen_k " + std::to_string(o_.seqlen_k);
  }

  double flops() const override { return attention_fwd_flops(o_); }

  char const* ncu_kernel_filter() const override { return "regex:fwd_main_kernel"; }

  void enqueue(cudaStream_t stream) override { dash::run_fwd(params_, stream); }

 private:
  Options o_;
  dash::FwdParams params_;
  DeviceBuffer q_, k_, v_, out_, lse_, tile_counter_;
};

// The one place that maps --pass to a pass.
std::unique_ptr<TimedPass> make_pass(Options const& o, int num_sms, cudaStream_t stream) {
  if (o.pass == "bwd") return std::make_unique<BackwardPass>(o, num_sms, stream);
  if (o.pass == "fwd") return std::make_unique<ForwardPass>(o, num_sms, stream);
  throw UsageError("argument --pass: '" + o.pass + "' is not a pass this runner has");
}

// ---------------------------------------------------------------------------------------
// Timing
// ---------------------------------------------------------------------------------------
// Events created once and destroyed on every path out.
class EventPair {
 public:
  EventPair() {
    check_cuda(cudaEventCreate(&start), "cudaEventCreate");
    check_cuda(cudaEventCreate(&end), "cudaEventCreate");
  }
  EventPair(EventPair const&) = delete;
  EventPair& operator=(EventPair const&) = delete;
  ~EventPair() {
    cudaEventDestroy(start);
    cudaEventDestroy(end);
  }
  cudaEvent_t start = nullptr, end = nullptr;
};

// `command_line` is how this run was started, for the ncu line printed at the end.
int run(Options const& o, std::string const& command_line) {
  int device_count = 0;
  cudaError_t const found = cudaGetDeviceCount(&device_count);
  if (found != cudaSuccess || device_count == 0) {
    throw RunError(std::string("no usable CUDA GPU here (") +
                   (found != cudaSuccess ? cudaGetErrorString(found) : "no device is visible") +
                   "); DASH's kernels need a compute capability 9.0 GPU (H100/H200/H800/H20)");
  }
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  if (prop.major != 9 || prop.minor != 0) {
    throw RunError(std::string("DASH's kernels need a compute capability 9.0 GPU (H100/H200/H800/H20); device ") +
                   std::to_string(device) + " is " + prop.name + " with " + std::to_string(prop.major) + "." +
                   std::to_string(prop.minor));
  }
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::unique_ptr<TimedPass> pass = make_pass(o, prop.multiProcessorCount, stream);
  check_cuda(cudaStreamSynchronize(stream), "filling the inputs");

  std::printf("%s: %s (%d SMs): %s\n", kProg, prop.name, prop.multiProcessorCount, pass->describe().c_str());
  if (o.pass == "bwd") {
    std::printf("  inputs: pseudo-random in [-1, 1); softmax_lse a synthetic constant: timing and profiling only, "
                "the gradients are not those of a forward\n");
  } else {
    std::printf("  inputs: pseudo-random in [-1, 1); out and softmax_lse are the forward's own\n");
  }
  if (o.pass == "bwd" && o.heads != o.heads_kv) {
    std::printf("  GQA: each iteration also zeroes the fp32 dK/dV accumulators and their semaphore, as the torch op "
                "does before each call\n");
  }
  std::fflush(stdout);

  // Warm-ups: module load, cudaFuncSetAttribute, clocks. A kernel fault shows up at this
  // synchronize, before anything is timed.
  for (int i = 0; i < o.warmup; ++i) pass->enqueue(stream);
  check_cuda(cudaStreamSynchronize(stream), "the warm-up iterations");

  std::vector<EventPair> events(o.iters);
  check_cuda(cudaProfilerStart(), "cudaProfilerStart");
  for (int i = 0; i < o.iters; ++i) {
    std::string const range = std::string(kProg) + " iter " + std::to_string(i);
    nvtxRangeId_t const marked = nvtxRangeStartA(range.c_str());
    check_cuda(cudaEventRecord(events[i].start, stream), "cudaEventRecord");
    pass->enqueue(stream);
    check_cuda(cudaEventRecord(events[i].end, stream), "cudaEventRecord");
    nvtxRangeEnd(marked);
  }
  check_cuda(cudaStreamSynchronize(stream), "the timed iterations");
  check_cuda(cudaProfilerStop(), "cudaProfilerStop");

  std::vector<float> ms(o.iters);
  for (int i = 0; i < o.iters; ++i) check_cuda(cudaEventElapsedTime(&ms[i], events[i].start, events[i].end), "cudaEventElapsedTime");
  std::vector<float> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  // The median as dash/bench.py takes it (statistics.median: the mean of the middle two).
  double const median = o.iters % 2 ? sorted[o.iters / 2] : 0.5 * (sorted[o.iters / 2 - 1] + sorted[o.iters / 2]);
  std::printf("  %d iterations after %d warm-ups: median %.3f ms (min %.3f, max %.3f), %.1f TFLOP/s\n", o.iters,
              o.warmup, median, sorted.front(), sorted.back(), pass->flops() / (median * 1e-3) / 1e12);
  std::printf("  FLOPs counted as python -m dash bench counts them: forward 4*b*h*sq*sk*d, backward 2.5x, halved "
              "when causal\n");
  std::printf("  (timings under ncu are not meaningful: it serialises and replays the kernels it profiles)\n");
  // --clock-control none: profile at the clocks the timing above ran at, not ncu's locked base clocks.
  std::printf("  profile the first timed iteration's main kernel:\n    ncu --profile-from-start off --clock-control none "
              "-k %s -c 1 --set full --import-source yes -o dash-%s %s\n",
              pass->ncu_kernel_filter(), o.pass.c_str(), command_line.c_str());
  check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string command_line = argv[0];
    for (int i = 1; i < argc; ++i) command_line += std::string(" ") + argv[i];
    return run(parse_options(argc, argv), command_line);
  } catch (UsageError const& e) {
    std::fprintf(stderr, "%s: error: %s\n", kProg, e.what());
    return 2;
  } catch (std::invalid_argument const& e) {
    // dash::run_bwd refuses a shape before launching anything (e.g. shift on too short a
    // seqlen_q): an argument problem, reported as one.
    std::fprintf(stderr, "%s: error: %s\n", kProg, e.what());
    return 2;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "%s: error: %s\n", kProg, e.what());
    return 1;
  }
}
