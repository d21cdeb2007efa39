#include "mnist_ddp/train/ddp.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <zlib.h>

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <sstream>

namespace mnist_ddp {
namespace {

class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit ReadyHook(std::function<void()> on_ready) : on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    on_ready_();
    return outputs;
  }

 private:
  std::function<void()> on_ready_;
};

// A tensor over part of `buffer`'s memory that autograd does not treat as a
// view, so optimizers may detach_() and zero_() it in place. It keeps the
// buffer alive.
torch::Tensor alias(const torch::Tensor& buffer, int64_t offset, at::IntArrayRef sizes) {
  auto* data = static_cast<char*>(buffer.data_ptr()) + offset * buffer.element_size();
  return torch::from_blob(data, sizes, [keep = buffer](void*) {}, buffer.options());
}

// Every rank starts from rank 0's parameters and buffers: one broadcast per dtype.
void broadcast_state(CollectiveStream& stream, const std::vector<torch::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_type;
  for (const auto& t : tensors) by_type[t.scalar_type()].push_back(t);
  for (auto& [type, list] : by_type) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : list) flat_parts.push_back(t.reshape(-1));
    auto flat = torch::cat(flat_parts);
    stream.broadcast(flat, 0);
    int64_t offset = 0;
    for (auto& t : list) {
      t.copy_(flat.slice(0, offset, offset + t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

std::string megabytes(int64_t bytes) {
  std::ostringstream s;
  s.precision(2);
  s << std::fixed << bytes / (1024.0 * 1024.0) << " MB";
  return s.str();
}

}  // namespace

std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<int64_t>& sizes_bytes,
                                                           int64_t first_cap_bytes, int64_t cap_bytes) {
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> current;
  int64_t filled = 0;
  for (size_t i = 0; i < sizes_bytes.size(); ++i) {
    current.push_back(i);
    filled += sizes_bytes[i];
    if (filled >= (buckets.empty() ? first_cap_bytes : cap_bytes)) {
      buckets.push_back(std::move(current));
      current.clear();
      filled = 0;
    }
  }
  if (!current.empty()) buckets.push_back(std::move(current));
  return buckets;
}

DistributedDataParallelImpl::DistributedDataParallelImpl(torch::nn::AnyModule module, const Job& job,
                                                         std::unique_ptr<CommHook> hook, double bucket_cap_mb)
    : module_(std::move(module)), hook_(std::move(hook)), stream_(job.stream), device_(job.device) {
  register_module("module", module_.ptr());

  std::vector<torch::Tensor> state;
  for (const auto& p : module_.ptr()->parameters()) state.push_back(p);
  for (const auto& b : module_.ptr()->buffers()) state.push_back(b);
  broadcast_state(*stream_, state);

  for (const auto& item : module_.ptr()->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    TORCH_CHECK(item.value().is_floating_point() && item.value().device() == device_, "DDP: parameter ", item.key(),
                " must be a floating-point tensor on ", device_);
    TORCH_CHECK(params_.empty() || item.value().scalar_type() == params_.front().scalar_type(),
                "DDP: all parameters must share one dtype");
    params_.push_back(item.value());
    param_names_.push_back(item.key());
  }
  TORCH_CHECK(!params_.empty(), "DDP: the module has no parameters that require gradients");

  // Buckets in reverse registration order: roughly the order in which
  // backward produces gradients.
  std::vector<size_t> order(params_.size());
  std::vector<int64_t> sizes;
  for (size_t k = 0; k < order.size(); ++k) {
    order[k] = params_.size() - 1 - k;
    sizes.push_back(params_[order[k]].numel() * params_[order[k]].element_size());
  }
  const auto cap = static_cast<int64_t>(bucket_cap_mb * 1024 * 1024);
  const auto assignment = compute_bucket_assignment(sizes, std::min(kFirstBucketCapBytes, cap), cap);

  bucket_of_.resize(params_.size());
  grad_views_.resize(params_.size());
  for (size_t b = 0; b < assignment.size(); ++b) {
    int64_t total = 0;
    for (size_t k : assignment[b]) total += params_[order[k]].numel();
    GradBucket bucket;
    bucket.index = b;
    bucket.is_last = b + 1 == assignment.size();
    bucket.buffer = torch::zeros({total}, params_.front().options().requires_grad(false));
    int64_t offset = 0;
    for (size_t k : assignment[b]) {
      const size_t p = order[k];
      grad_views_[p] = alias(bucket.buffer, offset, params_[p].sizes());
      bucket.gradients.push_back(grad_views_[p]);
      bucket_of_[p] = b;
      offset += params_[p].numel();
    }
    buckets_.push_back(std::move(bucket));
  }
  for (size_t p = 0; p < params_.size(); ++p) link_grad(p);

  for (size_t p = 0; p < params_.size(); ++p) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[p]);
    accumulator->add_post_hook(std::make_unique<ReadyHook>([this, p] { mark_ready(p); }));
    accumulators_.push_back(std::move(accumulator));
  }
}

DistributedDataParallelImpl::~DistributedDataParallelImpl() {
  // The stream's tasks point at this object.
  for (const auto ticket : posted_) {
    try {
      stream_->wait(ticket);
    } catch (...) {
    }
  }
}

