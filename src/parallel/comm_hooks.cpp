#include "mnist_ddp/parallel/comm_hooks.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <tuple>
#include <limits>
#include <sstream>

#include "parallel/exact_math.hpp"
#include "base/require.hpp"
#include "parallel/wires.hpp"

namespace mnist_ddp::hooks {

std::vector<torch::Tensor> same_layout(const GradBucket& bucket, const torch::Tensor& flat) {
  std::vector<torch::Tensor> views;
  int64_t at = 0;
  for (const auto& g : bucket.gradients()) {
    views.push_back(flat.slice(0, at, at + g.numel()).view(g.sizes()));
    at += g.numel();
  }
  return views;
}

torch::Tensor future_tensor(const FuturePtr& future) {
  const c10::IValue& value = future->value();  // rethrows the future's error
  if (value.isTensor()) return value.toTensor();
  if (value.isTensorList() && value.toTensorList().size() == 1) return value.toTensorList().get(0);
  throw UsageError(c10::str("a communication hook's future must hold one tensor, got ", value.tagKind()));
}

FuturePtr Wire::allreduce_mean(torch::Tensor tensor) {
  tensor.div_(world_size());
  return allreduce_sum(tensor);
}

void GroupWire::count(const torch::Tensor& tensor) {
  stats_.elements += tensor.numel();
  stats_.bytes += tensor.numel() * static_cast<int64_t>(tensor.element_size());
}

FuturePtr GroupWire::allreduce_sum(torch::Tensor tensor) {
  count(tensor);
  return channel_.allreduce_sum(tensor);
}

FuturePtr GroupWire::allgather(const torch::Tensor& tensor) {
  count(tensor);
  return completed_future(channel_.allgather(tensor));
}

FuturePtr GroupWire::broadcast(torch::Tensor tensor, int root) {
  count(tensor);
  channel_.broadcast(tensor, root);
  return completed_future(tensor);
}

bool CastWire::lowers(const torch::Tensor& tensor) const {
  return tensor.is_floating_point() && static_cast<size_t>(tensor.element_size()) > c10::elementSize(type_);
}

FuturePtr CastWire::allreduce_sum(torch::Tensor tensor) {
  torch::Tensor low = tensor.to(type_);
  return below_.allreduce_sum(low)->then(
      [tensor, low](c10::ivalue::Future& sent) {
        sent.value();  // rethrows a failed collective
        tensor.copy_(low);
        return c10::IValue(tensor);
      },
      c10::TensorType::get());
}

FuturePtr CastWire::allreduce_mean(torch::Tensor tensor) {
  tensor.div_(world_size());  // before the cast, so the sum cannot overflow; the result replaces it anyway
  return allreduce_sum(tensor);
}

FuturePtr CastWire::allgather(const torch::Tensor& tensor) {
  if (!lowers(tensor)) return below_.allgather(tensor);
  const FuturePtr gathered = below_.allgather(tensor.to(type_));
  gathered->waitAndThrow();
  const torch::Tensor all = future_tensor(gathered);
  return completed_future(all.to(tensor.scalar_type()));
}

FuturePtr CastWire::broadcast(torch::Tensor tensor, int root) {
  if (!lowers(tensor)) return below_.broadcast(tensor, root);
  torch::Tensor low = tensor.to(type_);
  below_.broadcast(low, root)->waitAndThrow();
  tensor.copy_(low);
  return completed_future(tensor);
}

FuturePtr AllreduceHook::run(const GradBucket& bucket, Wire& wire) { return wire.allreduce_mean(bucket.buffer()); }

CompressWrapper::CompressWrapper(CommHookPtr inner, c10::ScalarType type) : inner_(std::move(inner)), type_(type) {
  MNIST_DDP_REQUIRE(inner_, "a compression wrapper needs a hook to wrap");
  MNIST_DDP_REQUIRE(type == torch::kHalf || type == torch::kBFloat16, "a compression wrapper sends float16 or bfloat16");
}

std::string CompressWrapper::name() const {
  const std::string suffix = type_ == torch::kHalf ? "fp16" : "bf16";
  return inner_->name() == "none" ? suffix : inner_->name() + "_" + suffix;
}

std::string CompressWrapper::describe() const {
  return (type_ == torch::kHalf ? "float16" : "bfloat16") + std::string(" on the wire, over ") + inner_->describe();
}

// Its future is returned unwaited (the bucket's averaging goes on while
// the next bucket is issued): what completes it, CastWire's continuation,
// holds the two tensors it touches, never a wire.
FuturePtr CompressWrapper::run(const GradBucket& bucket, Wire& wire) {
  CastWire low(wire, type_);
  return inner_->run(bucket, low);
}

CommHookPtr allreduce() { return std::make_shared<AllreduceHook>(); }
CommHookPtr fp16_compress() { return fp16_compress_wrapper(allreduce()); }
CommHookPtr bf16_compress() { return bf16_compress_wrapper(allreduce()); }
CommHookPtr fp16_compress_wrapper(CommHookPtr hook) { return std::make_shared<CompressWrapper>(std::move(hook), torch::kHalf); }
CommHookPtr bf16_compress_wrapper(CommHookPtr hook) {
  return std::make_shared<CompressWrapper>(std::move(hook), torch::kBFloat16);
}
std::shared_ptr<PowerSgdHook> powersgd(const PowerSgdOptions& options) { return std::make_shared<PowerSgdHook>(options); }
std::shared_ptr<BatchedPowerSgdHook> batched_powersgd(const PowerSgdOptions& options) {
  return std::make_shared<BatchedPowerSgdHook>(options);
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const CommHook& hook) {
  const HookState state = hook.state();
  auto dict_of = [](const std::map<std::string, torch::Tensor>& from) {
    c10::Dict<std::string, torch::Tensor> dict;
    for (const auto& [key, t] : from) dict.insert(key, t.detach().cpu());
    return dict;
  };
  archive.write("hook", c10::IValue(hook.name()));
  archive.write("shared", c10::IValue(dict_of(state.shared)));
  archive.write("own", c10::IValue(dict_of(state.own)));
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, CommHook& hook) {
  c10::IValue name, shared, own;
  archive.read("hook", name);
  MNIST_DDP_REQUIRE(name.isString() && name.toStringRef() == hook.name(), "the saved hook state is ",
              name.isString() ? name.toStringRef() : std::string("not a hook's"), "'s, this hook is ", hook.name());
  archive.read("shared", shared);
  archive.read("own", own);
  HookState state;
  auto read = [](const c10::IValue& from, std::map<std::string, torch::Tensor>& to) {
    for (const auto& item : from.toGenericDict()) to[item.key().toStringRef()] = item.value().toTensor();
  };
  read(shared, state.shared);
  read(own, state.own);
  hook.load_state(state);
  return archive;
}

}  // namespace mnist_ddp::hooks
