// A small ResNet on Fashion-MNIST, data-parallel: LibTorch's MNIST dataset
// and DistributedRandomSampler, every BatchNorm made synchronous, the
// training loop in a function that takes the DDP, as pytorch/examples'
// cpp/mnist takes its model.
//
//   mnist_ddp run --nproc 2 -- ./resnet DIR [STEPS]
//
// DIR holds Fashion-MNIST's four IDX files, unpacked (train-images-idx3-ubyte,
// ...), as torch::data::datasets::MNIST reads them.
#include <mnist_ddp/ddp.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <utility>

#include "resnet_model.hpp"

// One epoch, as pytorch/examples' cpp/mnist writes its train(): the model
// it took by reference is now the DDP that wraps it, the rest unchanged.
// Returns the steps taken (at most `steps`) and the last loss.
template <typename DataLoader>
std::pair<int, double> train(int64_t epoch, mnist_ddp::DistributedDataParallel<ResNet>& model, torch::Device device,
                             DataLoader& data_loader, torch::optim::Optimizer& optimizer, int steps) {
  model.train();
  int step = 0;
  double loss = 0;
  for (auto& batch : data_loader) {
    if (step == steps) break;
    optimizer.zero_grad();
    const torch::Tensor out = model.forward(batch.data.to(device));
    const torch::Tensor l = torch::nn::functional::cross_entropy(out, batch.target.to(device));
    l.backward();
    optimizer.step();
    loss = l.item<double>();
    ++step;
  }
  return {step, loss};
}

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
  mnist_ddp::DistributedDataParallel<ResNet> ddp(model, group);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  const auto dataset = torch::data::datasets::MNIST(argv[1])
                           .map(torch::data::transforms::Normalize<>(0.2860, 0.3530))
                           .map(torch::data::transforms::Stack<>());
  const size_t size = dataset.size().value();
  int done = 0;
  double loss = 0;
  for (int64_t epoch = 0; done < steps; ++epoch) {
    // A loader owns its sampler: each epoch gets a sampler of its own, its
    // order drawn from the epoch, as set_epoch() does in Python. The dataset
    // is copied, which shares its tensors.
    torch::data::samplers::DistributedRandomSampler sampler(size, group.world_size(), group.rank());
    sampler.set_epoch(static_cast<size_t>(epoch));
    auto loader = torch::data::make_data_loader(dataset, std::move(sampler),
                                                torch::data::DataLoaderOptions().batch_size(32));
    const auto [taken, last] = train(epoch, ddp, group.device(), *loader, optimizer, steps - done);
    if (taken == 0) break;
    done += taken;
    loss = last;
  }
  ddp.check_replicas("after training");
  std::cout << "resnet: rank " << group.rank() << " of " << group.world_size() << ": " << done
            << " steps, loss " << loss << ", replicas identical" << std::endl;
  return 0;
} catch (const mnist_ddp::Error& e) {  // the library's one line; a peer may be gone: no destructors
  std::cerr << "resnet: " << e.what() << std::endl;
  std::_Exit(1);
} catch (const std::exception& e) {
  std::cerr << "resnet: " << mnist_ddp::error_line(e) << std::endl;
  std::_Exit(1);
}
