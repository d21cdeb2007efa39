// The state dicts of checkpoint.hpp: a module's tensors by name, and their
// bytes as torch.save writes them.
#include "app/train/checkpoint.hpp"

#include <torch/csrc/jit/serialization/pickle.h>

#include <sstream>

namespace mnist_ddp {
namespace {

void add_state(const torch::nn::Module& module, const std::string& prefix, TensorDict& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false))
    out.insert(prefix + p.key(), p.value().detach().to(torch::kCPU).clone());
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    out.insert(prefix + b.key(), b.value().detach().to(torch::kCPU).clone());
  for (const auto& child : module.named_children()) add_state(*child.value(), prefix + child.key() + ".", out);
}

}  // namespace

TensorDict state_dict(const torch::nn::Module& module, const std::string& prefix) {
  TensorDict out;
  add_state(module, prefix, out);
  return out;
}

std::vector<char> serialize(const TensorDict& state) { return torch::jit::pickle_save(c10::IValue(state)); }

TensorDict deserialize(const std::vector<char>& bytes, const std::string& what) {
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const std::exception&) {
    throw CheckpointError(what + " is not a file torch.save wrote");
  }
  if (!value.isGenericDict()) throw CheckpointError(what + " does not hold a dict of tensors");
  TensorDict out;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor())
      throw CheckpointError(what + " does not hold a dict of tensors");
    out.insert(item.key().toStringRef(), item.value().toTensor());
  }
  return out;
}

void load_state_dict(torch::nn::Module& module, const TensorDict& state, const std::string& prefix,
                     const std::string& what) {
  const TensorDict own = state_dict(module);
  std::string problem;
  for (const auto& item : own) {
    const std::string name = prefix + item.key();
    if (!state.contains(name)) {
      problem = "it has no " + name;
    } else if (state.at(name).sizes() != item.value().sizes()) {
      std::ostringstream s;
      s << name << " is " << state.at(name).sizes() << ", the model's " << item.value().sizes();
      problem = s.str();
    }
    if (!problem.empty()) break;
  }
  if (problem.empty() && state.size() != own.size())
    problem = "it holds " + std::to_string(state.size()) + " tensors, the model " + std::to_string(own.size());
  if (!problem.empty()) throw CheckpointError(what + " holds a different model: " + problem);

  torch::NoGradGuard no_grad;
  auto params = module.named_parameters();
  auto buffers = module.named_buffers();
  for (const auto& item : own) {
    torch::Tensor* target = params.find(item.key());
    if (!target) target = buffers.find(item.key());
    target->copy_(state.at(prefix + item.key()));
  }
}

}  // namespace mnist_ddp
