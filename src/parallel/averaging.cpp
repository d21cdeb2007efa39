// The Reducer's forward, backward and averaging (reducer.hpp).
//
// Note on an iteration. A ddp.forward with gradients opens one; it averages
// once every parameter has what it gets in a step: a gradient each (several
// backward calls may bring them, a loss each), or, with static_graph, as
// many as the first step gave it. A bucket is posted as soon as its
// parameters are ready, in index order; the backward call that completes
// the last waits for every average. Parameters that get nothing are known
// at the forward where the graph can be walked (find_unused_parameters;
// static_graph's first step), else at the end of the backward call
// (find_unused_parameters with an output the walk cannot read), else they
// are a mistake named at the next forward, once the buckets have gone out.
#include "parallel/reducer.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <map>
#include <typeinfo>
#include <unordered_set>

#include "mnist_ddp/base/errors.hpp"
#include "comm/group.hpp"
#include "parallel/wires.hpp"

namespace mnist_ddp {

using detail::Reducer;

void broadcast_from_authority(CollectiveStream& stream, const std::vector<torch::Tensor>& tensors,
                              const std::string& issuer);

namespace {

// A hook of ours, exactly (not a program's subclass): the sizes of its
// collectives over a bucket follow from its options and the bucket, which
// every rank has agreed (Channel::DeterminedRun).
bool determined(const hooks::CommHook& hook) {
  const auto& type = typeid(hook);
  if (type == typeid(hooks::CompressWrapper)) return determined(*static_cast<const hooks::CompressWrapper&>(hook).inner());
  return type == typeid(hooks::AllreduceHook) || type == typeid(hooks::PowerSgdHook) ||
         type == typeid(hooks::BatchedPowerSgdHook);
}

}  // namespace

void Reducer::enter_no_sync() { ++no_sync_depth_; }
void Reducer::leave_no_sync() { --no_sync_depth_; }

// Buffers are broadcast as PyTorch's DDP does: before a forward with
// gradients that will be averaged; so a forward under NoGradGuard on one
// rank (evaluating, sampling) issues no collective.
void Reducer::prepare_forward() {
  check_bypass();
  if (!torch::GradMode::is_enabled()) return;
  finish_open_iteration();
  if (rebuild_next_forward_) {
    rebuild_next_forward_ = false;
    rebuild_buckets();
  }
  if (no_sync_depth_ == 0 && options_.broadcast_buffers())
    broadcast_from_authority(*quick_, buffers_, issuer("DistributedDataParallel's buffers before a forward"));
  std::lock_guard<std::mutex> lock(mutex_);
  if (in_backward_) throw UsageError("DistributedDataParallel: forward called while a backward is still running");
  if (no_sync_depth_ > 0) {
    phase_ = Phase::accumulating;
    return;
  }
  phase_ = Phase::averaging;
  pending_.assign(bucket_sizes_.begin(), bucket_sizes_.end());
  ready_.assign(params_.size(), false);
  fires_.assign(params_.size(), 0);
  next_bucket_ = 0;
  unused_found_ = false;
  if (!expected_fires_.empty()) {  // static_graph: what gets nothing is known
    unused_found_ = true;
    for (size_t p = 0; p < params_.size(); ++p)
      if (expected_fires_[p] == 0) ready(p);
  }
}

// PyTorch's search for unused parameters: every node the outputs' graph
// reaches; a parameter whose accumulator is not among them gets nothing.
void Reducer::after_forward(const std::vector<torch::Tensor>& outputs, bool all) {
  if (!torch::GradMode::is_enabled() || !all) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const bool learning = options_.static_graph() && expected_fires_.empty();
  if (phase_ != Phase::averaging || unused_found_ || !(options_.find_unused_parameters() || learning)) return;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> next;
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    const auto node = t.grad_fn() ? t.grad_fn() : torch::autograd::impl::try_get_grad_accumulator(t);
    if (node && seen.insert(node.get()).second) next.push_back(node.get());
  }
  while (!next.empty()) {
    const torch::autograd::Node* node = next.back();
    next.pop_back();
    for (const auto& edge : node->next_edges())
      if (edge.function && seen.insert(edge.function.get()).second) next.push_back(edge.function.get());
  }
  unused_found_ = true;
  for (size_t p = 0; p < params_.size(); ++p)
    if (!seen.count(accumulators_[p].get()) && !ready_[p]) ready(p);
}

// Makes params_[p].grad the view into its bucket, keeping its value (zero
// when it had none). Optimizers may have reset .grad (zero_grad() sets it
// to undefined in LibTorch 2) or replaced it.
void Reducer::link_grad(size_t p) {
  if (sparse_[p]) return;
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

// Before an accumulator adds a gradient to an undefined .grad: the bucket's
// view, zeroed, takes it, so it is added in place and never copied.
void Reducer::before_accumulating(size_t p) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!params_[p].grad().defined()) link_grad(p);
}

