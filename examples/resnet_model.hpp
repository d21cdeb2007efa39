// The small ResNet of examples/resnet.cpp, on 28x28 single-channel
// images: a stem, two residual blocks of 16 channels, global pooling, 10
// classes. scripts/bench_library.sh times it too (with scripts/python_ddp.py's
// same model in Python).
#pragma once

#include <torch/torch.h>

namespace nn = torch::nn;

inline nn::Conv2dOptions conv3x3(int64_t in, int64_t out) { return nn::Conv2dOptions(in, out, 3).padding(1).bias(false); }

// conv-bn-relu-conv-bn, plus the input.
struct BlockImpl : nn::Module {
  explicit BlockImpl(int64_t channels) {
    body = register_module("body", nn::Sequential(nn::Conv2d(conv3x3(channels, channels)), nn::BatchNorm2d(channels),
                                                   nn::ReLU(), nn::Conv2d(conv3x3(channels, channels)),
                                                   nn::BatchNorm2d(channels)));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::relu(x + body->forward(x)); }
  nn::Sequential body{nullptr};
};
TORCH_MODULE(Block);

struct ResNetImpl : nn::Module {
  ResNetImpl() {
    features = register_module(
        "features", nn::Sequential(nn::Conv2d(conv3x3(1, 16)), nn::BatchNorm2d(16), nn::ReLU(), Block(16),
                                   nn::MaxPool2d(2), Block(16), nn::AdaptiveAvgPool2d(1)));
    fc = register_module("fc", nn::Linear(16, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(features->forward(x).flatten(1)); }
  nn::Sequential features{nullptr};
  nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);
