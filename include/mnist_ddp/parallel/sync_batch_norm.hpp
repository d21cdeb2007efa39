// Synchronous batch normalisation: batch statistics over every rank's batch.
//
// Training forward: every rank contributes per-channel count, sum and sum of
// squares in ONE allreduce; the global mean and biased variance normalise the
// input, and the running statistics take the unbiased global variance.
// Backward: the global sums of dy and dy * x_hat come from ONE allreduce, so
// the input gradient is exactly that of BatchNorm on the concatenated
// batch. The weight and bias gradients are this rank's sums over its own
// batch: DDP averages them over ranks, as PyTorch's SyncBatchNorm leaves it.
// Eval: running statistics, no communication. World size 1: BatchNorm.
// Any input of 2 to 5 dimensions [N, C, ...], as BatchNorm1d/2d/3d take.
//
// The statistics travel over the layer's process group: forward blocks the
// calling thread, backward blocks autograd's, each for one allreduce.
// Works with CPU or CUDA tensors on Gloo and CUDA tensors on NCCL. The
// running statistics are computed from the allreduced sums elementwise
// only, so they stay bit-identical across ranks. Ranks may hold different
// batch sizes, including none at all, but every rank must run the same
// training forwards and backwards: a training forward on some ranks only
// (sampling from rank 0 in train mode) is a CollectiveMismatch naming it.
//
// Which group: the one convert_sync_batchnorm() or the layer's
// set_process_group() names; else the group of the DistributedDataParallel
// that wraps the model (it binds every SyncBatchNorm without one); else the
// process's default group (init_process_group()); with none, the process
// is alone, and the layer is BatchNorm.
//
// Thread safety: as any module: one forward at a time.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <optional>
#include <string>

#include "mnist_ddp/comm/process_group.hpp"

namespace mnist_ddp {

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  // Fresh parameters and statistics, as BatchNorm2d(options) has them.
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options);
  explicit SyncBatchNormImpl(int64_t num_features) : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}
  // Takes over a BatchNorm1d/2d/3d's parameters and buffers (the same
  // tensors, not copies) and its training mode.
  template <size_t D, typename Derived>
  explicit SyncBatchNormImpl(const torch::nn::BatchNormImplBase<D, Derived>& bn) : options(bn.options) {
    weight = bn.weight;
    bias = bn.bias;
    running_mean = bn.running_mean;
    running_var = bn.running_var;
    num_batches_tracked = bn.num_batches_tracked;
    register_state();
    train(bn.is_training());
  }

  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);

  // The group whose statistics this layer takes (see the top of the file).
  void set_process_group(const ProcessGroup& group) { group_ = group; }
  // The group set_process_group() named; nullopt: none yet.
  const std::optional<ProcessGroup>& process_group() const { return group_; }
  // Its name in its model ("features.1"), which its collectives give in
  // what they say of themselves; convert_sync_batchnorm() or the DDP that
  // wraps the model sets it, "" until then.
  const std::string& layer_name() const { return name_; }
  void set_layer_name(std::string name) { name_ = std::move(name); }

  torch::nn::BatchNormOptions options;
  torch::Tensor weight, bias;                                   // parameters (undefined unless affine)
  torch::Tensor running_mean, running_var, num_batches_tracked;  // buffers (undefined unless tracked)

 private:
  void register_state();
  std::optional<ProcessGroup> group_;
  std::string name_;  // in its model, for what its collectives say of themselves
};
TORCH_MODULE(SyncBatchNorm);

// Replaces every BatchNorm1d, BatchNorm2d and BatchNorm3d in `module`'s tree
// with a SyncBatchNorm that holds the same parameters and buffers, so
// state-dict names, values and an optimizer made before stay as they were.
// A layer registered as a child (called through named_children(), or
// through a Sequential, whose list is changed too) is replaced where the
// forward finds it. A layer the forward reaches some other way (a member
// handle such as `torch::nn::BatchNorm2d bn` that LibTorch cannot
// re-point, or an entry of a ModuleList or ModuleDict, which the forward
// casts back to its type) is refused with a UsageError naming it and saying
// how to declare a SyncBatchNorm in its place; then nothing is changed.
// `group`: see the header's note (nullopt: bound later).
void convert_sync_batchnorm(torch::nn::Module& module, const std::optional<ProcessGroup>& group = std::nullopt);
// The same through a pointer: a null one is a UsageError.
void convert_sync_batchnorm(torch::nn::Module* module, const std::optional<ProcessGroup>& group = std::nullopt);

template <typename ModuleType>
void convert_sync_batchnorm(const std::shared_ptr<ModuleType>& module,
                            const std::optional<ProcessGroup>& group = std::nullopt) {
  convert_sync_batchnorm(static_cast<torch::nn::Module*>(module.get()), group);
}

template <typename ModuleType>
void convert_sync_batchnorm(const torch::nn::ModuleHolder<ModuleType>& module,
                            const std::optional<ProcessGroup>& group = std::nullopt) {
  convert_sync_batchnorm(module.is_empty() ? nullptr : static_cast<torch::nn::Module*>(module.ptr().get()), group);
}

}  // namespace mnist_ddp
