#include "parallel/reducer.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "parallel/norm.hpp"
#include "comm/group.hpp"
#include "parallel/wires.hpp"

namespace mnist_ddp {

using detail::Reducer;

namespace {

// Calls back a Reducer while it lives: autograd keeps the hook as long as
// the accumulator, which may outlive the DDP.
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::weak_ptr<Reducer> reducer, std::function<void(Reducer&)> on_ready)
      : reducer_(std::move(reducer)), on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (const auto reducer = reducer_.lock()) on_ready_(*reducer);
    return outputs;
  }

 private:
  std::weak_ptr<Reducer> reducer_;
  std::function<void(Reducer&)> on_ready_;
};

// A tensor over part of `buffer`'s memory that autograd does not treat as a
// view, so optimizers may detach_() and zero_() it in place. It keeps the
// buffer alive.
torch::Tensor alias(const torch::Tensor& buffer, int64_t offset, at::IntArrayRef sizes) {
  auto* data = static_cast<char*>(buffer.data_ptr()) + offset * buffer.element_size();
  return torch::from_blob(data, sizes, [keep = buffer](void*) {}, buffer.options());
}

// Every rank gets the authority's `tensors` (rank 0's, or while ranks have
// joined the highest active rank's): one broadcast per dtype.
void broadcast_from_authority(CollectiveStream& stream, const std::vector<torch::Tensor>& tensors,
                              const std::string& issuer) {
  if (stream.world_size() == 1 || tensors.empty()) return;
  torch::NoGradGuard no_grad;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_type;
  for (const auto& t : tensors) by_type[t.scalar_type()].push_back(t);
  for (auto& [type, list] : by_type) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : list) flat_parts.push_back(t.reshape(-1));
    auto flat = torch::cat(flat_parts);
    stream.broadcast(flat, kAuthority, issuer);
    int64_t offset = 0;
    for (auto& t : list) {
      t.copy_(flat.slice(0, offset, offset + t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

std::string megabytes(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f MB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}

}  // namespace

// The parameters and buffers of `module` by tensor (a tensor registered
// twice, tied weights, counts once), in registration order, with names.
std::vector<std::pair<std::string, torch::Tensor>> distinct_named(
    const torch::OrderedDict<std::string, torch::Tensor>& named) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::set<const void*> seen;
  for (const auto& item : named)
    if (item.value().defined() && seen.insert(item.value().unsafeGetTensorImpl()).second)
      out.emplace_back("module." + item.key(), item.value());
  return out;
}

std::shared_ptr<Reducer> Reducer::create(std::shared_ptr<torch::nn::Module> module, ProcessGroup group,
                                         DdpOptions options) {
  std::shared_ptr<Reducer> reducer(new Reducer(std::move(module), std::move(group), std::move(options)));
  reducer->init();
  return reducer;
}

Reducer::Reducer(std::shared_ptr<torch::nn::Module> module, ProcessGroup group, DdpOptions options)
    : module_(std::move(module)),
      group_(std::move(group)),
      options_(std::move(options)),
      hook_(hooks::allreduce()) {}

void Reducer::init() {
  if (!module_) throw UsageError("DistributedDataParallel: the module is null");
  if (!(options_.bucket_cap_mb() > 0) || !(options_.first_bucket_cap_mb() > 0))
    throw UsageError("DistributedDataParallel: bucket_cap_mb and first_bucket_cap_mb must be positive");
  const torch::Device& device = group_.device();
  for (const auto& [name, t] : distinct_named(module_->named_parameters())) {
    if (t.device() != device)
      throw UsageError("DistributedDataParallel: parameter " + name + " is on " + t.device().str() +
                       ", the process group's device is " + device.str() + ": call model->to(group.device()) first");
    if (!t.requires_grad()) continue;  // frozen: in no bucket
    if (!t.is_floating_point())
      throw UsageError("DistributedDataParallel: parameter " + name + " requires a gradient but is not floating-point");
    params_.push_back(t);
    param_names_.push_back(name);
  }
  for (const auto& [name, t] : distinct_named(module_->named_buffers())) {
    if (t.device() != device)
      throw UsageError("DistributedDataParallel: buffer " + name + " is on " + t.device().str() +
                       ", the process group's device is " + device.str() + ": call model->to(group.device()) first");
    buffers_.push_back(t);
  }
  const ProcessGroup given = group_;
  std::tie(group_, model_) = model_group(given);
  stream_ = bulk_stream(group_);
  quick_ = quick_stream(group_);

  // Every rank wraps the same model, with the same options: compared before
  // anything of a size another rank does not expect is sent.
  quick_->run([&](Channel& channel) { channel.agree(description(), "DistributedDataParallel", kSameModel); },
              issuer("DistributedDataParallel's start"));

  // Every rank starts from rank 0's state: its parameters (frozen ones too)
  // and buffers.
  std::vector<torch::Tensor> state;
  for (const auto& [name, t] : distinct_named(module_->named_parameters())) state.push_back(t);
  for (const auto& t : buffers_) state.push_back(t);
  broadcast_from_authority(*quick_, state, issuer("DistributedDataParallel's start: rank 0's parameters and buffers"));

  // A SyncBatchNorm that names no group (or this DDP's) takes this model's
  // view of it, and its name in the model, for what its collectives say of
  // themselves.
  for (const auto& item : module_->named_modules())
    if (auto* sync = dynamic_cast<SyncBatchNormImpl*>(item.value().get())) {
      const auto& named = sync->process_group();
      if (!named || GroupAccess::share(*named) == GroupAccess::share(given)) sync->set_process_group(group_);
      if (SyncBatchNormAccess::name(*sync).empty()) SyncBatchNormAccess::name(*sync) = item.key();
    }

  // Buckets in reverse registration order: roughly the order in which
  // backward produces gradients. One dtype a bucket.
  std::vector<size_t> order(params_.size());
  std::vector<int64_t> sizes;
  std::vector<int> kinds;
  for (size_t k = 0; k < order.size(); ++k) {
    order[k] = params_.size() - 1 - k;
    sizes.push_back(params_[order[k]].numel() * params_[order[k]].element_size());
    kinds.push_back(static_cast<int>(params_[order[k]].scalar_type()));
  }
  const auto mib = [](double mb) { return static_cast<int64_t>(mb * 1024 * 1024); };
  const auto assignment = compute_bucket_assignment(
      sizes, std::min(mib(options_.first_bucket_cap_mb()), mib(options_.bucket_cap_mb())), mib(options_.bucket_cap_mb()),
      kinds);

  bucket_of_.resize(params_.size());
  grad_views_.resize(params_.size());
  for (size_t b = 0; b < assignment.size(); ++b) {
    int64_t total = 0;
    for (size_t k : assignment[b]) total += params_[order[k]].numel();
    hooks::GradBucket bucket;
    bucket.index = b;
    bucket.is_last = b + 1 == assignment.size();
    bucket.buffer = torch::zeros({total}, params_[order[assignment[b].front()]].options().requires_grad(false));
    int64_t offset = 0;
    for (size_t k : assignment[b]) {
      const size_t p = order[k];
      grad_views_[p] = alias(bucket.buffer, offset, params_[p].sizes());
      bucket.gradients.push_back(grad_views_[p]);
      bucket.parameters.push_back(params_[p]);
      bucket.parameter_names.push_back(param_names_[p].substr(7));  // without "module."
      bucket_of_[p] = b;
      offset += params_[p].numel();
    }
    buckets_.push_back(std::move(bucket));
    bucket_sizes_.push_back(assignment[b].size());
  }
  used_.assign(params_.size(), false);
  was_undefined_.assign(params_.size(), false);

  const std::weak_ptr<Reducer> self = weak_from_this();
  for (size_t p = 0; p < params_.size(); ++p) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[p]);
    accumulator->add_post_hook(std::make_unique<ReadyHook>(self, [p](Reducer& r) { r.mark_ready(p); }));
    accumulators_.push_back(std::move(accumulator));
  }
}

