// DistributedDataParallel's public face, what ranks compare at the start,
// the replica check, and the buckets a hook's state was kept for; the
// Reducer's machinery is in reducer.cpp, join() in join.cpp.
#include "parallel/reducer.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "comm/group.hpp"

namespace mnist_ddp {

using detail::Reducer;


uint64_t checksum(const std::vector<torch::Tensor>& tensors) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const auto& t : tensors) {
    const torch::Tensor cpu = t.detach().cpu().contiguous();
    const auto* bytes = static_cast<const unsigned char*>(cpu.data_ptr());
    const size_t n = static_cast<size_t>(cpu.numel()) * cpu.element_size();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t word;
      std::memcpy(&word, bytes + i, 8);
      hash = (hash ^ word) * 0x100000001b3ull;
    }
    for (; i < n; ++i) hash = (hash ^ bytes[i]) * 0x100000001b3ull;
  }
  return hash;
}

// Note on a backward through model->forward. Its gradients reach .grad
// without averaging. That is harmless while they wait there: the next
// averaging backward takes them in (accumulation), and a local backward
// that is never stepped (an evaluation's) changes nothing. It is a mistake
// once an optimizer has stepped on them: the replicas have drifted apart.
// So such a backward leaves a checksum of the parameters, and the next
// ddp.forward, replica check or join compares it (an optimizer may step
// through a tensor's .data(), which a version counter does not see).
void Reducer::check_bypass() {
  if (!bypassed_at_) return;
  const uint64_t then = *bypassed_at_;
  bypassed_at_.reset();
  std::vector<torch::Tensor> tensors;
  for (const auto& p : params_) tensors.push_back(p.tensor);
  if (checksum(tensors) != then)
      throw UsageError("backward through model->forward: gradients were not averaged; call ddp.forward (a "
                       "backward reached the parameters of a DistributedDataParallel without a ddp.forward, and "
                       "they have changed since, as an optimizer step on those gradients changes them)");
}

// Note on the replica check. Each rank hashes the bytes of its parameters
// and buffers; one broadcast of rank 0's hash and one allreduce of "mine
// differs" settle it. Only when some rank differs does rank 0 send its whole
// state, so each rank can measure how far it is off.
void Reducer::check_replicas(const std::string& when) {
  check_bypass();
  torch::NoGradGuard no_grad;
  const Issuer issuer = this->issuer(kReplicaCheck, "the replica check");
  std::vector<std::string> names;
  std::vector<torch::Tensor> tensors;
  for (const auto& [name, t] : synced(module_->named_parameters())) {
    names.push_back(name);
    tensors.push_back(t.detach().cpu().contiguous());
  }
  for (const auto& [name, t] : synced(module_->named_buffers())) {
    names.push_back(name);
    tensors.push_back(t.detach().cpu().contiguous());
  }
  const uint64_t hash = checksum(tensors);
  const torch::Device device = group_.device();
  // Hashes travel as two halves in float64, which holds 32 bits exactly.
  auto halves = [](uint64_t h) { return std::vector<double>{static_cast<double>(h >> 32), static_cast<double>(h & 0xffffffffu)}; };
  auto rank0_hash = torch::tensor(halves(hash), torch::kFloat64).to(device);
  quick_->broadcast(rank0_hash, 0, issuer);
  const auto theirs_hash = rank0_hash.cpu();
  const bool same = theirs_hash[0].item<double>() == halves(hash)[0] && theirs_hash[1].item<double>() == halves(hash)[1];
  auto differing = torch::tensor({same ? 0.0 : 1.0}, torch::kFloat64).to(device);
  quick_->allreduce_sum(differing, issuer);
  if (differing.cpu().item<double>() == 0) return;

  // Rank 0's state on every rank; each rank's largest difference on rank 0.
  std::vector<torch::Tensor> flat_parts;
  for (const auto& t : tensors) flat_parts.push_back(t.reshape(-1).to(torch::kFloat64));
  const auto mine = torch::cat(flat_parts);
  auto rank0 = mine.to(device, /*non_blocking=*/false, /*copy=*/true);  // overwritten by rank 0's
  quick_->broadcast(rank0, 0, issuer);
  const auto theirs = rank0.cpu();
  double largest = 0, where = -1;  // the largest difference, and in which tensor
  for (size_t i = 0, at = 0; i < tensors.size(); at += tensors[i].numel(), ++i) {
    const auto a = mine.slice(0, at, at + tensors[i].numel()), b = theirs.slice(0, at, at + tensors[i].numel());
    if (torch::equal(a, b)) continue;
    const double d = (a - b).abs().max().item<double>();
    if (where < 0 || d > largest) {
      largest = d;
      where = static_cast<double>(i);
    }
  }
  const auto reports = quick_->gather_to_rank0(torch::tensor({largest, where}, torch::kFloat64), issuer);
  if (quick_->rank() != 0) throw PeerLost("rank 0 found the replicas diverged " + when);
  std::string message = "the replicas diverged " + when + ":";
  for (size_t r = 1; r < reports.size(); ++r) {
    const int index = static_cast<int>(reports[r][1].item<double>());
    if (index < 0) continue;
    char difference[32];
    std::snprintf(difference, sizeof difference, "%.3g", reports[r][0].item<double>());
    message += " rank " + std::to_string(r) + " differs from rank 0 by up to " + difference + " (largest in " +
               names[static_cast<size_t>(index)] + ");";
  }
  message.back() = ' ';
  throw Error(message + "- something changed some ranks' parameters and not the others' (an optimizer step, a "
                        "load or an edit on some ranks only); if nothing did, it is a bug in mnist_ddp: please "
                        "report it");
}

