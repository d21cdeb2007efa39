// What this binary was built against and runs on, and the device a thread
// works on.
#pragma once

#include <torch/torch.h>

#include <string>

namespace mnist_ddp {

struct Runtime {
  std::string libtorch;  // "2.11.0"
  std::string cuda;      // "13.0"; "" without CUDA
  std::string nccl;      // "2.28.9"; "" without CUDA
  std::string device;    // "cuda:0 (NVIDIA H100 80GB HBM3)", "cpu"
  // The rendezvous store's server loop: "libuv" or "classic" (store.hpp).
  std::string store;
  // "LibTorch 2.11.0, CUDA 13.0, NCCL 2.28.9, device cuda:0 (NVIDIA H100 ...), libuv store"
  std::string describe() const;
};
Runtime runtime_of(const torch::Device& device);

// The CUDA device `index`, checked against what CUDA sees, or the CPU for -1.
// Throws std::runtime_error for a device that does not exist.
torch::Device cuda_device_or_cpu(int index);

// Makes `device` current for the calling thread (a no-op on CPU).
void use_device(const torch::Device& device);

}  // namespace mnist_ddp
