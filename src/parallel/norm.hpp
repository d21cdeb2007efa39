// SyncBatchNorm as the library sees it: its name in the model (what its
// collectives say of themselves), and BatchNorm followed by ReLU, fused
// where SyncBatchNorm can fuse them (the mnist_ddp application's Net calls
// it). Not installed.
#pragma once

#include <torch/torch.h>

#include "mnist_ddp/parallel/sync_batch_norm.hpp"

namespace mnist_ddp {

struct SyncBatchNormAccess {
  // The layer's name in its model ("features.1"), as convert_sync_batchnorm()
  // or the DDP that wraps the model gives it; "" until then.
  static std::string& name(SyncBatchNormImpl& bn) { return bn.name_; }
};

// relu(bn(input)); in training on more than one rank, with a contiguous
// float32 NCHW input on the CPU and affine parameters, fused into three
// passes over the activations forward and two backward.
torch::Tensor sync_batch_norm_relu(SyncBatchNormImpl& bn, const torch::Tensor& input);

// relu(layer(input)) for `layer` a BatchNorm1d/2d/3d or a SyncBatchNorm
// (fused where sync_batch_norm_relu fuses).
torch::Tensor batch_norm_relu(torch::nn::Module& layer, const torch::Tensor& input);

}  // namespace mnist_ddp
