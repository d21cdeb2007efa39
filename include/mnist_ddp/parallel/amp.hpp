// Mixed precision as PyTorch users train: autocast over the forward and the
// loss, and, for float16, a loss scale every rank agrees on.
//
//   mnist_ddp::GradScaler scaler(group);                  // float16 only; bfloat16 needs none
//   {
//     mnist_ddp::Autocast autocast(group.device(), torch::kHalf);
//     loss = my_loss(ddp.forward(x));
//   }
//   scaler.scale(loss).backward();
//   scaler.step(optimizer);                              // skipped on every rank when any saw an inf or NaN
//   scaler.update();
//
// Parameters, the optimizer and SyncBatchNorm's statistics stay float32:
// autocast lowers matmuls and convolutions only, as PyTorch's does.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <string>

#include "mnist_ddp/comm/process_group.hpp"

namespace mnist_ddp {

// Autocast to `dtype` on `device`'s type while it lives; the state before
// comes back at its end. Nests. Autocast's state is the calling thread's.
class Autocast {
 public:
  Autocast(const c10::Device& device, c10::ScalarType dtype);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType type_;
  bool was_enabled_;
  c10::ScalarType was_dtype_;
};

// "" when this LibTorch runs autocast to `dtype` on `device` (probed once:
// a small matmul under it comes out in `dtype`); else why not, in a few
// words ("this LibTorch's CPU autocast has no float16").
std::string autocast_unsupported(const c10::Device& device, c10::ScalarType dtype);

// PyTorch's GradScaler knobs and defaults.
struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;  // 2^16
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
};

// A loss scale every rank agrees on: the gradients are averaged before they
// are unscaled, and whether any rank saw an inf or NaN is agreed in one
// small allreduce (on the group's quick stream), so every rank skips the
// same steps even where a hook could hide one (a low-rank approximation),
// and replicas stay bit-identical. Every rank makes its scaler with the same
// options (compared across ranks at the first step()).
// Thread safety: used from the training thread only.
class GradScaler {
 public:
  explicit GradScaler(ProcessGroup group, GradScalerOptions options = {});

  // loss * scale.
  at::Tensor scale(const at::Tensor& loss) const;
  // Collective. Divides the gradients of `optimizer`'s parameters by the
  // scale, agrees with every rank whether any of them is not finite, and
  // steps the optimizer unless one is. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // After step(): halves the scale (backoff_factor) after a skipped step,
  // doubles it (growth_factor) after growth_interval good ones in a row.
  void update();

  double get_scale() const { return scale_; }
  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t skipped_steps() const { return skipped_; }
  // [scale, growth tracker] for a checkpoint, and back.
  at::Tensor state() const;
  void load_state(const at::Tensor& state);

 private:
  ProcessGroup group_;
  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_ = 0;
  bool found_inf_ = false;  // in the last step()
  bool agreed_ = false;     // the options compared across ranks (at the first step())
};

}  // namespace mnist_ddp