Reducer::~Reducer() {
  // The stream's tasks point at this object, and the hooks' futures at its buckets.
  for (const auto ticket : posted_) {
    try {
      stream_->wait(ticket);
    } catch (...) {
    }
  }
  try {
    take_averages();
  } catch (...) {
  }
}

void Reducer::register_comm_hook(hooks::CommHookPtr hook) {
  if (!hook) throw UsageError("register_comm_hook: the hook is null");
  if (hook_registered_)
    throw UsageError("register_comm_hook: this DistributedDataParallel has a hook (" + hook_->name() +
                     "); register one, once, before the first backward");
  std::lock_guard<std::mutex> lock(mutex_);
  if (backward_seen_)
    throw UsageError("register_comm_hook: called after the first backward, whose buckets " + hook_->name() +
                     " averaged; register the hook once, before the first backward, on every rank");
  hook_ = std::move(hook);
  hook_registered_ = true;
}

namespace {
// "second", "third", ..., "11th": which DistributedDataParallel of its group.
std::string ordinal(int k) {
  static const char* const words[] = {"first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"};
  if (k < 10) return words[k];
  const int n = k + 1, last = n % 10;
  return std::to_string(n) + (n % 100 / 10 == 1 ? "th" : last == 1 ? "st" : last == 2 ? "nd" : last == 3 ? "rd" : "th");
}
}  // namespace

