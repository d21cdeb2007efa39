#include "app/train/model.hpp"

#include "app/train/layers.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "parallel/norm.hpp"

namespace mnist_ddp {

NetImpl::NetImpl() {
  // Registration order is the reference's, so state_dict() lists the same
  // names in the same order.
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).stride(1)));
  register_module("bn1", torch::nn::BatchNorm2d(32));
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).stride(1)));
  register_module("bn2", torch::nn::BatchNorm2d(64));
  fc1 = register_module("fc1", torch::nn::Linear(9216, 128));
  fc2 = register_module("fc2", torch::nn::Linear(128, 10));
}

torch::Tensor NetImpl::norm_relu(const std::string& name, const torch::Tensor& x) {
  const std::shared_ptr<torch::nn::Module> layer = named_children()[name];
  return batch_norm_relu(*layer, x);
}

torch::Tensor NetImpl::forward(torch::Tensor x) {
  x = norm_relu("bn1", conv1->forward(x));
  x = norm_relu("bn2", conv2->forward(x));
  x = max_pool2_dropout(x, 0.25, is_training());
  x = torch::flatten(x, 1);
  x = torch::relu(fc1->forward(x));
  x = net_dropout(x, 0.5, is_training());
  return torch::log_softmax(fc2->forward(x), 1);
}

}  // namespace mnist_ddp
