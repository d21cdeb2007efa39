#include "app/train/resume.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <spdlog/spdlog.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <type_traits>

#include "app/base/files.hpp"
#include "comm/group.hpp"

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
std::vector<std::pair<std::string, at::Generator>> generators(const ProcessGroup& group) {
  std::vector<std::pair<std::string, at::Generator>> out = {{"rng/cpu", at::detail::getDefaultCPUGenerator()}};
  if (group.device().is_cuda()) out.emplace_back("rng/cuda", at::globalContext().defaultGenerator(group.device()));
  return out;
}

// Checkpoint keys. Shared hook state: "hook/<name>"; what belongs to rank r:
// "rank/<r>/rng/cpu", "rank/<r>/rng/cuda", "rank/<r>/hook/<name>".
const std::string kMomentum = "optimizer/momentum/";
const std::string kHook = "hook/";
const std::string kScaler = "amp/scaler";  // --amp fp16's [scale, growth tracker], the same on every rank
const std::string kThreads = "threads";  // the rank's intra-op threads: they split, and so round, its sums
std::string rank_prefix(int rank) { return "rank/" + std::to_string(rank) + "/"; }

// What only this rank has, named as under its rank_prefix.
std::vector<std::pair<std::string, torch::Tensor>> own_state(const TrainingParts& parts, const ProcessGroup& group) {
  std::vector<std::pair<std::string, torch::Tensor>> own;
  for (auto& [name, g] : generators(group)) {
    std::lock_guard<std::mutex> lock(g.mutex());
    own.emplace_back(name, g.get_state());
  }
  for (const auto& [key, value] : parts.hook.state().own) own.emplace_back(kHook + key, value);
  own.emplace_back(kThreads, torch::tensor(static_cast<int64_t>(at::get_num_threads())));
  return own;
}

// The value of argument `name` a checkpoint recorded; "" when it has none.
std::string recorded(const Checkpoint& c, const std::string& name) {
  for (const auto& [key, value] : c.arguments)
    if (key == name) return value;
  return "";
}

std::string now_given(const Options& opts, const std::string& name) {
  for (const auto& [key, value] : opts.arguments)
    if (key == name) return value;
  return "";
}

// The arguments besides --compression that shape the hook's state:
// PowerSGD's knobs, and the buckets its memories are kept by.
const std::vector<std::string> kHookArguments = {"powersgd_rank", "start_powersgd_iter", "min_compression_rate",
                                                 "no_error_feedback", "no_warm_start", "orthogonalization_epsilon",
                                                 "powersgd_seed", "bucket_cap_mb"};

// The arguments that set what each step computes, and so make a resumed
// run differ from one never stopped where they change.
const std::vector<std::string> kStepArguments = {"amp", "accumulate", "batch_size", "epochs", "lr",
                                                 "momentum", "weight_decay", "backend"};

// "--amp bf16 (this run: none), ..." for each of kStepArguments `c` was
// written with another value of; "" when none changed. --amp none and
// --accumulate 1 go unrecorded (options.hpp, record_arguments).
std::string changed_steps(const Checkpoint& c, const Options& opts) {
  auto or_default = [](const std::string& name, const std::string& value) {
    return !value.empty() ? value : name == "amp" ? "none" : name == "accumulate" ? "1" : "";
  };
  std::string out;
  for (const std::string& name : kStepArguments) {
    const std::string then = or_default(name, recorded(c, name)), now = or_default(name, now_given(opts, name));
    if (then.empty() || then == now) continue;
    std::string flag = "--" + name;
    std::replace(flag.begin(), flag.end(), '_', '-');
    out += (out.empty() ? "" : ", ") + flag + " " + then + " (this run: " + now + ")";
  }
  return out;
}

}  // namespace

std::string checkpoint_dir(const Options& opts) { return files::join(opts.path, "checkpoint"); }

std::string resume_dir(const Options& opts) {
  if (opts.resume != "auto") return opts.resume;
  // A fresh start only where there is truly nothing: no such directory, or
  // one without a manifest that holds no model or training file but a first
  // save's cut short before its manifest. Anything else is resumed from
  // (without a manifest, from the newest pair that verifies), or refused
  // saying why.
  const std::string dir = checkpoint_dir(opts);
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0 && errno == ENOENT) return "";
  const bool readable = S_ISDIR(st.st_mode) && access(dir.c_str(), R_OK | X_OK) == 0;
  return readable && first_saves_cut_short(dir) ? "" : dir;
}