std::string Reducer::issuer(const std::string& what) const {
  if (model_ == 0) return what;  // "DistributedDataParallel's buffers before a forward"
  return "the " + ordinal(model_) + " " + what;  // "the second DistributedDataParallel's buffers ..."
}

std::string Reducer::bucket_issuer(size_t b) const {
  if (model_ == 0) return "DDP bucket " + std::to_string(b) + "'s backward";
  return "the " + ordinal(model_) + " DDP's bucket " + std::to_string(b) + "'s backward";
}

void Reducer::enter_no_sync() { ++no_sync_depth_; }
void Reducer::leave_no_sync() { --no_sync_depth_; }

// Buffers are broadcast as PyTorch's DDP does: before a forward with
// gradients that will be averaged; so a forward under NoGradGuard on one
// rank (evaluating, sampling) issues no collective.
void Reducer::prepare_forward() {
  check_bypass();
  const bool grad = torch::GradMode::is_enabled();
  if (grad && no_sync_depth_ == 0 && options_.broadcast_buffers())
    broadcast_from_authority(*quick_, buffers_, issuer("DistributedDataParallel's buffers before a forward"));
  std::lock_guard<std::mutex> lock(mutex_);
  if (!grad) return;
  if (in_backward_) throw UsageError("DistributedDataParallel: forward called while a backward is still running");
  forwarded_ = true;
  sync_next_backward_ = no_sync_depth_ == 0;
  // Gradients accumulate into the bucket views from the first backward on.
  for (size_t p = 0; p < params_.size(); ++p) {
    if (!params_[p].grad().defined()) was_undefined_[p] = true;
    link_grad(p);
  }
}

std::vector<std::string> Reducer::describe_buckets() const {
  std::vector<std::string> lines;
  for (const auto& b : buckets_) {
    std::ostringstream s;
    s << "bucket " << b.index << ": " << b.gradients.size() << " parameters, " << b.buffer.numel() << " elements ("
      << megabytes(b.buffer.numel() * b.buffer.element_size()) << "):";
    for (size_t p = 0; p < params_.size(); ++p)
      if (bucket_of_[p] == b.index) s << " " << param_names_[p].substr(7);  // without "module."
    lines.push_back(s.str());
  }
  return lines;
}

