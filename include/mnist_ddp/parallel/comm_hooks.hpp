// Communication hooks: how DistributedDataParallel averages a bucket of
// gradients across ranks.
//
// The interface is PyTorch's: a hook receives a GradBucket holding this
// rank's gradients (NOT yet divided by the world size) and returns a future
// of a tensor shaped like the bucket that holds the average. DDP runs hooks
// as tasks of an ordered collective stream, one bucket at a time and in
// bucket order on every rank, so a hook may wait on its own collectives.
//
// Hooks talk to the other ranks only through their Wire: allreduce,
// allgather and broadcast. The float16 and bfloat16 wrappers hand the hook
// they wrap a wire that sends 16-bit floats, so they compose with any hook
// while the hook itself computes in its bucket's precision.
//
// What a hook must not do (each would hang or break the order every rank
// issues its collectives in):
// - call a ProcessGroup's collectives (allreduce_sum, broadcast, barrier)
//   or anything that issues one (a SyncBatchNorm forward, check_replicas):
//   the hook runs on the thread that issues them, which would wait on itself;
// - issue different collectives on different ranks: every rank runs the
//   same hook on the same bucket and must call its Wire the same way
//   (shapes and dtypes alike), as with any collective;
// - keep the Wire or the bucket's tensors past the step (the Wire lives for
//   one run(); the bucket's buffer is reused every backward).
// A hook's run() is called on the communication thread only, one bucket at
// a time, so its own state needs no lock.
//
// The built-in hooks, named as PyTorch names them:
//   hooks::allreduce()                 PyTorch's allreduce_hook
//   hooks::fp16_compress()             fp16_compress_hook
//   hooks::bf16_compress()             bf16_compress_hook
//   hooks::fp16_compress_wrapper(h)    fp16_compress_wrapper
//   hooks::bf16_compress_wrapper(h)    bf16_compress_wrapper
//   hooks::powersgd(options)           powerSGD_hook with a PowerSGDState
//   hooks::batched_powersgd(options)   batched_powerSGD_hook
// A program's own hook is a subclass of CommHook, registered the same way
// (examples/topk.hpp: top-k sparsification over allgather).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/arg.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mnist_ddp/comm/process_group.hpp"

namespace mnist_ddp::hooks {

// One bucket of one backward, as a hook sees it: read-only, as c10d's
// GradBucket. A hook averages the buffer's values (in place, or into a
// tensor its future returns); which tensor is the bucket's, it cannot
// change.
class GradBucket {
 public:
  GradBucket(size_t index, bool is_last, at::Tensor buffer, std::vector<at::Tensor> gradients,
             std::vector<at::Tensor> parameters, std::vector<std::string> parameter_names)
      : index_(index),
        is_last_(is_last),
        buffer_(std::move(buffer)),
        gradients_(std::move(gradients)),
        parameters_(std::move(parameters)),
        parameter_names_(std::move(parameter_names)) {}
  // Position in launch order, the same on every rank.
  size_t index() const { return index_; }
  // The last bucket of a step: per-step state advances here.
  bool is_last() const { return is_last_; }
  // Flat, this rank's gradients, not divided by world size (complex ones
  // as their real and imaginary parts).
  const at::Tensor& buffer() const { return buffer_; }
  // Views into buffer(), shaped as the parameters (a complex one's as
  // view_as_real's), lying in order without gaps.
  const std::vector<at::Tensor>& gradients() const { return gradients_; }
  // The parameters those gradients belong to, in the same order, and their
  // names in the model ("fc1.weight"), as c10d's GradBucket gives them.
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  const std::vector<std::string>& parameter_names() const { return parameter_names_; }

