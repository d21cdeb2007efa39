// convert_sync_batchnorm(): every BatchNorm of a module tree made a
// SyncBatchNorm where the forward will find it, or refused saying why.
#include <map>

#include <torch/torch.h>
#include <set>
#include <string>
#include <vector>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "parallel/norm.hpp"

namespace mnist_ddp {
namespace {

// "torch::nn::BatchNorm2d": what a user declares, not LibTorch's Impl.
std::string kind_of(const torch::nn::Module& m) {
  std::string name = m.name();
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

// A BatchNorm1d/2d/3d's channels; -1 for any other module.
int64_t batch_norm_features(const torch::nn::Module& m) {
  if (auto* bn = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m)) return bn->options.num_features();
  if (auto* bn = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m)) return bn->options.num_features();
  if (auto* bn = dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m)) return bn->options.num_features();
  return -1;
}

std::shared_ptr<SyncBatchNormImpl> sync_of(const std::shared_ptr<torch::nn::Module>& m) {
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm1dImpl*>(m.get())) return std::make_shared<SyncBatchNormImpl>(*bn);
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get())) return std::make_shared<SyncBatchNormImpl>(*bn);
  return std::make_shared<SyncBatchNormImpl>(*dynamic_cast<torch::nn::BatchNorm3dImpl*>(m.get()));
}

// A BatchNorm of the tree, where it is registered, and how many references
// the tree's registries and containers hold to it.
struct Found {
  std::shared_ptr<torch::nn::Module> layer;
  std::string path;  // "features.1"
  long known = 0;
  std::vector<std::pair<torch::nn::Module*, std::string>> parents;  // (parent, child name)
};

void find_batch_norms(torch::nn::Module& module, const std::string& prefix, std::map<torch::nn::Module*, Found>& found,
                      std::set<torch::nn::Module*>& visited, std::vector<std::string>& unreachable) {
  if (!visited.insert(&module).second) return;
  const bool list = dynamic_cast<torch::nn::ModuleListImpl*>(&module) || dynamic_cast<torch::nn::ModuleDictImpl*>(&module);
  for (const auto& child : module.named_children()) {
    const std::string path = prefix + child.key();
    const int64_t features = batch_norm_features(*child.value());
    if (features < 0) {
      find_batch_norms(*child.value(), path + ".", found, visited, unreachable);
      continue;
    }
    if (list) {
      unreachable.push_back(path + " (a " + kind_of(*child.value()) + " in a " + kind_of(module) +
                            ", which the forward casts back to its type: declare mnist_ddp::SyncBatchNorm(" +
                            std::to_string(features) + ") there instead)");
      continue;
    }
    Found& f = found[child.value().get()];
    if (!f.layer) {
      f.layer = child.value();
      f.path = path;
    }
    ++f.known;
    f.parents.emplace_back(&module, child.key());
  }
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&module))
    for (const auto& entry : *seq)
      if (auto it = found.find(entry.ptr().get()); it != found.end()) ++it->second.known;
}

}  // namespace

void convert_sync_batchnorm(torch::nn::Module* module, const std::optional<ProcessGroup>& group) {
  if (!module) throw UsageError("convert_sync_batchnorm: the module is null");
  convert_sync_batchnorm(*module, group);
}

void convert_sync_batchnorm(torch::nn::Module& module, const std::optional<ProcessGroup>& group) {
  std::map<torch::nn::Module*, Found> found;
  std::vector<std::string> unreachable;
  {
    std::set<torch::nn::Module*> visited;
    find_batch_norms(module, "", found, visited, unreachable);
  }
  // Every reference is now one of the tree's, or `found`'s own: any other
  // is a holder the forward may call that no conversion can re-point.
  for (const auto& [raw, f] : found) {
    if (f.layer.use_count() <= f.known + 1) continue;
    const std::string name = f.parents.front().second;
    const int64_t features = batch_norm_features(*f.layer);
    unreachable.push_back(f.path + " (a " + kind_of(*f.layer) + " also held by a member such as `torch::nn::BatchNorm2d " +
                          name + "` that the forward calls directly and a conversion cannot re-point: declare it as "
                          "mnist_ddp::SyncBatchNorm (" + name + " = register_module(\"" + name +
                          "\", mnist_ddp::SyncBatchNorm(" + std::to_string(features) +
                          "))), or call it through named_children() or a Sequential)");
  }
  if (!unreachable.empty()) {
    std::string all;
    for (const auto& u : unreachable) all += (all.empty() ? "" : "; ") + u;
    throw UsageError("convert_sync_batchnorm: " + std::to_string(unreachable.size()) + " layer" +
                     (unreachable.size() > 1 ? "s" : "") + " where a SyncBatchNorm cannot take the place the forward " +
                     "finds, so nothing was changed: " + all);
  }
  for (auto& [raw, f] : found) {
    auto sync = sync_of(f.layer);
    if (group) sync->set_process_group(*group);
    sync->set_layer_name(f.path);
    for (auto& [parent, name] : f.parents) {
      parent->replace_module(name, sync);
      if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(parent))
        for (auto& entry : *seq)
          if (entry.ptr().get() == raw) entry = torch::nn::AnyModule(sync);
    }
  }
}

}  // namespace mnist_ddp