std::vector<std::string> DistributedDataParallelImpl::describe_buckets() const {
  std::vector<std::string> lines;
  for (const auto& b : buckets_) {
    std::ostringstream s;
    s << "bucket " << b.index << ": " << b.gradients.size() << " parameters, " << b.buffer.numel() << " elements ("
      << megabytes(b.buffer.numel() * b.buffer.element_size()) << "):";
    for (size_t p = 0; p < params_.size(); ++p)
      if (bucket_of_[p] == b.index) s << " " << param_names_[p];
    lines.push_back(s.str());
  }
  return lines;
}

// Makes params_[p].grad the view into its bucket, keeping its value.
// Optimizers may have reset .grad (PyTorch 2's zero_grad sets it to None).
void DistributedDataParallelImpl::link_grad(size_t p) {
  torch::Tensor& grad = params_[p].mutable_grad();
  const torch::Tensor& view = grad_views_[p];
  if (grad.defined() && grad.is_same(view)) return;
  torch::NoGradGuard no_grad;
  if (grad.defined()) {
    view.copy_(grad);
  } else {
    view.zero_();
  }
  grad = view;
}

torch::Tensor DistributedDataParallelImpl::forward(torch::Tensor input) {
  if (is_training() && torch::GradMode::is_enabled()) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(posted_.empty(), "DDP: forward called while the previous backward is still communicating");
    expecting_backward_ = true;
    callback_queued_ = false;
    pending_.assign(buckets_.size(), 0);
    ready_.assign(params_.size(), false);
    for (size_t p = 0; p < params_.size(); ++p) {
      ++pending_[bucket_of_[p]];
      link_grad(p);
    }
  }
  return module_.forward(std::move(input));
}

void DistributedDataParallelImpl::mark_ready(size_t p) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(expecting_backward_,
              "DDP: a gradient arrived with no training-mode forward before it (backward twice on one forward?)");
  link_grad(p);
  if (!callback_queued_) {
    callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
  }
  TORCH_CHECK(!ready_[p], "DDP: parameter ", param_names_[p], " became ready twice in one backward");
  ready_[p] = true;
  const size_t b = bucket_of_[p];
  if (--pending_[b] > 0) return;
  for (size_t next = posted_.size(); next < buckets_.size() && pending_[next] == 0; ++next)
    posted_.push_back(stream_->post([this, next](Channel& channel) { communicate(next, channel); }));
}

void DistributedDataParallelImpl::finalize_backward() {
  std::vector<CollectiveStream::Ticket> posted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    expecting_backward_ = false;
    posted.swap(posted_);
  }
  const auto start = std::chrono::steady_clock::now();
  std::exception_ptr error;
  for (const auto ticket : posted) {
    try {
      stream_->wait(ticket);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (error) std::rethrow_exception(error);
  if (posted.size() < buckets_.size()) {
    std::string missing;
    for (size_t p = 0; p < params_.size(); ++p)
      if (!ready_[p]) missing += " " + param_names_[p];
    TORCH_CHECK(false, "DDP: backward ended before these parameters received a gradient:", missing,
                "; every parameter must take part in the loss");
  }
}

void DistributedDataParallelImpl::communicate(size_t b, Channel& channel) {
  GradBucket& bucket = buckets_[b];
  GroupWire wire(channel, wire_stats_);
  FuturePtr result = hook_->run(bucket, wire);
  result->waitAndThrow();
  const torch::Tensor averaged = future_tensor(result);
  if (!averaged.is_same(bucket.buffer)) bucket.buffer.copy_(averaged);
}

// Note on the replica check. Each rank hashes the bytes of its parameters
// and buffers; one broadcast of rank 0's hash and one allreduce of "mine
// differs" settle it. Only when some rank differs does rank 0 send its whole
// state, so each rank can measure how far it is off.
void DistributedDataParallelImpl::check_replicas(const std::string& when) {
  torch::NoGradGuard no_grad;
  std::vector<std::string> names;
  std::vector<torch::Tensor> tensors;
  for (const auto& item : named_parameters()) {
    names.push_back(item.key());
    tensors.push_back(item.value().detach().cpu().contiguous());
  }
  for (const auto& item : named_buffers()) {
    names.push_back(item.key());
    tensors.push_back(item.value().detach().cpu().contiguous());
  }
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const auto& t : tensors)
    crc = crc32(crc, static_cast<const Bytef*>(t.data_ptr()), static_cast<uInt>(t.numel() * t.element_size()));
  auto rank0_crc = torch::tensor({static_cast<int64_t>(crc)}, torch::kInt64).to(device_);
  stream_->broadcast(rank0_crc, 0);
  auto differing = torch::tensor({rank0_crc.cpu().item<int64_t>() == static_cast<int64_t>(crc) ? 0.0 : 1.0},
                                 torch::kFloat64).to(device_);
  stream_->allreduce_sum(differing);
  if (differing.cpu().item<double>() == 0) return;

  // Rank 0's state on every rank; each rank's largest difference on rank 0.
  std::vector<torch::Tensor> flat_parts;
  for (const auto& t : tensors) flat_parts.push_back(t.reshape(-1).to(torch::kFloat64));
  const auto mine = torch::cat(flat_parts);
  auto rank0 = mine.to(device_, /*non_blocking=*/false, /*copy=*/true);  // overwritten by rank 0's
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
    message += fmt::format(" rank {} differs from rank 0 by up to {:.3g} (largest in {});", r,
                           reports[r][0].item<double>(), names[static_cast<size_t>(index)]);
  }
  message.back() = ' ';
  throw std::runtime_error(message + "- replicas must stay bit-identical: a bug in mnist_ddp, please report it");
}

}  // namespace mnist_ddp
