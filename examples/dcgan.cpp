// A DCGAN-style pair, as pytorch/examples' cpp/dcgan trains it: a generator
// and a discriminator, each its own DistributedDataParallel and optimizer;
// the discriminator runs on real and on generated data every step, and its
// gradients travel through a hook of the program's own (topk.hpp).
//
//   mnist_ddp run --nproc 2 -- ./dcgan [STEPS]
//
// "Real" images are drawn from a fixed pattern plus noise, so the program
// needs no data set.
#include <mnist_ddp/ddp.hpp>
#include <torch/torch.h>

#include "topk.hpp"

#include <cstdlib>
#include <iostream>

namespace nn = torch::nn;
constexpr int64_t kNoise = 16, kPixels = 64;

int main(int argc, char** argv) try {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 20;
  auto group = mnist_ddp::init_process_group();
  torch::manual_seed(0);
  nn::Sequential generator(nn::Linear(kNoise, 32), nn::BatchNorm1d(32), nn::ReLU(), nn::Linear(32, kPixels), nn::Tanh());
  nn::Sequential discriminator(nn::Linear(kPixels, 32), nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
                               nn::Linear(32, 1));
  mnist_ddp::convert_sync_batchnorm(generator);
  generator->to(group.device());
  discriminator->to(group.device());
  mnist_ddp::DistributedDataParallel g(generator, group), d(discriminator, group);
  d.register_comm_hook(std::make_shared<TopKHook>(0.25));  // a quarter of its gradients on the wire
  torch::optim::Adam g_optimizer(generator->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  torch::optim::Adam d_optimizer(discriminator->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));

  torch::manual_seed(1 + group.rank());
  const auto on = torch::TensorOptions().device(group.device());
  const auto pattern = torch::linspace(-1, 1, kPixels, on).sin();
  torch::Tensor d_loss, g_loss;
  for (int step = 0; step < steps; ++step) {
    const auto real = pattern + 0.1 * torch::randn({32, kPixels}, on);
    const auto ones = torch::ones({32, 1}, on), zeros = torch::zeros({32, 1}, on);
    // The discriminator: real images are real, generated ones are not.
    d_optimizer.zero_grad();
    const auto d_real = torch::binary_cross_entropy_with_logits(d.forward(real), ones);
    d_real.backward();
    const auto fake = g.forward(torch::randn({32, kNoise}, on));
    const auto d_fake = torch::binary_cross_entropy_with_logits(d.forward(fake.detach()), zeros);
    d_fake.backward();
    d_optimizer.step();
    d_loss = d_real + d_fake;
    // The generator: make the discriminator call them real.
    g_optimizer.zero_grad();
    g_loss = torch::binary_cross_entropy_with_logits(d.forward(fake), ones);
    g_loss.backward();
    g_optimizer.step();
  }
  g.check_replicas("after training (generator)");
  d.check_replicas("after training (discriminator)");
  std::cout << "dcgan: rank " << group.rank() << " of " << group.world_size() << ": " << steps
            << " steps, discriminator loss " << d_loss.item<double>() << ", generator loss " << g_loss.item<double>()
            << ", replicas identical" << std::endl;
  return 0;
} catch (const mnist_ddp::Error& e) {  // the library's one line; a peer may be gone: no destructors
  std::cerr << "dcgan: " << e.what() << std::endl;
  std::_Exit(1);
} catch (const std::exception& e) {
  std::cerr << "dcgan: " << mnist_ddp::error_line(e) << std::endl;
  std::_Exit(1);
}
