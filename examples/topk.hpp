// A communication hook as a program writes its own: top-k sparsification
// with error feedback (Stich et al., "Sparsified SGD with Memory", 2018).
//
//   ddp.register_comm_hook(std::make_shared<TopKHook>(0.01));   // send 1% of each bucket
//
// Each rank adds the error it carries to its bucket, sends the k entries of
// largest magnitude (values and indices, through the Wire's allgather),
// and keeps the rest as its error for the next step. Every rank then holds
// every rank's k entries and sums them in rank order, so the averaged
// bucket is bit-identical on every rank. Only the library's public API is
// used: what any program may do.
#pragma once

#include <mnist_ddp/ddp.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

class TopKHook : public mnist_ddp::hooks::CommHook {
 public:
  // `fraction` of each bucket's entries is sent (at least one).
  explicit TopKHook(double fraction) : fraction_(fraction) {
    if (!(fraction > 0 && fraction <= 1)) throw mnist_ddp::UsageError("TopKHook: the fraction sent must be in (0, 1]");
  }

  std::string name() const override { return "topk"; }

  mnist_ddp::FuturePtr run(const mnist_ddp::hooks::GradBucket& bucket, mnist_ddp::hooks::Wire& wire) override {
    torch::NoGradGuard no_grad;
    torch::Tensor& error = errors_[bucket.index()];
    if (!error.defined()) error = torch::zeros_like(bucket.buffer());
    error.add_(bucket.buffer());  // what this rank would send without compression: its gradient and its error
    const int64_t n = error.numel();
    const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(fraction_ * static_cast<double>(n))));
    const torch::Tensor indices = std::get<1>(error.abs().topk(k));
    const torch::Tensor values = error.index_select(0, indices);
    error.index_fill_(0, indices, 0);  // what is sent leaves the error; the rest waits for the next step
    const torch::Tensor all_values = mnist_ddp::hooks::future_tensor(wire.allgather(values));     // [world, k]
    const torch::Tensor all_indices = mnist_ddp::hooks::future_tensor(wire.allgather(indices));   // [world, k]
    bucket.buffer().zero_();
    for (int r = 0; r < wire.world_size(); ++r)  // one rank's indices are distinct: each index_add_ adds once
      bucket.buffer().index_add_(0, all_indices[r], all_values[r]);
    bucket.buffer().div_(wire.world_size());
    return mnist_ddp::completed_future(bucket.buffer());
  }

  // The errors are this rank's own: a checkpoint keeps each rank's.
  mnist_ddp::hooks::HookState state() const override {
    mnist_ddp::hooks::HookState s;
    for (const auto& [index, error] : errors_) s.own["error/" + std::to_string(index)] = error.detach().cpu().clone();
    return s;
  }
  void load_state(const mnist_ddp::hooks::HookState& s) override {
    errors_.clear();
    for (const auto& [key, error] : s.own) errors_[std::stoul(key.substr(6))] = error.clone();
  }

 private:
  double fraction_;
  std::map<size_t, torch::Tensor> errors_;  // by bucket
};
