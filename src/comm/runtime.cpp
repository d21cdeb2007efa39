#include "comm/runtime.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/version.h>
#ifdef MNIST_DDP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#endif

#include "comm/store.hpp"

namespace mnist_ddp {

Runtime runtime_of(const torch::Device& device) {
  Runtime r;
  r.libtorch = TORCH_VERSION;
  r.store = store_kind();
  r.device = device.str();
#ifdef MNIST_DDP_WITH_CUDA
  r.cuda = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  r.nccl = c10d::getNcclVersion();
  if (device.is_cuda()) r.device += std::string(" (") + at::cuda::getDeviceProperties(device.index())->name + ")";
#endif
  return r;
}

std::string Runtime::describe() const {
  const std::string store_kind = ", " + store + " store";
  if (cuda.empty()) return "LibTorch " + libtorch + " (CPU only: no CUDA, no NCCL)" + store_kind;
  return "LibTorch " + libtorch + ", CUDA " + cuda + ", NCCL " + nccl + ", device " + device + store_kind;
}

torch::Device cuda_device_or_cpu(int index) {
  if (index < 0) return torch::kCPU;
  if (index >= static_cast<int>(torch::cuda::device_count()))
    throw std::runtime_error("CUDA device " + std::to_string(index) + " does not exist (" +
                             std::to_string(torch::cuda::device_count()) + " visible)");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

void use_device(const torch::Device& device) {
  if (device.is_cuda()) c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(device);
}

}  // namespace mnist_ddp
