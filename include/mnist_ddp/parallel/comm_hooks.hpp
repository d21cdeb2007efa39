// Communication hooks: how DistributedDataParallel averages a bucket of
// gradients across ranks.
//
// The interface is PyTorch's: a hook receives a GradBucket holding this
// rank's gradients (NOT yet divided by the world size) and returns a future
// of a tensor shaped like the bucket that holds the average. DDP runs hooks
// as tasks of an ordered collective stream, one bucket at a time and in
// bucket order on every rank, so a hook may wait on its own collectives
// (distributed.hpp, collectives.hpp).
//
// Hooks talk to the other ranks only through a Wire. The float16 and
// bfloat16 wrappers hand the hook they wrap a wire that sends 16-bit
// floats, so they compose with any hook while the hook itself computes in
// its bucket's precision.
//
// The built-in hooks, named as PyTorch names them:
//   hooks::allreduce()                 PyTorch's allreduce_hook
//   hooks::fp16_compress()             fp16_compress_hook
//   hooks::bf16_compress()             bf16_compress_hook
//   hooks::fp16_compress_wrapper(h)    fp16_compress_wrapper
//   hooks::bf16_compress_wrapper(h)    bf16_compress_wrapper
//   hooks::powersgd(options)           powerSGD_hook with a PowerSGDState
//   hooks::batched_powersgd(options)   batched_powerSGD_hook
// A program's own hook is a subclass of CommHook, registered the same way.
#pragma once

#include <torch/torch.h>
#include <torch/arg.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mnist_ddp/comm/collectives.hpp"

namespace mnist_ddp::hooks {

struct GradBucket {
  size_t index = 0;      // position in launch order
  bool is_last = false;  // the last bucket of a step: per-step state advances here
  torch::Tensor buffer;  // flat, this rank's gradients, not divided by world size
  // Views into buffer, shaped as the parameters, lying in order without gaps.
  std::vector<torch::Tensor> gradients;
};

// The gradients' shapes laid over `flat`, a tensor of the bucket's size.
std::vector<torch::Tensor> same_layout(const GradBucket& bucket, const torch::Tensor& flat);

// The tensor a hook's future completed with (a Tensor, or a list of one).
torch::Tensor future_tensor(const FuturePtr& future);

// The collective a hook uses. Both calls work in place on `tensor` and
// complete their future with it.
class Wire {
 public:
  virtual ~Wire() = default;
  virtual int world_size() const = 0;
  virtual FuturePtr allreduce_sum(torch::Tensor tensor) = 0;
  // Sum of tensor / world_size: dividing first keeps 16-bit sums finite.
  virtual FuturePtr allreduce_mean(torch::Tensor tensor);
};

// What a rank has sent: `elements x element size` of each allreduce.
struct WireStats {
  int64_t elements = 0;
  int64_t bytes = 0;
};

// The wire of a collective stream's channel, for use inside a task.
// Counts what it sends into `stats`.
class GroupWire : public Wire {
 public:
  GroupWire(Channel& channel, WireStats& stats) : channel_(channel), stats_(stats) {}
  int world_size() const override { return channel_.world_size(); }
  FuturePtr allreduce_sum(torch::Tensor tensor) override;

 private:
  Channel& channel_;
  WireStats& stats_;
};

// Puts `type` (float16 or bfloat16) on the wire below it: tensors are cast
// down before and back after; a mean is divided by the world size in the
// tensor's own precision before the cast.
class CastWire : public Wire {
 public:
  CastWire(Wire& below, c10::ScalarType type) : below_(below), type_(type) {}
  int world_size() const override { return below_.world_size(); }
  FuturePtr allreduce_sum(torch::Tensor tensor) override;
  FuturePtr allreduce_mean(torch::Tensor tensor) override;

 private:
  Wire& below_;
  c10::ScalarType type_;
};

// A hook's state between steps, as named tensors: what a checkpoint keeps.
// `shared` is identical on every rank; `own` is this rank's alone (PowerSGD's
// error feedback), so every rank keeps its own.
struct HookState {
  std::map<std::string, torch::Tensor> shared;
  std::map<std::string, torch::Tensor> own;
  bool empty() const { return shared.empty() && own.empty(); }
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // "none", "fp16", "bf16", "powersgd", "powersgd_fp16", ...
  virtual std::string name() const = 0;
  // Called on the communication thread, once per bucket and backward, in
  // bucket order. May block on its collectives.
  virtual FuturePtr run(GradBucket& bucket, Wire& wire) = 0;
  // Whether the coming step compresses as fully as this hook ever will
  // (false during PowerSGD's plain-allreduce warm-up).
  virtual bool compression_started() const { return true; }
  virtual HookState state() const { return {}; }
  // Takes back what state() returned (on any device: tensors move to the
  // bucket's). Throws c10::Error for a state of another hook or layout.
  virtual void load_state(const HookState& state) {}
};
using CommHookPtr = std::shared_ptr<CommHook>;

// A hook's state in a program's checkpoint: torch::save(*hook, "hook.pt")
// on each rank (its `own` part is that rank's), torch::load(*hook, ...)
// to resume exactly.
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const CommHook& hook);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, CommHook& hook);

// none: allreduce of the bucket, divided by world size.
class AllreduceHook : public CommHook {
 public:
  std::string name() const override { return "none"; }
  FuturePtr run(GradBucket& bucket, Wire& wire) override;
};

