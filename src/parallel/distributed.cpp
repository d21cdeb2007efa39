// DistributedDataParallel's public face, the bucket assignment and the
// replica check; the Reducer's machinery is in reducer.cpp.
#include "parallel/reducer.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {

using detail::Reducer;

namespace {

// FNV-1a over 64-bit words (and the tail's bytes): a checksum of tensors'
// bytes that needs nothing but the bytes.
uint64_t checksum(uint64_t hash, const torch::Tensor& cpu) {
  const auto* bytes = static_cast<const unsigned char*>(cpu.data_ptr());
  const size_t n = static_cast<size_t>(cpu.numel()) * cpu.element_size();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes + i, 8);
    hash = (hash ^ word) * 0x100000001b3ull;
  }
  for (; i < n; ++i) hash = (hash ^ bytes[i]) * 0x100000001b3ull;
  return hash;
}

}  // namespace

std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<int64_t>& sizes_bytes,
                                                           int64_t first_cap_bytes, int64_t cap_bytes,
                                                           const std::vector<int>& kinds) {
  struct Open {
    std::vector<size_t> tensors;
    int64_t filled = 0;
    bool first = true;  // the kind's first bucket
  };
  std::map<int, Open> open;  // kind -> its bucket being filled
  std::vector<std::vector<size_t>> buckets;
  for (size_t i = 0; i < sizes_bytes.size(); ++i) {
    Open& b = open[kinds.empty() ? 0 : kinds[i]];
    b.tensors.push_back(i);
    b.filled += sizes_bytes[i];
    if (b.filled >= (b.first ? first_cap_bytes : cap_bytes)) {
      buckets.push_back(std::move(b.tensors));
      b = Open{{}, 0, false};
    }
  }
  for (auto& [kind, b] : open)
    if (!b.tensors.empty()) buckets.push_back(std::move(b.tensors));
  std::sort(buckets.begin(), buckets.end(), [](const auto& a, const auto& b) { return a.front() < b.front(); });
  return buckets;
}

// Note on the replica check. Each rank hashes the bytes of its parameters
// and buffers; one broadcast of rank 0's hash and one allreduce of "mine
// differs" settle it. Only when some rank differs does rank 0 send its whole
// state, so each rank can measure how far it is off.
void Reducer::check_replicas(const std::string& when) {
  torch::NoGradGuard no_grad;
  std::vector<std::string> names;
  std::vector<torch::Tensor> tensors;
  for (const auto& [name, t] : distinct_named(module_->named_parameters())) {
    names.push_back(name);
    tensors.push_back(t.detach().cpu().contiguous());
  }
  for (const auto& [name, t] : distinct_named(module_->named_buffers())) {
    names.push_back(name);
    tensors.push_back(t.detach().cpu().contiguous());
  }
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const auto& t : tensors) hash = checksum(hash, t);
  const torch::Device device = group_.device();
  // Hashes travel as two halves in float64, which holds 32 bits exactly.
  auto halves = [](uint64_t h) { return std::vector<double>{static_cast<double>(h >> 32), static_cast<double>(h & 0xffffffffu)}; };
  auto rank0_hash = torch::tensor(halves(hash), torch::kFloat64).to(device);
  stream_->broadcast(rank0_hash, 0);
  const auto theirs_hash = rank0_hash.cpu();
  const bool same = theirs_hash[0].item<double>() == halves(hash)[0] && theirs_hash[1].item<double>() == halves(hash)[1];
  auto differing = torch::tensor({same ? 0.0 : 1.0}, torch::kFloat64).to(device);
  stream_->allreduce_sum(differing);
  if (differing.cpu().item<double>() == 0) return;

  // Rank 0's state on every rank; each rank's largest difference on rank 0.
  std::vector<torch::Tensor> flat_parts;
  for (const auto& t : tensors) flat_parts.push_back(t.reshape(-1).to(torch::kFloat64));
  const auto mine = torch::cat(flat_parts);
  auto rank0 = mine.to(device, /*non_blocking=*/false, /*copy=*/true);  // overwritten by rank 0's
  stream_->broadcast(rank0, 0);
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
  const auto reports = stream_->gather_to_rank0(torch::tensor({largest, where}, torch::kFloat64));
  if (stream_->rank() != 0) throw PeerLost("rank 0 found the replicas diverged " + when);
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
  throw Error(message + "- replicas must stay bit-identical: a bug in mnist_ddp, please report it");
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
hooks::WireStats DistributedDataParallelBase::wire_stats() const { return reducer_->wire(); }
double DistributedDataParallelBase::communication_wait_seconds() const { return reducer_->communication_wait_seconds(); }
std::vector<std::string> DistributedDataParallelBase::describe_buckets() const { return reducer_->describe_buckets(); }

}  // namespace mnist_ddp