void Reducer::mark_ready(size_t p) {
  std::lock_guard<std::mutex> lock(mutex_);
  link_grad(p);
  used_[p] = true;
  if (!in_backward_) {
    in_backward_ = true;
    backward_seen_ = true;
    bypassed_ = phase_ == Phase::closed;  // no ddp.forward since the last averaging: model->forward's
    std::weak_ptr<Reducer> self = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([self] {
      if (const auto reducer = self.lock()) reducer->end_backward();
    });
  }
  if (phase_ != Phase::averaging || bypassed_) return;
  const std::string name = param_names_[p].substr(7);
  ++fires_[p];
  if (options_.static_graph() && expected_fires_.empty()) {  // the first step: how many, and in which order
    if (fires_[p] == 1) ready_order_.push_back(p);
    return;
  }
  if (options_.static_graph()) {
    if (fires_[p] > expected_fires_[p])
      throw UsageError("DistributedDataParallel: parameter " + name + " received " + std::to_string(fires_[p]) +
                       " gradients in this step, " + std::to_string(expected_fires_[p]) +
                       " in the first: with static_graph the graph must be the same every step");
    if (fires_[p] == expected_fires_[p]) ready(p);
    return;
  }
  if (ready_[p])
    throw UsageError("DistributedDataParallel: parameter " + name +
                     " received a second gradient before its bucket was averaged (a second backward through the "
                     "same graph, or a reentrant one); DdpOptions().static_graph(true) allows that where the graph "
                     "is the same every step");
  ready(p);
}

void Reducer::ready(size_t p) {
  if (used_[p]) {
    link_grad(p);  // before its bucket goes
  } else if (!kept_.count(p)) {  // ready without a gradient: what its .grad was, should no rank use it
    const torch::Tensor& grad = params_[p].grad();
    kept_[p] = grad.defined() ? grad.detach().clone() : torch::Tensor();
    if (grad.defined()) {
      link_grad(p);
    } else if (!sparse_[p]) {  // zeros in its bucket; .grad stays undefined unless another rank used it
      torch::NoGradGuard no_grad;
      grad_views_[p].zero_();
    }
  }
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

void Reducer::end_backward() {
  std::unique_lock<std::mutex> lock(mutex_);
  in_backward_ = false;
  if (bypassed_) {  // named only if an optimizer steps on these gradients (check_bypass())
    bypassed_ = false;
    if (!bypassed_at_) bypassed_at_ = checksum(params_);
    return;
  }
  if (phase_ != Phase::averaging) return;
  const bool learning = options_.static_graph() && expected_fires_.empty();
  if (learning) {
    bool complete = true;  // every parameter the graph reaches (where the walk read it) has had its gradients
    for (size_t p = 0; p < params_.size(); ++p) complete = complete && (fires_[p] > 0 || (unused_found_ && ready_[p]));
    if (!complete && unused_found_) return;  // more backward calls to come
    expected_fires_ = fires_;
    for (size_t p = 0; p < params_.size(); ++p)
      if (fires_[p] == 0) ready_order_.push_back(p);
    rebuild_next_forward_ = true;
    for (size_t p : ready_order_)
      if (!ready_[p]) ready(p);
  }
  if (learning || next_bucket_ == buckets_.size() || (options_.find_unused_parameters() && !unused_found_))
    complete_iteration(lock);
  // Else more backward calls are to come: the other losses' gradients.
}

// Note on parameters without a gradient. Every rank posts every bucket, in
// order, whatever its graph: a parameter that got no gradient joins its
// bucket as whatever its .grad holds (what no_sync's micro-batches
// accumulated, or zero). Where they may (find_unused_parameters,
// static_graph) one more allreduce counts the ranks that used each
// parameter since the last averaging; one that no rank used gets its .grad
// back as it was.
void Reducer::complete_iteration(std::unique_lock<std::mutex>& lock) {
  for (size_t p = 0; p < params_.size(); ++p)
    if (!ready_[p]) ready(p);
  auto used_by = std::make_shared<torch::Tensor>();  // param -> ranks that used it
  if (options_.find_unused_parameters() || options_.static_graph()) {
    auto mine = torch::zeros({static_cast<int64_t>(params_.size())}, torch::kFloat32);
    for (size_t p = 0; p < params_.size(); ++p) mine[static_cast<int64_t>(p)] = used_[p] ? 1.0f : 0.0f;
    posted_.push_back(stream_->post(
        [mine, used_by](Channel& channel) {
          torch::Tensor sum = mine.to(channel.staging());
          channel.allreduce_sum(sum)->waitAndThrow();
          *used_by = sum.cpu();
        },
        issuer("DistributedDataParallel's count of the ranks that used each parameter")));
  }
  std::vector<CollectiveStream::Ticket> posted;
  posted.swap(posted_);
  std::map<size_t, torch::Tensor> kept;
  kept.swap(kept_);
  phase_ = Phase::closed;
  used_.assign(params_.size(), false);
  lock.unlock();

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
  if (!used_by->defined()) return;
  torch::NoGradGuard no_grad;
  for (const auto& [p, before] : kept) {
    if ((*used_by)[static_cast<int64_t>(p)].item<float>() > 0) {  // another rank's gradient, averaged
      if (!params_[p].grad().defined() && !sparse_[p]) params_[p].mutable_grad() = grad_views_[p];
    } else if (before.defined() && !sparse_[p]) {
      grad_views_[p].copy_(before);
    } else {
      params_[p].mutable_grad() = before;  // undefined where it was (a sparse gradient is no view)
    }
  }
}

void Reducer::finish_open_iteration() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (phase_ != Phase::averaging) {
    phase_ = Phase::closed;
    return;
  }
  bool had_gradients = false;
  std::string names;
  for (size_t p = 0; p < params_.size(); ++p) {
    had_gradients = had_gradients || fires_[p] > 0;
    if (!ready_[p]) names += " " + param_names_[p].substr(7);
  }
  if (!had_gradients && next_bucket_ == 0) {  // a forward without a backward
    phase_ = Phase::closed;
    return;
  }
  complete_iteration(lock);  // the buckets go out all the same, so that no peer waits for this rank
  if (!had_gradients) return;
  throw UsageError("DistributedDataParallel: the last backward ended before these parameters received " +
                   std::string(options_.static_graph() ? "as many gradients as in the first step:" : "a gradient:") +
                   names + "; every parameter must take part in the loss, or construct DDP with "
                   "DdpOptions().find_unused_parameters(true)");
}

