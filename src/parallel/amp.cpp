#include "mnist_ddp/parallel/amp.hpp"

#include <torch/torch.h>

#include <map>
#include <mutex>
#include <sstream>
#include <utility>

#include "mnist_ddp/base/errors.hpp"
#include "base/port.hpp"
#include "base/require.hpp"
#include "comm/group.hpp"
#include "parallel/advice.hpp"

namespace mnist_ddp {

Autocast::Autocast(const torch::Device& device, c10::ScalarType dtype)
    : type_(device.type()), was_enabled_(port::autocast_enabled(type_)), was_dtype_(port::autocast_dtype(type_)) {
  try {
    port::set_autocast(type_, true, dtype);
  } catch (const c10::Error& e) {  // this LibTorch's autocast has no such dtype on that device
    port::set_autocast(type_, was_enabled_, was_dtype_);
    throw UsageError("Autocast(" + device.str() + ", " + c10::toString(dtype) + "): " + error_line(e) +
                     " (autocast_unsupported() says so before)");
  }
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  port::set_autocast(type_, was_enabled_, was_dtype_);
}

std::string autocast_unsupported(const torch::Device& device, c10::ScalarType dtype) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, c10::ScalarType>, std::string> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device.str(), dtype);
  if (const auto it = known.find(key); it != known.end()) return it->second;
  const std::string name = dtype == torch::kHalf ? "float16" : dtype == torch::kBFloat16 ? "bfloat16" : c10::toString(dtype);
  const std::string no = std::string("this LibTorch's ") + (device.is_cuda() ? "CUDA" : "CPU") + " autocast has no " + name;
  std::string why;
  try {
    torch::NoGradGuard no_grad;
    const auto a = torch::ones({4, 4}, torch::TensorOptions().device(device));
    c10::ScalarType got;
    {
      Autocast autocast(device, dtype);
      got = torch::mm(a, a).scalar_type();
    }
    if (got != dtype) why = no;
  } catch (const std::exception&) {
    why = no;
  }
  return known[key] = why;
}

GradScaler::GradScaler(ProcessGroup group, GradScalerOptions options)
    : group_(std::move(group)), options_(std::move(options)), scale_(options_.init_scale()) {
  use_library_advice();
  MNIST_DDP_REQUIRE(scale_ > 0 && options_.growth_factor() > 1 && options_.backoff_factor() > 0 &&
                  options_.backoff_factor() < 1 && options_.growth_interval() > 0,
              "GradScaler: init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval > 0");
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) const { return loss * scale_; }

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  // The scale is a power of 2 at the defaults: unscaling is exact, and
  // elementwise, so every rank's averaged gradients stay bit-identical.
  const double inverse = 1.0 / scale_;
  torch::Tensor found;  // this rank's gradients hold an inf or NaN
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      p.mutable_grad().mul_(inverse);
      const auto bad = p.grad().isfinite().logical_not().any().to(torch::kFloat64);
      found = found.defined() ? found.add_(bad) : bad.clone();
    }
  if (!agreed_) {  // every rank's scaler with the same options: compared at its first step
    std::ostringstream o;
    o << "init_scale " << options_.init_scale() << ", growth_factor " << options_.growth_factor() << ", backoff_factor "
      << options_.backoff_factor() << ", growth_interval " << options_.growth_interval();
    const std::string difference = quick_stream(group_)->disagreement(
        {{"options", o.str()}, {"scale", std::to_string(scale_)}}, "GradScaler",
        "every rank must make its GradScaler with the same options and state", Issuer(kScalerVote, 0, -1, "GradScaler's first step"));
    if (!difference.empty()) throw UsageError(difference);
    agreed_ = true;
  }
  auto any = (found.defined() ? found.reshape({1}) : torch::zeros({1}, torch::kFloat64)).to(group_.device());
  quick_stream(group_)->allreduce_sum(any, Issuer(kScalerVote, 0, -1, "GradScaler's vote on skipping the step"));
  found_inf_ = any.cpu().item<double>() > 0;
  if (found_inf_) {
    ++skipped_;
    return false;
  }
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (found_inf_) {
    scale_ *= options_.backoff_factor();
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    growth_tracker_ = 0;
  }
  found_inf_ = false;
}

torch::Tensor GradScaler::state() const {
  return torch::tensor({scale_, static_cast<double>(growth_tracker_)}, torch::kFloat64);
}

void GradScaler::load_state(const torch::Tensor& state) {
  MNIST_DDP_REQUIRE(state.numel() == 2 && state.scalar_type() == torch::kFloat64, "GradScaler: not a scaler's state");
  const auto s = state.cpu();
  MNIST_DDP_REQUIRE(s[0].item<double>() > 0, "GradScaler: a scale of ", s[0].item<double>());
  scale_ = s[0].item<double>();
  growth_tracker_ = static_cast<int64_t>(s[1].item<double>());
}

}  // namespace mnist_ddp