std::vector<std::pair<std::string, std::string>> Reducer::description() const {
  std::vector<std::pair<std::string, std::string>> items;
  auto shape = [](const torch::Tensor& t) {
    std::ostringstream s;
    s << t.sizes() << " " << dtype_name(t.scalar_type());
    return s.str();
  };
  for (const auto& [name, t] : synced(module_->named_parameters()))
    items.emplace_back(name.substr(7), shape(t) + (t.requires_grad() ? "" : ", frozen"));
  for (const auto& [name, t] : synced(module_->named_buffers())) items.emplace_back(name.substr(7), shape(t));
  for (const auto& item : module_->named_modules()) {
    const torch::nn::Module& m = *item.value();
    const char* kind = dynamic_cast<const SyncBatchNormImpl*>(&m)                ? "a SyncBatchNorm"
                       : dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) ? "a BatchNorm1d"
                       : dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) ? "a BatchNorm2d"
                       : dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m) ? "a BatchNorm3d"
                                                                              : nullptr;
    if (kind) items.emplace_back("layer " + item.key(), kind);
  }
  std::ostringstream o;
  o << "bucket_cap_mb " << options_.bucket_cap_mb() << ", first_bucket_cap_mb " << options_.first_bucket_cap_mb()
    << ", find_unused_parameters " << options_.find_unused_parameters() << ", broadcast_buffers "
    << options_.broadcast_buffers() << ", static_graph " << options_.static_graph() << ", params_to_ignore "
    << options_.params_to_ignore().size();
  items.emplace_back("DdpOptions", o.str());
  return items;
}

namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : " ") + n;
  return out;
}

}  // namespace

void Reducer::follow_hook_layout() {
  const auto kept = averager_->hook()->kept_for();
  if (kept.empty()) return;  // nothing kept by bucket (yet)
  hook_layout_known_ = true;
  std::vector<std::vector<std::string>> ours;
  for (const auto& b : layout_->buckets()) ours.push_back(b.parameter_names());
  if (kept == ours) return;
  std::vector<size_t> order;
  for (const auto& bucket : kept)
    for (const auto& name : bucket) {
      const auto it = std::find(names_.begin(), names_.end(), name);
      if (it != names_.end()) order.push_back(static_cast<size_t>(it - names_.begin()));
    }
  std::vector<size_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  const bool every_parameter_once =
      sorted.size() == params_.size() && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
  if (options_.static_graph() && iteration_->expected_fires().empty() && every_parameter_once) {
    make_buckets(order);  // the order the saved run's buckets were rebuilt in
    if (layout_->size() == kept.size()) return;
  }
  size_t b = 0;
  while (b < kept.size() && b < ours.size() && kept[b] == ours[b]) ++b;
  throw UsageError("register_comm_hook: the hook's state was kept for other buckets (its bucket " + std::to_string(b) +
                   ": " + (b < kept.size() ? joined(kept[b]) : "none") + "; this DistributedDataParallel's: " +
                   (b < ours.size() ? joined(ours[b]) : "none") +
                   "): resume with the model, bucket_cap_mb and static_graph it was saved with");
}

// ---- DistributedDataParallelBase: the public face of a Reducer ----

DistributedDataParallelBase::DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                         const ProcessGroup& group, const DdpOptions& options)
    : reducer_(Reducer::create(std::move(module), group, options)) {}

void DistributedDataParallelBase::prepare_forward() { reducer_->prepare_forward(); }

DistributedDataParallelBase::NoSync::NoSync(std::shared_ptr<Reducer> reducer) : reducer_(std::move(reducer)) {
  reducer_->enter_no_sync();
}
DistributedDataParallelBase::NoSync::~NoSync() {
  if (reducer_) reducer_->leave_no_sync();
}
DistributedDataParallelBase::NoSync DistributedDataParallelBase::no_sync() const { return NoSync(reducer_); }

void DistributedDataParallelBase::register_comm_hook(hooks::CommHookPtr hook) {
  reducer_->register_comm_hook(std::move(hook));
}
hooks::CommHook& DistributedDataParallelBase::comm_hook() const { return reducer_->comm_hook(); }
const ProcessGroup& DistributedDataParallelBase::process_group() const { return reducer_->process_group(); }
const DdpOptions& DistributedDataParallelBase::options() const { return reducer_->options(); }
void DistributedDataParallelBase::check_replicas(const std::string& when) { reducer_->check_replicas(when); }
void DistributedDataParallelBase::join(const std::function<void()>& loop, const JoinOptions& options) {
  reducer_->join(loop, options);
}
void DistributedDataParallelBase::after_forward(const std::vector<at::Tensor>& outputs, bool all) {
  reducer_->after_forward(outputs, all);
}
hooks::WireStats DistributedDataParallelBase::wire_stats() const { return reducer_->wire(); }
double DistributedDataParallelBase::communication_wait_seconds() const { return reducer_->communication_wait_seconds(); }
std::vector<std::string> DistributedDataParallelBase::describe_buckets() const { return reducer_->describe_buckets(); }

detail::Reducer& reducer_of(const DistributedDataParallelBase& ddp) { return *detail::ReducerAccess::of(ddp); }

}  // namespace mnist_ddp
