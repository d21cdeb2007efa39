#include "mnist_ddp/train/resume.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <spdlog/spdlog.h>

#include <sstream>
#include <type_traits>

#include "mnist_ddp/base/files.hpp"

namespace mnist_ddp {
namespace {

// The optimizer keys its state by parameter: by a string in LibTorch 1.x,
// by a pointer in 2.x.
template <typename Map>
typename Map::key_type optimizer_key(const Map&, const torch::Tensor& parameter) {
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream key;  // as LibTorch 1.x writes it: the TensorImpl's address
    key << parameter.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<typename Map::key_type>(parameter.unsafeGetTensorImpl());
  }
}

// The random streams a rank draws from, each with its checkpoint name: the
// CPU's default generator, and its GPU's when it trains on one.
std::vector<std::pair<std::string, at::Generator>> generators(const Job& job) {
  std::vector<std::pair<std::string, at::Generator>> out = {{"rng/cpu", at::detail::getDefaultCPUGenerator()}};
  if (job.device.is_cuda()) out.emplace_back("rng/cuda", at::globalContext().defaultGenerator(job.device));
  return out;
}

// Checkpoint keys. Shared hook state: "hook/<name>"; what belongs to rank r:
// "rank/<r>/rng/cpu", "rank/<r>/rng/cuda", "rank/<r>/hook/<name>".
const std::string kMomentum = "optimizer/momentum/";
const std::string kHook = "hook/";
std::string rank_prefix(int rank) { return "rank/" + std::to_string(rank) + "/"; }

// What only this rank has, named as under its rank_prefix.
std::vector<std::pair<std::string, torch::Tensor>> own_state(const TrainingParts& parts, const Job& job) {
  std::vector<std::pair<std::string, torch::Tensor>> own;
  for (auto& [name, g] : generators(job)) {
    std::lock_guard<std::mutex> lock(g.mutex());
    own.emplace_back(name, g.get_state());
  }
  for (const auto& [key, value] : parts.hook.state().own) own.emplace_back(kHook + key, value);
  return own;
}

}  // namespace

std::string checkpoint_dir(const Options& opts) { return files::join(opts.path, "checkpoint"); }

std::string resume_dir(const Options& opts) {
  if (opts.resume != "auto") return opts.resume;
  const std::string dir = checkpoint_dir(opts);
  return has_checkpoint(dir) ? dir : "";
}

std::optional<Checkpoint> receive_checkpoint(const Options& opts, Job& job) {
  // Rank 0's disk decides for every rank: another node may hold no
  // checkpoint (its own --path), or an older one.
  CheckpointFiles files;
  files.dir = resume_dir(opts);
  if (job.rank == 0 && !files.dir.empty()) {
    files = read_checkpoint_files(files.dir);
    if (!files.fallback.empty()) spdlog::warn("{}", files.fallback);
  }
  job.stream->broadcast_bytes(files.manifest);
  if (files.manifest.empty()) {
    if (opts.resume == "auto") spdlog::info("No checkpoint in {}: starting afresh", checkpoint_dir(opts));
    return std::nullopt;
  }
  for (auto* bytes : {&files.model, &files.training}) job.stream->broadcast_bytes(*bytes);
  return parse_checkpoint(files);
}

Position restore(const Checkpoint& c, const TrainingParts& parts, const Options& opts, const Job& job) {
  spdlog::info("Resuming from {}: epoch {}, batch {}, step {}, best test accuracy {:.4f}%", resume_dir(opts), c.epoch,
               c.batch, c.step, c.best_accuracy);
  const bool same_world = c.world_size == job.world_size;
  const bool same_hook = c.compression == opts.compression;
  if (!same_world)
    spdlog::warn("The checkpoint was written by {} ranks and this run has {}: every rank's dropout stream and "
                 "PowerSGD error feedback start afresh",
                 c.world_size, job.world_size);
  if (!same_hook)
    spdlog::warn("The checkpoint was written with --compression {}: its hook state is not used by {}", c.compression,
                 opts.compression);

  auto& state = parts.optimizer.state();
  for (const auto& p : parts.parameters) {
    if (!c.training.contains(kMomentum + p.key())) continue;  // no momentum buffer yet
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(c.training.at(kMomentum + p.key()).to(p.value().device()).clone());
    state[optimizer_key(state, p.value())] = std::move(s);
  }
  const std::string own = rank_prefix(job.rank);
  if (same_world) {
    for (auto& [name, g] : generators(job)) {
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(c.training.at(own + name));
    }
  }
  if (same_hook) {
    HookState hook;
    for (const auto& item : c.training) {
      const std::string& key = item.key();
      if (key.rfind(kHook, 0) == 0) hook.shared[key.substr(kHook.size())] = item.value();
      if (same_world && key.rfind(own + kHook, 0) == 0) hook.own[key.substr(own.size() + kHook.size())] = item.value();
    }
    if (!hook.empty()) parts.hook.load_state(hook);
  }
  return {c.epoch, c.batch, c.step, c.best_accuracy};
}

std::optional<Checkpoint> capture(const Position& at, const torch::nn::Module& model, const TrainingParts& parts,
                                  const Options& opts, const Arguments& arguments, const Job& job) {
  // Every rank's own state on rank 0: the same names in the same order everywhere.
  std::vector<std::pair<std::string, std::vector<torch::Tensor>>> gathered;
  for (const auto& [key, value] : own_state(parts, job)) gathered.emplace_back(key, job.stream->gather_to_rank0(value));
  if (job.rank != 0) return std::nullopt;

  Checkpoint c;
  c.epoch = at.epoch;
  c.batch = at.batch;
  c.step = at.step;
  c.best_accuracy = at.best_accuracy;
  c.world_size = job.world_size;
  c.compression = opts.compression;
  c.arguments = arguments;
  c.model = state_dict(model);
  const auto& state = parts.optimizer.state();
  for (const auto& p : parts.parameters) {
    const auto it = state.find(optimizer_key(state, p.value()));
    if (it == state.end()) continue;
    const auto& buffer = static_cast<const torch::optim::SGDParamState&>(*it->second).momentum_buffer();
    if (buffer.defined()) c.training.insert(kMomentum + p.key(), buffer.detach().cpu().clone());
  }
  for (const auto& [key, value] : parts.hook.state().shared) c.training.insert(kHook + key, value);
  for (const auto& [key, per_rank] : gathered)
    for (size_t r = 0; r < per_rank.size(); ++r) c.training.insert(rank_prefix(static_cast<int>(r)) + key, per_rank[r]);
  return c;
}

}  // namespace mnist_ddp
