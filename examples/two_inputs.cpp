// The library's API in one program: a model of two inputs and two outputs,
// its BatchNorm made synchronous, PowerSGD with float16 on the wire, and
// gradients accumulated over two micro-batches per step. Run it under any
// launcher, or alone:
//
//   mnist_ddp run --nproc 2 -- ./two_inputs [STEPS]
//   python3 -m torch.distributed.run --nproc_per_node 2 --no_python ./two_inputs
//   mpirun -np 2 ./two_inputs
#include <mnist_ddp/ddp.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <tuple>

// Two inputs, two outputs; the norm layer inside a Sequential, where
// convert_sync_batchnorm() reaches it. A TORCH_MODULE holder, as LibTorch's
// own modules are.
struct MyNetImpl : torch::nn::Module {
  MyNetImpl() {
    a = register_module("a", torch::nn::Linear(8, 16));
    b = register_module("b", torch::nn::Linear(4, 16));
    norm = register_module("norm", torch::nn::Sequential(torch::nn::BatchNorm1d(16), torch::nn::ReLU()));
    head = register_module("head", torch::nn::Linear(16, 3));
    side = register_module("side", torch::nn::Linear(16, 1));
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::Tensor y) {
    auto h = norm->forward(a(x) + b(y));
    return {head(h), side(h)};
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, head{nullptr}, side{nullptr};
  torch::nn::Sequential norm{nullptr};
};
TORCH_MODULE(MyNet);

// The program's own loss of MyNet's outputs.
torch::Tensor my_loss(const std::tuple<torch::Tensor, torch::Tensor>& out) {
  return std::get<0>(out).pow(2).mean() + std::get<1>(out).abs().mean();
}

// One step of two micro-batches; the DDP passed as any object is.
torch::Tensor train_step(mnist_ddp::DistributedDataParallel<MyNet>& ddp, torch::optim::Optimizer& optimizer,
                         const torch::TensorOptions& on) {
  const auto a1 = torch::randn({16, 8}, on), b1 = torch::randn({16, 4}, on);
  const auto a2 = torch::randn({16, 8}, on), b2 = torch::randn({16, 4}, on);
  optimizer.zero_grad();
  { auto guard = ddp.no_sync(); my_loss(ddp.forward(a1, b1)).backward(); }  // accumulates locally, sends nothing
  auto out = ddp.forward(a2, b2);    // takes what MyNet's forward takes, returns what it returns
  auto loss = my_loss(out);
  loss.backward();                   // returns with the gradients of both micro-batches averaged over ranks
  optimizer.step();
  return loss;
}

int main(int argc, char** argv) try {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 12;
  auto group = mnist_ddp::init_process_group();
  torch::manual_seed(0);
  MyNet model;
  mnist_ddp::convert_sync_batchnorm(model);
  model->to(group.device());
  mnist_ddp::DistributedDataParallel<MyNet> ddp(model, group,
      mnist_ddp::DdpOptions().bucket_cap_mb(25).find_unused_parameters(true));
  ddp.register_comm_hook(mnist_ddp::hooks::fp16_compress_wrapper(mnist_ddp::hooks::powersgd(
      mnist_ddp::hooks::PowerSgdOptions().matrix_approximation_rank(2).start_powersgd_iter(10))));
  torch::optim::SGD optimizer(model->parameters(), 0.01);

  torch::manual_seed(1 + group.rank());  // each rank its own data
  const auto on = torch::TensorOptions().device(group.device());
  torch::Tensor loss;
  for (int step = 0; step < steps; ++step) loss = train_step(ddp, optimizer, on);
  ddp.check_replicas("after training");  // throws if any rank's parameters differ from rank 0's
  int rank = group.rank(), world = group.world_size();
  std::cout << "two_inputs: rank " << rank << " of " << world << " (" << (group.launcher().empty() ? "alone" : group.launcher()) << ", "
            << group.device() << "): " << steps << " steps, loss " << loss.item<double>()
            << ", replicas identical" << std::endl;
  return 0;
} catch (const mnist_ddp::Error& e) {  // the library's one line; a peer may be gone: no destructors
  std::cerr << "two_inputs: " << e.what() << std::endl;
  std::_Exit(1);
} catch (const std::exception& e) {
  std::cerr << "two_inputs: " << mnist_ddp::error_line(e) << std::endl;
  std::_Exit(1);
}