 private:
  size_t index_;
  bool is_last_;
  at::Tensor buffer_;
  std::vector<at::Tensor> gradients_;
  std::vector<at::Tensor> parameters_;
  std::vector<std::string> parameter_names_;
};

// The gradients' shapes laid over `flat`, a tensor of the bucket's size.
std::vector<at::Tensor> same_layout(const GradBucket& bucket, const at::Tensor& flat);

// The tensor a hook's future completed with (a Tensor, or a list of one).
at::Tensor future_tensor(const FuturePtr& future);

// The collectives a hook uses, over the ranks of its DDP's process group.
// Every rank must make the same calls in the same order, with tensors of
// the same shape and dtype. The calls may block (a hook may wait on them).
class Wire {
 public:
  virtual ~Wire() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Sums `tensor` over the ranks, in place; the future completes with it.
  virtual FuturePtr allreduce_sum(at::Tensor tensor) = 0;
  // Sum of tensor / world_size: dividing first keeps 16-bit sums finite.
  virtual FuturePtr allreduce_mean(at::Tensor tensor);
  // Every rank's `tensor`, stacked in rank order: [world_size, tensor's
  // shape...]; the future completes with that tensor.
  virtual FuturePtr allgather(const at::Tensor& tensor) = 0;
  // Rank `root`'s `tensor` on every rank, in place; the future completes with it.
  virtual FuturePtr broadcast(at::Tensor tensor, int root) = 0;
};

// What a rank has sent through its hooks' wires: elements, and their
// bytes (elements x element size), of each collective.
struct WireStats {
  int64_t elements = 0;
  int64_t bytes = 0;
};

// A hook's state between steps, as named tensors: what a checkpoint keeps.
// `shared` is identical on every rank; `own` is this rank's alone (PowerSGD's
// error feedback), so every rank keeps its own.
struct HookState {
  std::map<std::string, at::Tensor> shared;
  std::map<std::string, at::Tensor> own;
  bool empty() const { return shared.empty() && own.empty(); }
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // "none", "fp16", "bf16", "powersgd", "powersgd_fp16", ...
  virtual std::string name() const = 0;
  // What every rank's hook must share, compared across ranks at the first
  // backward: its kind and its options. name() unless a hook has options.
  virtual std::string describe() const { return name(); }
  // Called on the communication thread, once per bucket and backward, in
  // bucket order. May block on its collectives (see the top of this file
  // for what it must not do).
  virtual FuturePtr run(const GradBucket& bucket, Wire& wire) = 0;
  // Whether the coming step compresses as fully as this hook ever will
  // (false during PowerSGD's plain-allreduce warm-up).
  virtual bool compression_started() const { return true; }
  virtual HookState state() const { return {}; }
  // Takes back what state() returned (on any device: tensors move to the
  // bucket's). Throws UsageError for a state of another hook or layout.
  virtual void load_state(const HookState& /*state*/) {}
  // Where its state is kept by bucket: the names of each bucket's
  // parameters (by index, as GradBucket gives them) that the state was
  // kept for, saved with it. A DDP with static_graph lays its buckets out
  // so before its first step (a resume then means what the saved run
  // did); any other DDP refuses a state kept for other buckets.
  virtual std::vector<std::vector<std::string>> kept_for() const { return {}; }
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
  FuturePtr run(const GradBucket& bucket, Wire& wire) override;
};

// Runs `inner` with float16 or bfloat16 on the wire.
class CompressWrapper : public CommHook {
 public:
  CompressWrapper(CommHookPtr inner, c10::ScalarType type);
  std::string name() const override;
  std::string describe() const override;
  FuturePtr run(const GradBucket& bucket, Wire& wire) override;
  bool compression_started() const override { return inner_->compression_started(); }
  HookState state() const override { return inner_->state(); }
  void load_state(const HookState& state) override { inner_->load_state(state); }
  std::vector<std::vector<std::string>> kept_for() const override { return inner_->kept_for(); }
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
};

// What PowerSGD remembers between steps, by bucket index: the state a
// resumed run needs to continue exactly (with the same bucket layout).
struct PowerSgdState {
  int64_t iter = 0;    // steps finished
  uint64_t draws = 0;  // seeds of Q drawn so far
  std::map<size_t, at::Tensor> error;     // this rank's compression error (own)
  std::map<size_t, at::Tensor> p_memory;  // flat P of every compressed matrix (shared)
  std::map<size_t, at::Tensor> q_memory;  // flat Q, reused when warm-starting (shared)
  std::map<size_t, std::vector<std::string>> layout;  // each bucket's parameters, as the state was kept for them (shared)
};

// What both PowerSGD hooks share: their options and state, and plain
// allreduces until start_powersgd_iter; then compress() averages the bucket
// in place.
class PowerSgdBase : public CommHook {
 public:
  FuturePtr run(const GradBucket& bucket, Wire& wire) final;
  std::string describe() const override;
  bool compression_started() const override;
  HookState state() const override;
  void load_state(const HookState& state) override;
  std::vector<std::vector<std::string>> kept_for() const override;

  const PowerSgdOptions& options() const { return options_; }
  const PowerSgdState& powersgd_state() const { return state_; }
  void load_powersgd_state(PowerSgdState state) { state_ = std::move(state); }
  // Elements of the buckets compressed so far, before and after compression.
  std::pair<int64_t, int64_t> compression_stats() const { return {elements_before_, elements_after_}; }

 protected:
  // UsageError for options PowerSGD cannot work with (a rank below 1, ...).
  explicit PowerSgdBase(const PowerSgdOptions& options);
  virtual void compress(const GradBucket& bucket, Wire& wire) = 0;
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
  void compress(const GradBucket& bucket, Wire& wire) override;
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
  void compress(const GradBucket& bucket, Wire& wire) override;
};

CommHookPtr allreduce();
CommHookPtr fp16_compress();
CommHookPtr bf16_compress();
CommHookPtr fp16_compress_wrapper(CommHookPtr hook);
CommHookPtr bf16_compress_wrapper(CommHookPtr hook);
std::shared_ptr<PowerSgdHook> powersgd(const PowerSgdOptions& options = {});
std::shared_ptr<BatchedPowerSgdHook> batched_powersgd(const PowerSgdOptions& options = {});

}  // namespace mnist_ddp::hooks