// Runs `inner` with float16 or bfloat16 on the wire.
class CompressWrapper : public CommHook {
 public:
  CompressWrapper(CommHookPtr inner, c10::ScalarType type);
  std::string name() const override;
  FuturePtr run(GradBucket& bucket, Wire& wire) override;
  bool compression_started() const override { return inner_->compression_started(); }
  HookState state() const override { return inner_->state(); }
  void load_state(const HookState& state) override { inner_->load_state(state); }
  const CommHookPtr& inner() const { return inner_; }

 private:
  CommHookPtr inner_;
  c10::ScalarType type_;
};

// PyTorch's PowerSGDState knobs, with PyTorch's defaults.
struct PowerSgdOptions {
  // r: the rank of each approximation P Q^T.
  TORCH_ARG(int64_t, matrix_approximation_rank) = 1;
  // Plain allreduce before this step (PyTorch's start_powerSGD_iter).
  TORCH_ARG(int64_t, start_powersgd_iter) = 1000;
  // An n x m gradient is compressed only if (n + m) r min_compression_rate < n m.
  TORCH_ARG(double, min_compression_rate) = 2;
  // Carry each rank's compression error into its next step.
  TORCH_ARG(bool, use_error_feedback) = true;
  // Reuse last step's Q instead of drawing a new one.
  TORCH_ARG(bool, warm_start) = true;
  // Added to column norms in Gram-Schmidt.
  TORCH_ARG(double, orthogonalization_epsilon) = 0;
  // Seeds Q's draws, identically on every rank.
  TORCH_ARG(uint64_t, random_seed) = 0;
  // Accepted for PyTorch's sake, without effect: the library logs nothing
  // (compression_stats() counts instead), and every bucket's P and Q
  // already travel in one allreduce each.
  TORCH_ARG(int64_t, compression_stats_logging_frequency) = 10000;
  TORCH_ARG(bool, batch_tensors_with_same_shape) = false;
};

// What PowerSGD remembers between steps, by bucket index: the state a
// resumed run needs to continue exactly (with the same bucket layout).
struct PowerSgdState {
  int64_t iter = 0;    // steps finished
  uint64_t draws = 0;  // seeds of Q drawn so far
  std::map<size_t, torch::Tensor> error;     // this rank's compression error (own)
  std::map<size_t, torch::Tensor> p_memory;  // flat P of every compressed matrix (shared)
  std::map<size_t, torch::Tensor> q_memory;  // flat Q, reused when warm-starting (shared)
};

// What both PowerSGD hooks share: their options and state, and plain
// allreduces until start_powersgd_iter; then compress() averages the bucket
// in place.
class PowerSgdBase : public CommHook {
 public:
  FuturePtr run(GradBucket& bucket, Wire& wire) final;
  bool compression_started() const override;
  HookState state() const override;
  void load_state(const HookState& state) override;

  const PowerSgdOptions& options() const { return options_; }
  const PowerSgdState& powersgd_state() const { return state_; }
  void load_powersgd_state(PowerSgdState state) { state_ = std::move(state); }
  // Elements of the buckets compressed so far, before and after compression.
  std::pair<int64_t, int64_t> compression_stats() const { return {elements_before_, elements_after_}; }

 protected:
  explicit PowerSgdBase(const PowerSgdOptions& options) : options_(options) {}
  virtual void compress(GradBucket& bucket, Wire& wire) = 0;
  // A fresh seed for drawing Q, the same sequence on every rank.
  uint64_t next_seed();

  PowerSgdOptions options_;
  PowerSgdState state_;
  int64_t elements_before_ = 0, elements_after_ = 0;
};

// powersgd: per bucket, error feedback; each gradient seen as an n x m
// matrix (n = its first dimension) is compressed to P [n, r] and Q [m, r]
// when (n + m) r min_compression_rate < n m; all other gradients go
// uncompressed in one allreduce, all P in one, all Q in one.
class PowerSgdHook : public PowerSgdBase {
 public:
  explicit PowerSgdHook(const PowerSgdOptions& options) : PowerSgdBase(options) {}
  std::string name() const override { return "powersgd"; }

 private:
  void compress(GradBucket& bucket, Wire& wire) override;
};

// batched_powersgd: the whole bucket as one square matrix of side
// ceil(sqrt(N)), zero-padded, compressed to P and Q of that side. Works on a
// padded copy, so the bucket itself never changes size (PyTorch resizes it,
// which is where its batched hook fails).
class BatchedPowerSgdHook : public PowerSgdBase {
 public:
  explicit BatchedPowerSgdHook(const PowerSgdOptions& options) : PowerSgdBase(options) {}
  std::string name() const override { return "batched_powersgd"; }

 private:
  void compress(GradBucket& bucket, Wire& wire) override;
};

CommHookPtr allreduce();
CommHookPtr fp16_compress();
CommHookPtr bf16_compress();
CommHookPtr fp16_compress_wrapper(CommHookPtr hook);
CommHookPtr bf16_compress_wrapper(CommHookPtr hook);
std::shared_ptr<PowerSgdHook> powersgd(const PowerSgdOptions& options = {});
std::shared_ptr<BatchedPowerSgdHook> batched_powersgd(const PowerSgdOptions& options = {});

}  // namespace mnist_ddp::hooks
