// SyncBatchNorm as the library sees it: BatchNorm followed by ReLU, fused
// where SyncBatchNorm can fuse them (the mnist_ddp application's Net calls
// it). Not installed.
#pragma once

#include <torch/torch.h>

#include "mnist_ddp/parallel/sync_batch_norm.hpp"

namespace mnist_ddp {

// relu(bn(input)); in training on more than one rank, with a contiguous
// float32 NCHW input on the CPU and affine parameters, fused into three
// passes over the activations forward and two backward.
torch::Tensor sync_batch_norm_relu(SyncBatchNormImpl& bn, const torch::Tensor& input);

// relu(layer(input)) for `layer` a BatchNorm1d/2d/3d or a SyncBatchNorm
// (fused where sync_batch_norm_relu fuses).
torch::Tensor batch_norm_relu(torch::nn::Module& layer, const torch::Tensor& input);

}  // namespace mnist_ddp
