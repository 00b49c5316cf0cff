// Autograd of dash::fwd, in C++: the backward node runs dash::bwd.
//
// Why C++ and not torch.library.register_autograd in Python: on the H200 host, the Python
// autograd wrapper cost about 85 us per forward and the Python backward node about 350 us
// per backward at a tiny shape, several times the C++ ops themselves (40-50 us) and more
// than a whole SDPA forward+backward (tools/host_profile.py). Here the node is created and
// run without the interpreter; the backward runs on autograd's device thread without the GIL.
//
// Both directions call the ops through the dispatcher (below the Autograd key), so that
// torch.compile's AOTAutograd traces dash::fwd and dash::bwd into its forward and backward
// graphs (with their Python fake implementations) exactly as it does for eager calls.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<Tensor, Tensor> call_fwd(Tensor const& q, Tensor const& k, Tensor const& v, double scale, bool causal,
                                    bool deterministic, c10::string_view schedule, int64_t sm_margin) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dash::fwd", "")
                       .typed<std::tuple<Tensor, Tensor>(Tensor const&, Tensor const&, Tensor const&, double, bool,
                                                         bool, c10::string_view, int64_t)>();
  return op.call(q, k, v, scale, causal, deterministic, schedule, sm_margin);
}

std::tuple<Tensor, Tensor, Tensor> call_bwd(Tensor const& dout, Tensor const& q, Tensor const& k, Tensor const& v,
                                            Tensor const& out, Tensor const& lse, double scale, bool causal,
                                            bool deterministic, c10::string_view schedule, int64_t sm_margin) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dash::bwd", "")
                       .typed<std::tuple<Tensor, Tensor, Tensor>(Tensor const&, Tensor const&, Tensor const&,
                                                                 Tensor const&, Tensor const&, Tensor const&, double,
                                                                 bool, bool, c10::string_view, int64_t)>();
  return op.call(dout, q, k, v, out, lse, scale, causal, deterministic, schedule, sm_margin);
}

// Under create_graph=True the gradients are exact to first order, but they are not
// differentiable again: dash::bwd has no backward of its own. Returned as they are, they would
// carry no graph back to q, k, v, and a second differentiation (a gradient penalty, a
// Hessian-vector product) would get no term from attention, silently, or a "does not require
// grad" error far from here. So they are returned as aliases whose node, an Error with edges
// to q, k, v, raises this message if a second backward reaches it (PyTorch's
// once_differentiable does the same, without the edges to the inputs).
constexpr char kNotTwiceDifferentiable[] =
    "DASH's attention backward is not differentiable: with create_graph=True its dq, dk, dv are exact first-order "
    "gradients, but differentiating them again (a gradient penalty, a Hessian-vector product) is not supported";

variable_list first_order_only(variable_list grads, variable_list const& inputs) {
  bool const needed = at::GradMode::is_enabled() &&
                      std::any_of(inputs.begin(), inputs.end(), [](Tensor const& t) { return t.requires_grad(); });
  if (!needed) { return grads; }
  variable_list wired = grads;
  wired.insert(wired.end(), inputs.begin(), inputs.end());
  auto error = std::make_shared<torch::autograd::DelayedError>(kNotTwiceDifferentiable,
                                                               static_cast<int64_t>(wired.size()));
  auto aliases = error->apply(std::move(wired));
  aliases.resize(grads.size());
  return aliases;
}

struct FwdFunction : public torch::autograd::Function<FwdFunction> {
  static variable_list forward(AutogradContext* ctx, Tensor const& q, Tensor const& k, Tensor const& v, double scale,
                               bool causal, bool deterministic, std::string const& schedule, int64_t sm_margin) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = call_fwd(q, k, v, scale, causal, deterministic, schedule, sm_margin);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["schedule"] = schedule;
    ctx->saved_data["sm_margin"] = sm_margin;
    // An unused output's gradient stays undefined instead of a zero tensor the engine
    // would allocate and fill on every backward (softmax_lse is nearly always unused).
    ctx->set_materialize_grads(false);
    // The LSE is returned as a constant (requires_grad=False), as torch.max returns its indices:
    // no gradient flows through it (FA3 ignores one that arrives; here none can arrive, and a
    // loss on the LSE alone says it does not require grad instead of leaving q.grad at None).
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  // grads = (d out, d softmax_lse); the second is always undefined (the LSE is non-differentiable).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Tensor const& dout = grads[0];
    if (!dout.defined()) {  // out not used by the loss (only reachable through another output)
      return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    auto saved = ctx->get_saved_variables();
    Tensor dq, dk, dv;
    {
      // dash::bwd has no autograd: run it below the Autograd key also under create_graph=True
      // (first_order_only says what the gradients then are).
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(dq, dk, dv) = call_bwd(dout.contiguous(), saved[0], saved[1], saved[2], saved[3], saved[4],
                                      ctx->saved_data["scale"].toDouble(), ctx->saved_data["causal"].toBool(),
                                      ctx->saved_data["deterministic"].toBool(),
                                      ctx->saved_data["schedule"].toStringRef(), ctx->saved_data["sm_margin"].toInt());
    }
    auto g = first_order_only({dq, dk, dv}, {saved[0], saved[1], saved[2]});
    return {g[0], g[1], g[2], Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> fwd_autograd(Tensor const& q, Tensor const& k, Tensor const& v, double scale, bool causal,
                                        bool deterministic, c10::string_view schedule, int64_t sm_margin) {
  auto r = FwdFunction::apply(q, k, v, scale, causal, deterministic, std::string(schedule), sm_margin);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(dash, Autograd, m) { m.impl("fwd", &fwd_autograd); }
