// A small ResNet on Fashion-MNIST, data-parallel: LibTorch's MNIST dataset
// and DistributedRandomSampler, every BatchNorm made synchronous.
//
//   mnist_ddp run --nproc 2 -- ./resnet DIR [STEPS]
//
// DIR holds Fashion-MNIST's four IDX files, unpacked (train-images-idx3-ubyte,
// ...), as torch::data::datasets::MNIST reads them.
#include <mnist_ddp/ddp.hpp>

#include <cstdlib>
#include <iostream>

namespace nn = torch::nn;

nn::Conv2dOptions conv3x3(int64_t in, int64_t out) { return nn::Conv2dOptions(in, out, 3).padding(1).bias(false); }

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

int main(int argc, char** argv) try {
  if (argc < 2) {
    std::cerr << "usage: resnet DIR [STEPS]" << std::endl;
    return 2;
  }
  const int steps = argc > 2 ? std::atoi(argv[2]) : 20;
  auto group = mnist_ddp::init_process_group();
  torch::manual_seed(0);
  ResNet model;
  mnist_ddp::convert_sync_batchnorm(model);
  model->to(group.device());
  mnist_ddp::DistributedDataParallel ddp(model, group);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  auto dataset = torch::data::datasets::MNIST(argv[1])
                     .map(torch::data::transforms::Normalize<>(0.2860, 0.3530))
                     .map(torch::data::transforms::Stack<>());
  torch::data::samplers::DistributedRandomSampler sampler(dataset.size().value(), group.world_size(), group.rank());
  auto loader = torch::data::make_data_loader(std::move(dataset), std::move(sampler),
                                              torch::data::DataLoaderOptions().batch_size(32));
  int step = 0;
  double loss = 0;
  for (auto& batch : *loader) {
    if (step == steps) break;
    optimizer.zero_grad();
    const auto out = ddp.forward(batch.data.to(group.device()));
    const auto l = torch::nn::functional::cross_entropy(out, batch.target.to(group.device()));
    l.backward();
    optimizer.step();
    loss = l.item<double>();
    ++step;
  }
  ddp.reducer().check_replicas("after training");
  std::cout << "resnet: rank " << group.rank() << " of " << group.world_size() << ": " << step
            << " steps, loss " << loss << ", replicas identical" << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "resnet: " << mnist_ddp::error_line(e) << std::endl;
  return 1;
}
