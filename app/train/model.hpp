// The reference's CNN, with the reference's state-dict names.
//
// conv1 (1->32, 3x3) -> bn1 -> relu -> conv2 (32->64, 3x3) -> bn2 -> relu ->
// max_pool 2 -> dropout 0.25 -> flatten -> fc1 (9216->128) -> relu ->
// dropout 0.5 -> fc2 (128->10) -> log_softmax. 1,200,074 parameters.
#pragma once

#include <torch/torch.h>

namespace mnist_ddp {

class NetImpl : public torch::nn::Module {
 public:
  NetImpl();
  torch::Tensor forward(torch::Tensor x);

 private:
  // bn1 and bn2 are looked up by name on every forward, so the layers that
  // convert_sync_batchnorm() puts in their place are the ones that run.
  torch::Tensor norm_relu(const std::string& name, const torch::Tensor& x);

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

}  // namespace mnist_ddp
