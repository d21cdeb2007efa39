// DistributedDataParallel: replicas that stay identical because every rank
// applies the same averaged gradients.
//
// At construction, rank 0's parameters and buffers are broadcast to all
// ranks and the parameters are grouped into buckets (reverse registration
// order, fixed once: compute_bucket_assignment). Each parameter's .grad is a
// view into its bucket's flat buffer, so no gradient is ever copied.
//
// During backward, a hook on each parameter's gradient accumulator marks it
// ready; a bucket whose gradients are all ready is posted at once to the
// rank's ordered collective stream (collectives.hpp), whose thread runs the
// communication hook on it, so its communication overlaps the rest of
// backward. When backward ends, DDP waits for every bucket, and the optimizer
// then sees averaged gradients.
//
// Note on order: buckets are posted strictly in index order, from autograd's
// thread, between the SyncBatchNorm collectives posted from the same thread;
// a hook issues all of a bucket's collectives (PowerSGD issues several)
// within its one task. So every rank issues the same collectives in the same
// order (see collectives.hpp).
#pragma once

#include <torch/torch.h>
#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mnist_ddp/train/comm_hooks.hpp"
#include "mnist_ddp/comm/rendezvous.hpp"

namespace mnist_ddp {

// Groups tensors, given in bucket order with their sizes in bytes, into
// buckets of consecutive tensors: a bucket closes once it holds at least its
// cap, which is `first_cap_bytes` for the first bucket and `cap_bytes` after.
// Returns the tensor indices of each bucket.
std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<int64_t>& sizes_bytes,
                                                           int64_t first_cap_bytes, int64_t cap_bytes);

constexpr int64_t kFirstBucketCapBytes = 1024 * 1024;  // as PyTorch: the first bucket launches early

class DistributedDataParallelImpl : public torch::nn::Module {
 public:
  // `module` is registered as "module", so state_dict names read
  // "module.conv1.weight" as in the reference. Blocks until every rank has
  // constructed its DDP (the broadcast). All parameters must be float tensors
  // on job.device. Finishes its communication before it is destroyed.
  DistributedDataParallelImpl(torch::nn::AnyModule module, const Job& job, std::unique_ptr<CommHook> hook,
                              double bucket_cap_mb);
  ~DistributedDataParallelImpl() override;

  // Runs the module; in training mode with grad enabled, also readies the
  // gradient synchronisation of the next backward.
  torch::Tensor forward(torch::Tensor input);

  std::shared_ptr<torch::nn::Module> module() const { return module_.ptr(); }
  CommHook& hook() { return *hook_; }
  const CommHook& hook() const { return *hook_; }
  // What the hook has put on the wire so far.
  const WireStats& wire() const { return wire_stats_; }
  // Seconds backward has spent, at its end, waiting for buckets still being
  // communicated: the communication that did not overlap computation.
  double communication_wait_seconds() const { return wait_seconds_; }
  // Compares every rank's parameters and buffers with rank 0's, bit for bit
  // (`when` says when, for the message). Throws, on rank 0, a
  // std::runtime_error naming each differing rank, its largest difference
  // and the tensor holding it; on the other ranks a PeerLost. Every rank
  // must call it; it blocks until all have.
  void check_replicas(const std::string& when);
  // One line per bucket: index, parameters, elements, bytes.
  std::vector<std::string> describe_buckets() const;
  const std::vector<GradBucket>& buckets() const { return buckets_; }

 private:
  void link_grad(size_t param);
  void mark_ready(size_t param);
  void finalize_backward();
  void communicate(size_t bucket, Channel& channel);  // a task on the stream

  torch::nn::AnyModule module_;
  std::unique_ptr<CommHook> hook_;
  std::shared_ptr<CollectiveStream> stream_;
  WireStats wire_stats_;  // written by the stream's tasks
  torch::Device device_;
  std::vector<torch::Tensor> params_;        // registration order
  std::vector<std::string> param_names_;
  std::vector<size_t> bucket_of_;            // param -> bucket
  std::vector<torch::Tensor> grad_views_;    // param -> view into its bucket
  std::vector<GradBucket> buckets_;
  // Keeps the accumulators (and so our hooks on them) alive: autograd holds
  // them only weakly.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;

  // Per-backward state, guarded by mutex_ (autograd may run hooks on
  // threads of its own).
  std::mutex mutex_;
  bool expecting_backward_ = false;
  bool callback_queued_ = false;
  std::vector<int> pending_;       // bucket -> gradients not yet ready
  std::vector<bool> ready_;        // param -> its gradient is ready
  std::vector<CollectiveStream::Ticket> posted_;  // buckets [0, posted_.size()) are on the stream
  double wait_seconds_ = 0;
};
TORCH_MODULE(DistributedDataParallel);

}  // namespace mnist_ddp