void check_resumable(const Checkpoint& c, const Options& opts, const std::string& dir) {
  const std::string dataset = recorded(c, "dataset");
  if (!dataset.empty() && dataset != opts.dataset)
    throw UsageError("--dataset " + opts.dataset + ": the checkpoint in " + dir + " was trained on " + dataset +
                     ", whose position and best accuracy mean nothing for " + opts.dataset + "; resume it with "
                     "--dataset " + dataset + ", or start afresh with another --path (or without --resume)");
}

int64_t resumed_batch(const Checkpoint& c, int64_t batch_size, int world_size, int accumulate) {
  const std::string given = recorded(c, "batch_size"), micro = recorded(c, "accumulate");
  const int64_t before = (given.empty() ? batch_size : std::max<int64_t>(1, std::atoll(given.c_str()))) *
                         (micro.empty() ? 1 : std::max<int64_t>(1, std::atoll(micro.c_str())));
  const int64_t images = c.batch * before * c.world_size;  // of the epoch, over every rank
  const int64_t per_step = batch_size * accumulate * world_size;
  return (images + per_step - 1) / per_step;
}

std::optional<Checkpoint> receive_checkpoint(const Options& opts, ProcessGroup& group) {
  // Rank 0's disk decides for every rank: another node may hold no
  // checkpoint (its own --path), or an older one.
  CheckpointFiles files;
  files.dir = resume_dir(opts);
  if (group.rank() == 0 && !files.dir.empty()) {
    files = read_checkpoint_files(files.dir);
    if (!files.fallback.empty()) spdlog::warn("{}", files.fallback);
  }
  bulk_stream(group)->broadcast_bytes(files.manifest, "the resume: rank 0's checkpoint");
  if (files.manifest.empty()) {
    if (opts.resume == "auto" && group.rank() == 0) {
      const std::string dir = checkpoint_dir(opts);
      const std::vector<std::string> found = files::is_directory(dir) ? first_saves_cut_short(dir).value_or(std::vector<std::string>{}) : std::vector<std::string>{};
      if (found.empty())
        spdlog::info("No checkpoint in {}: starting afresh", dir);
      else
        spdlog::warn("No checkpoint in {}: it has no manifest, only {}{} (a first save cut short before its manifest "
                     "is written), which nothing can resume from; starting afresh beside it",
                     dir, found.front(), found.size() > 1 ? " and " + std::to_string(found.size() - 1) + " more" : "");
    }
    return std::nullopt;
  }
  for (auto* bytes : {&files.model, &files.training})
    bulk_stream(group)->broadcast_bytes(*bytes, "the resume: rank 0's checkpoint");
  Checkpoint c = parse_checkpoint(files);
  check_resumable(c, opts, resume_dir(opts));
  return c;
}