void Reducer::communicate(size_t b, Channel& channel) {
  if (b == 0 && !hook_agreed_) {  // every rank's first bucket of its first averaging backward
    const std::string difference = channel.disagreement(
        {{"hook", hook_->describe()}}, "register_comm_hook",
        "every rank must register the same communication hook, with the same options");
    if (!difference.empty()) throw UsageError(difference);
    hook_agreed_ = true;
  }
  const hooks::GradBucket& bucket = buckets_[b];
  FuturePtr result;
  if (bucket.buffer().defined()) {
    hooks::GroupWire wire(channel, wire_stats_);
    std::optional<Channel::DeterminedRun> run;
    if (determined(*hook_)) run.emplace(channel);
    result = hook_->run(bucket, wire);
  } else {  // a sparse gradient, summed as one (the hook takes dense buckets)
    const torch::Tensor& param = bucket.parameters()[0];
    const torch::Tensor grad = param.grad().defined() ? param.grad() : torch::zeros_like(param).to_sparse();
    result = channel.allreduce_sum(grad.coalesce());
  }
  std::lock_guard<std::mutex> lock(averaging_mutex_);
  in_flight_.push_back({b, std::move(result), channel.active_ranks()});
}

void Reducer::take_averages() {
  std::vector<InFlight> in_flight;
  {
    std::lock_guard<std::mutex> lock(averaging_mutex_);
    in_flight.swap(in_flight_);
  }
  const int world = group_.world_size();
  std::exception_ptr error;
  for (const auto& [b, result, active] : in_flight) {
    try {
      result->waitAndThrow();
      const torch::Tensor averaged = hooks::future_tensor(result);
      const hooks::GradBucket& bucket = buckets_[b];
      torch::NoGradGuard no_grad;
      if (!bucket.buffer().defined()) {  // sparse: the sum, averaged here
        torch::Tensor(bucket.parameters()[0]).mutable_grad() = averaged / (divide_by_active_ ? active : world);
        continue;
      }
      if (!averaged.is_same(bucket.buffer())) bucket.buffer().copy_(averaged);
      if (divide_by_active_ && active < world) bucket.buffer().mul_(static_cast<double>(world) / active);
    } catch (...) {
      if (error) continue;
      error = stream_->explained(std::current_exception());
      try {
        std::rethrow_exception(error);
      } catch (const Error&) {
      } catch (const std::exception& e) {  // a backend's: in our words first, as the stream says a task's
        error = std::make_exception_ptr(CollectiveFailed(bucket_issuer(b) + ": a collective failed: " + error_line(e)));
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace mnist_ddp
