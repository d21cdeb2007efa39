#include "mnist_ddp/comm_hooks.hpp"

#include "mnist_ddp/options.hpp"

namespace mnist_ddp {

FuturePtr completed_future(const torch::Tensor& tensor) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  future->markCompleted(c10::IValue(tensor));
  return future;
}

torch::Tensor future_tensor(const FuturePtr& future) {
  const c10::IValue& value = future->value();  // rethrows the future's error
  if (value.isTensor()) return value.toTensor();
  if (value.isTensorList() && value.toTensorList().size() == 1) return value.toTensorList().get(0);
  TORCH_CHECK(false, "a communication hook's future must hold one tensor, got ", value.tagKind());
}

FuturePtr Wire::allreduce_mean(torch::Tensor tensor) {
  tensor.div_(world_size());
  return allreduce_sum(tensor);
}

FuturePtr GroupWire::allreduce_sum(torch::Tensor tensor) {
  elements_ += tensor.numel();
  bytes_ += tensor.numel() * static_cast<int64_t>(tensor.element_size());
  std::vector<at::Tensor> tensors{tensor};
  return group_->allreduce(tensors)->getFuture();
}

FuturePtr Fp16Wire::send_half(torch::Tensor tensor, torch::Tensor half) {
  return below_.allreduce_sum(half)->then(
      [tensor, half](c10::ivalue::Future& sent) mutable {
        sent.value();  // rethrows a failed collective
        tensor.copy_(half);
        return c10::IValue(tensor);
      },
      c10::TensorType::get());
}

FuturePtr Fp16Wire::allreduce_sum(torch::Tensor tensor) { return send_half(tensor, tensor.to(torch::kHalf)); }

FuturePtr Fp16Wire::allreduce_mean(torch::Tensor tensor) {
  return send_half(tensor, (tensor / world_size()).to(torch::kHalf));
}

FuturePtr AllreduceHook::run(GradBucket& bucket, Wire& wire) { return wire.allreduce_mean(bucket.buffer); }

FuturePtr Fp16Wrapper::run(GradBucket& bucket, Wire& wire) {
  Fp16Wire half(wire);
  FuturePtr result = inner_->run(bucket, half);
  result->waitAndThrow();  // `half` lives in this frame
  return result;
}

std::unique_ptr<CommHook> make_comm_hook(const std::string& compression) {
  if (compression == "none") return std::make_unique<AllreduceHook>();
  if (compression == "fp16") return std::make_unique<Fp16Wrapper>(std::make_unique<AllreduceHook>());
  throw UsageError("--compression " + compression + ": not available in this build");
}

}  // namespace mnist_ddp