Position restore(const Checkpoint& c, const TrainingParts& parts, const Options& opts, const ProcessGroup& group) {
  spdlog::info("Resuming from {}: epoch {}, batch {}, step {}, best test accuracy {:.4f}%", resume_dir(opts), c.epoch,
               c.batch, c.step, c.best_accuracy);
  const bool same_world = c.world_size == group.world_size();
  std::string hook_changed = c.compression == opts.compression ? "" : "--compression " + c.compression;
  for (const std::string& name : kHookArguments) {
    const std::string then = recorded(c, name);
    if (hook_changed.empty() && !then.empty() && then != now_given(opts, name)) {
      hook_changed = "--" + name + " " + then;
      std::replace(hook_changed.begin(), hook_changed.end(), '_', '-');
    }
  }
  const int64_t batch = resumed_batch(c, opts.batch_size, group.world_size(), opts.accumulate);
  if (group.rank() == 0) {
    if (!same_world)
      spdlog::warn("The checkpoint was written by {} ranks and this run has {}: every rank's dropout stream and "
                   "PowerSGD error feedback start afresh",
                   c.world_size, group.world_size());
    if (!hook_changed.empty())
      spdlog::warn("The checkpoint was written with {}: its hook state is not used by --compression {} as this run "
                   "sets it up",
                   hook_changed, opts.compression);
    if (const std::string changed = changed_steps(c, opts); !changed.empty())
      spdlog::warn("The checkpoint was written with {}: it goes on from the checkpoint, but will not end "
                   "bit-identical to a run never stopped",
                   changed);
    const std::string seed = recorded(c, "seed");
    if (!seed.empty() && seed != std::to_string(opts.seed))
      spdlog::warn("The checkpoint was written with --seed {} and this run has --seed {}: the rest of epoch {} and "
                   "every later epoch take this seed's data order",
                   seed, opts.seed, c.epoch);
    if (batch != c.batch)
      spdlog::info("Epoch {} goes on from batch {} of this run's batches ({} images per step over {} ranks): as many "
                   "of its images as the checkpoint's {} batches took, in this run's data order",
                   c.epoch, batch, opts.batch_size * opts.accumulate * group.world_size(), group.world_size(), c.batch);
  }

  auto& state = parts.optimizer.state();
  for (const auto& p : parts.parameters) {
    if (!c.training.contains(kMomentum + p.key())) continue;  // no momentum buffer yet
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(c.training.at(kMomentum + p.key()).to(p.value().device()).clone());
    state[optimizer_key(state, p.value())] = std::move(s);
  }
  const std::string own = rank_prefix(group.rank());
  // A rank's sums are split, and rounded, by its thread count: with another
  // count the run goes on, but not bit-identical to one never stopped.
  auto other_threads = torch::zeros({1}, torch::kFloat64);
  if (same_world && c.training.contains(own + kThreads) &&
      c.training.at(own + kThreads).item<int64_t>() != at::get_num_threads())
    other_threads.fill_(1);
  other_threads = other_threads.to(group.device());
  quick_stream(group)->allreduce_sum(other_threads, "the resume: the ranks' thread counts");
  if (group.rank() == 0 && other_threads.cpu().item<double>() > 0)
    spdlog::warn("The checkpoint was written with {} intra-op thread(s) on rank 0 and this run has {} ({} rank(s) "
                 "differ): it goes on from the checkpoint, but will not end bit-identical to a run never stopped, "
                 "whose sums were split by the other count (OMP_NUM_THREADS)",
                 c.training.contains(own + kThreads) ? c.training.at(own + kThreads).item<int64_t>() : 0,
                 at::get_num_threads(), static_cast<int>(other_threads.cpu().item<double>()));
  if (same_world) {
    for (auto& [name, g] : generators(group)) {
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(c.training.at(own + name));
    }
  }
  if (hook_changed.empty()) {
    hooks::HookState hook;
    for (const auto& item : c.training) {
      const std::string& key = item.key();
      if (key.rfind(kHook, 0) == 0) hook.shared[key.substr(kHook.size())] = item.value();
      if (same_world && key.rfind(own + kHook, 0) == 0) hook.own[key.substr(own.size() + kHook.size())] = item.value();
    }
    if (!hook.empty()) parts.hook.load_state(hook);
  }
  if (parts.scaler && c.training.contains(kScaler)) parts.scaler->load_state(c.training.at(kScaler));
  return {c.epoch, batch, c.step, c.best_accuracy};
}

std::optional<Checkpoint> capture(const Position& at, const torch::nn::Module& model, const TrainingParts& parts,
                                  const Options& opts, const Arguments& arguments, const ProcessGroup& group) {
  // Every rank's own state on rank 0: the same names in the same order everywhere.
  std::vector<std::pair<std::string, std::vector<torch::Tensor>>> gathered;
  for (const auto& [key, value] : own_state(parts, group)) gathered.emplace_back(key, bulk_stream(group)->gather_to_rank0(value, "a checkpoint: every rank's own state"));
  if (group.rank() != 0) return std::nullopt;

  Checkpoint c;
  c.epoch = at.epoch;
  c.batch = at.batch;
  c.step = at.step;
  c.best_accuracy = at.best_accuracy;
  c.world_size = group.world_size();
  c.compression = opts.compression;
  c.arguments = arguments;
  c.model = state_dict(model, "module.");
  const auto& state = parts.optimizer.state();
  for (const auto& p : parts.parameters) {
    const auto it = state.find(optimizer_key(state, p.value()));
    if (it == state.end()) continue;
    const auto& buffer = static_cast<const torch::optim::SGDParamState&>(*it->second).momentum_buffer();
    if (buffer.defined()) c.training.insert(kMomentum + p.key(), buffer.detach().cpu().clone());
  }
  for (const auto& [key, value] : parts.hook.state().shared) c.training.insert(kHook + key, value);
  if (parts.scaler) c.training.insert(kScaler, parts.scaler->state());
  for (const auto& [key, per_rank] : gathered)
    for (size_t r = 0; r < per_rank.size(); ++r) c.training.insert(rank_prefix(static_cast<int>(r)) + key, per_rank[r]);
  return c;
}

}  // namespace mnist_ddp