// Makes params_[p].grad the view into its bucket, keeping its value (zero
// when it had none). Optimizers may have reset .grad (PyTorch 2's
// zero_grad sets it to undefined) or replaced it.
void Reducer::link_grad(size_t p) {
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

void Reducer::mark_ready(size_t p) {
  std::lock_guard<std::mutex> lock(mutex_);
  link_grad(p);
  used_[p] = true;
  if (!in_backward_) {
    in_backward_ = true;
    backward_seen_ = true;
    bypassed_ = !forwarded_;  // no ddp.forward since the last backward: model->forward's
    averaging_ = sync_next_backward_ && !bypassed_;
    if (averaging_) {
      pending_.assign(bucket_sizes_.begin(), bucket_sizes_.end());
      ready_.assign(params_.size(), false);
      next_bucket_ = 0;
    }
    std::weak_ptr<Reducer> self = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([self] {
      if (const auto reducer = self.lock()) reducer->finalize_backward();
    });
  }
  if (!averaging_) return;
  if (ready_[p])
    throw UsageError("DistributedDataParallel: parameter " + param_names_[p].substr(7) +
                     " received two gradients in one backward (a graph that reaches it twice through "
                     "DistributedDataParallel's hooks)");
  ready_[p] = true;
  --pending_[bucket_of_[p]];
  post_ready_buckets();
}

void Reducer::post_ready_buckets() {
  for (; next_bucket_ < buckets_.size() && pending_[next_bucket_] == 0; ++next_bucket_) {
    const size_t b = next_bucket_;
    posted_.push_back(stream_->post([this, b](Channel& channel) { communicate(b, channel); }, bucket_issuer(b)));
  }
}

// Note on parameters without a gradient. A backward that averages ends
// with every bucket posted: a parameter that got no gradient in it joins
// its bucket as whatever its .grad holds (what no_sync's micro-batches
// accumulated, or zero), so that every rank posts every bucket, in order,
// whatever its graph. With find_unused_parameters one more allreduce counts
// the ranks that used each parameter since the last averaging; one that no
// rank used gets its .grad back as it was. Without the option such a
// parameter is an error, raised once this rank's buckets are sent, so that
// its peers finish the step instead of waiting for it.
void Reducer::finalize_backward() {
  std::vector<CollectiveStream::Ticket> posted;
  std::vector<size_t> missing;
  std::map<size_t, torch::Tensor> kept;  // param -> its .grad before averaging, where it got none now
  auto used_by = std::make_shared<torch::Tensor>();  // param -> ranks that used it
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_backward_ = false;
    forwarded_ = false;
    if (bypassed_) {  // named only if an optimizer steps on these gradients (check_bypass())
      if (!bypassed_at_) bypassed_at_ = checksum(params_);
      return;
    }
    if (!averaging_) return;
    for (size_t p = 0; p < params_.size(); ++p) {
      if (ready_[p]) continue;
      missing.push_back(p);
      if (!was_undefined_[p] && params_[p].grad().defined()) kept[p] = params_[p].grad().detach().clone();
      link_grad(p);
      --pending_[bucket_of_[p]];
    }
    post_ready_buckets();
    if (options_.find_unused_parameters()) {
      auto mine = torch::zeros({static_cast<int64_t>(params_.size())}, torch::kFloat32);
      for (size_t p = 0; p < params_.size(); ++p) mine[static_cast<int64_t>(p)] = used_[p] ? 1.0f : 0.0f;
      posted_.push_back(stream_->post(
          [mine, used_by](Channel& channel) {
            torch::Tensor sum = mine.to(channel.staging());
            channel.allreduce_sum(sum)->waitAndThrow();
            *used_by = sum.cpu();
          },
          "DistributedDataParallel's count of the ranks that used each parameter"));
    }
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
  try {
    take_averages();
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (error) std::rethrow_exception(error);
  if (!missing.empty() && !options_.find_unused_parameters()) {
    std::string names;
    for (size_t p : missing) names += " " + param_names_[p].substr(7);
    throw UsageError("DistributedDataParallel: backward ended before these parameters received a gradient:" + names +
                     "; every parameter must take part in the loss, or construct DDP with "
                     "DdpOptions().find_unused_parameters(true)");
  }
  if (used_by->defined()) {
    const torch::Tensor& counts = *used_by;
    torch::NoGradGuard no_grad;
    for (size_t p : missing) {
      if (counts[static_cast<int64_t>(p)].item<float>() > 0) continue;
      if (was_undefined_[p]) {
        params_[p].mutable_grad() = torch::Tensor();
      } else if (kept.count(p)) {
        grad_views_[p].copy_(kept[p]);
      }
    }
  }
  used_.assign(params_.size(), false);
  was_undefined_.assign(params_.size(), false);
}

void Reducer::communicate(size_t b, Channel& channel) {
  if (b == 0 && !hook_agreed_) {  // every rank's first bucket of its first averaging backward
    channel.agree({{"hook", hook_->describe()}}, "register_comm_hook",
                  "every rank must register the same communication hook, with the same options");
    hook_agreed_ = true;
  }
  hooks::GroupWire wire(channel, wire_stats_);
  FuturePtr result = hook_->run(buckets_[b], wire);
  std::lock_guard<std::mutex> lock(averaging_mutex_);
  in_flight_.emplace_back(b, std::move(result));
}

void Reducer::take_averages() {
  std::vector<std::pair<size_t, FuturePtr>> in_flight;
  {
    std::lock_guard<std::mutex> lock(averaging_mutex_);
    in_flight.swap(in_flight_);
  }
  std::exception_ptr error;
  for (const auto& [b, result] : in_flight) {
    try {
      result->waitAndThrow();
      const torch::Tensor averaged = hooks::future_tensor(result);
      if (!averaged.is_same(buckets_[b].buffer)) buckets_[b].buffer.copy_(averaged);
    } catch (const Error&) {
      if (!error) error = std::current_exception();
    } catch (const std::exception& e) {  // a backend's: in our words first, as the stream says a task's
      if (!error) error = std::make_exception_ptr(CollectiveFailed(bucket_issuer(b) + ": a collective failed: " + error_line(e)));
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace mnist_ddp
