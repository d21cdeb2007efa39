// Synchronous batch normalisation: batch statistics over every rank's batch.
//
// Training forward: every rank contributes per-channel count, sum and sum of
// squares in ONE allreduce; the global mean and biased variance normalise the
// input, and the running statistics take the unbiased global variance.
// Backward: the global sums of dy and dy * x_hat come from ONE allreduce, so
// the input gradient is exactly that of BatchNorm2d on the concatenated
// batch. The weight and bias gradients are this rank's sums over its own
// batch: DDP averages them over ranks, as PyTorch's SyncBatchNorm leaves it.
// Eval: running statistics, no communication. World size 1: BatchNorm2d.
//
// CollectiveStream go through the rank's ordered stream (collectives.hpp): forward
// blocks the calling thread, backward blocks autograd's, each for one
// allreduce. Works with CPU or CUDA tensors on Gloo and CUDA tensors on NCCL.
// The running statistics are computed from the allreduced sums elementwise
// only, so they stay bit-identical across ranks (see comm_hooks.hpp, "exact
// math"). Ranks may hold different batch sizes, including none at all, but
// every rank must run forward and backward the same number of times.
#pragma once

#include <torch/torch.h>

#include <memory>

#include "mnist_ddp/comm/collectives.hpp"

namespace mnist_ddp {

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  // Fresh parameters and statistics, as BatchNorm2d(options) has them.
  SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, std::shared_ptr<CollectiveStream> stream);
  // Takes over `bn`'s parameters and buffers (the same tensors, not copies).
  SyncBatchNormImpl(const torch::nn::BatchNorm2dImpl& bn, std::shared_ptr<CollectiveStream> stream);

  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  // relu(forward(input)); in training on more than one rank, with a
  // contiguous float32 NCHW input on the CPU, fused into three passes over
  // the activations forward and two backward.
  torch::Tensor forward_relu(const torch::Tensor& input);

  torch::nn::BatchNormOptions options;
  std::shared_ptr<CollectiveStream> stream;
  torch::Tensor weight, bias;                                   // parameters
  torch::Tensor running_mean, running_var, num_batches_tracked;  // buffers

 private:
  void register_state();
  void check_channels(const torch::Tensor& input) const;
};
TORCH_MODULE(SyncBatchNorm);

// Replaces every BatchNorm2d in `module`'s tree with a SyncBatchNorm over
// `stream` that holds the same parameters and buffers, so state-dict names and
// values are unchanged. A parent sees the replacement if it calls its
// normalisation children through batch_norm_relu() by registered name, as
// Net does.
void convert_sync_batchnorm(torch::nn::Module& module, const std::shared_ptr<CollectiveStream>& stream);

// relu(layer(input)) for `layer` a BatchNorm2d or a SyncBatchNorm (fused
// where SyncBatchNormImpl::forward_relu fuses).
torch::Tensor batch_norm_relu(torch::nn::Module& layer, const torch::Tensor& input);

}  // namespace mnist_ddp
