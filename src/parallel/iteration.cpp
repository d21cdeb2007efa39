// The iteration's state machine (iteration.hpp).
#include "parallel/iteration.hpp"

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {

Iteration::Iteration(size_t params, bool find_unused, bool static_graph, Effects& effects)
    : params_(params),
      find_unused_(find_unused),
      static_graph_(static_graph),
      effects_(effects),
      ready_(params, false),
      fires_(params, 0),
      used_(params, false) {}

void Iteration::use_layout(const BucketLayout& layout) {
  bucket_of_.assign(params_, 0);
  for (size_t p = 0; p < params_; ++p) bucket_of_[p] = layout.bucket_of(p);
  bucket_sizes_.clear();
  for (size_t b = 0; b < layout.size(); ++b) bucket_sizes_.push_back(layout.params_in(b));
  pending_.assign(bucket_sizes_.begin(), bucket_sizes_.end());
}

void Iteration::open(bool no_sync) {
  if (in_backward_) throw UsageError("DistributedDataParallel: forward called while a backward is still running");
  if (no_sync) {
    phase_ = Phase::accumulating;
    return;
  }
  phase_ = static_graph_ && expected_fires_.empty() ? Phase::learning : Phase::averaging;
  rearm();
  if (!expected_fires_.empty()) {  // static_graph: what gets nothing is known
    unused_found_ = true;
    for (size_t p = 0; p < params_; ++p)
      if (expected_fires_[p] == 0) ready(p);
  }
}

void Iteration::rearm() {
  pending_.assign(bucket_sizes_.begin(), bucket_sizes_.end());
  ready_.assign(params_, false);
  fires_.assign(params_, 0);
  next_bucket_ = 0;
  unused_found_ = false;
  began_ = false;
}

void Iteration::adopt(std::vector<int> expected_fires, std::vector<size_t> ready_order, bool rebuild_due) {
  expected_fires_ = std::move(expected_fires);
  ready_order_ = std::move(ready_order);
  rebuild_due_ = rebuild_due;
}

bool Iteration::wants_walk() const {
  const bool open = phase_ == Phase::averaging || phase_ == Phase::learning;
  return open && !unused_found_ && (find_unused_ || phase_ == Phase::learning);
}

void Iteration::walked(const std::vector<bool>& reached) {
  unused_found_ = true;
  for (size_t p = 0; p < params_; ++p)
    if (!reached[p] && !ready_[p]) ready(p);
}

bool Iteration::gradient(size_t p, const std::string& name) {
  effects_.took_gradient(p);
  used_[p] = true;
  bool started = false;
  if (!in_backward_) {
    in_backward_ = backward_seen_ = started = true;
    bypassed_ = phase_ == Phase::closed;  // no ddp.forward since the last averaging: model->forward's
    if (phase_ == Phase::rounded) {  // another loss of the same forward
      phase_ = Phase::averaging;
      rearm();
    }
  }
  if ((phase_ != Phase::averaging && phase_ != Phase::learning) || bypassed_) return started;
  if (!began_ && phase_ == Phase::averaging && !find_unused_ && !static_graph_) {
    began_ = true;
    effects_.round_began();
  }
  ++fires_[p];
  if (phase_ == Phase::learning) {  // the first step: how many, and in which order
    if (fires_[p] == 1) ready_order_.push_back(p);
    return started;
  }
  if (static_graph_) {
    if (fires_[p] > expected_fires_[p])
      throw UsageError("DistributedDataParallel: parameter " + name + " received " + std::to_string(fires_[p]) +
                       " gradients in this step, " + std::to_string(expected_fires_[p]) +
                       " in the first: with static_graph the graph must be the same every step");
    if (fires_[p] == expected_fires_[p]) ready(p);
    return started;
  }
  if (ready_[p])
    throw UsageError("DistributedDataParallel: parameter " + name +
                     " received a second gradient before its bucket was averaged (a second backward through the "
                     "same graph, or a reentrant one); DdpOptions().static_graph(true) allows that where the graph "
                     "is the same every step");
  ready(p);
  return started;
}

void Iteration::ready(size_t p) {
  if (used_[p]) {
    effects_.took_gradient(p);  // before its bucket goes
  } else {
    effects_.counted_unused(p);
  }
  ready_[p] = true;
  --pending_[bucket_of_[p]];
  post_ready_buckets();
}

void Iteration::post_ready_buckets() {
  for (; next_bucket_ < bucket_sizes_.size() && pending_[next_bucket_] == 0; ++next_bucket_) effects_.bucket_ready(next_bucket_);
}

Iteration::End Iteration::end_backward() {
  in_backward_ = false;
  if (bypassed_) {
    bypassed_ = false;
    return End::bypassed;
  }
  if (phase_ == Phase::learning) {
    bool complete = true;  // every parameter the graph reaches (where the walk read it) has had its gradients
    for (size_t p = 0; p < params_; ++p) complete = complete && (fires_[p] > 0 || (unused_found_ && ready_[p]));
    if (!complete && unused_found_) return End::open;  // more backward calls to come
    expected_fires_ = fires_;
    for (size_t p = 0; p < params_; ++p)
      if (fires_[p] == 0) ready_order_.push_back(p);
    rebuild_due_ = true;
    for (size_t p : ready_order_)
      if (!ready_[p]) ready(p);
    return End::complete;
  }
  if (phase_ != Phase::averaging) return End::ignored;
  if (next_bucket_ == bucket_sizes_.size() || find_unused_) return End::complete;
  return End::open;  // more backward calls are to come: the other losses' gradients
}

std::vector<bool> Iteration::close() {
  for (size_t p = 0; p < params_; ++p)
    if (!ready_[p]) ready(p);
  std::vector<bool> used(params_, false);
  used.swap(used_);
  phase_ = phase_ == Phase::averaging && find_unused_ && !static_graph_ ? Phase::rounded : Phase::closed;
  return used;
}

Iteration::LeftOpen Iteration::left_open(const std::vector<std::string>& names) const {
  LeftOpen left;
  if (phase_ != Phase::averaging && phase_ != Phase::learning) return left;
  for (size_t p = 0; p < params_; ++p) {
    left.had_gradients = left.had_gradients || fires_[p] > 0;
    if (!ready_[p]) left.missing += " " + names[p];
  }
  left.open = left.had_gradients || next_bucket_ > 0;  // else a forward without a backward
  return left;
}

}  // namespace mnist_ddp
