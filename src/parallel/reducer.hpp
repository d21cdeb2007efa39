// The state behind a DistributedDataParallel: buckets, the hook, averaging.
// Not installed; distributed.hpp is its contract.
//
// Note on order: buckets are posted strictly in index order, from
// autograd's thread; a hook issues all of a bucket's collectives (PowerSGD
// issues several) within its one task. So every rank issues the same
// collectives in the same order (collectives.hpp). The first DDP of a
// process group sends its buckets on the group's bulk stream, each later
// one on a stream of its own, so that two models' buckets never need
// matching against each other. The code: reducer.cpp (construction,
// buckets), averaging.cpp (forward, backward, averaging), distributed.cpp
// (the public face, the replica check, join).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mnist_ddp/comm/process_group.hpp"
#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "mnist_ddp/parallel/distributed.hpp"
#include "comm/collectives.hpp"

namespace torch::autograd {
struct Node;
}

namespace mnist_ddp {

// Groups tensors, given in bucket order with their sizes in bytes and a
// kind each (their dtype: tensors of two kinds never share a bucket), into
// buckets: a bucket of a kind closes once it holds at least its cap, which
// is `first_cap_bytes` for the first bucket of each kind and `cap_bytes`
// after. Buckets are ordered by their first tensor. Returns the tensor
// indices of each bucket. `kinds` empty: all of one kind. Pure.
std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<int64_t>& sizes_bytes,
                                                           int64_t first_cap_bytes, int64_t cap_bytes,
                                                           const std::vector<int>& kinds = {});

// The parameters or buffers `named` holds, by tensor (a tensor registered
// twice, tied weights, counts once), in registration order, with "module."
// names as PyTorch's DDP's state_dict has them.
std::vector<std::pair<std::string, torch::Tensor>> distinct_named(
    const torch::OrderedDict<std::string, torch::Tensor>& named);

// FNV-1a over the bytes of `tensors` (64-bit words, then the tail's
// bytes), each copied to the CPU where it is not there.
uint64_t checksum(const std::vector<torch::Tensor>& tensors);

// What DistributedDataParallel's construction says when ranks' models differ.
constexpr const char* kSameModel = "every rank must build the same model, with the same DdpOptions";

namespace detail {

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // Blocks until every rank has constructed its DDP (the broadcast).
  static std::shared_ptr<Reducer> create(std::shared_ptr<torch::nn::Module> module, ProcessGroup group,
                                         DdpOptions options);
  // Finishes its communication first.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  void prepare_forward();
  void after_forward(const std::vector<torch::Tensor>& outputs, bool all);
  void register_comm_hook(hooks::CommHookPtr hook);
  hooks::CommHook& comm_hook() const { return *hook_; }
  // no_sync() nests; prepare_forward() reads the depth.
  void enter_no_sync();
  void leave_no_sync();

  const ProcessGroup& process_group() const { return group_; }
  const DdpOptions& options() const { return options_; }
  const hooks::WireStats& wire() const { return wire_stats_; }
  const std::vector<hooks::GradBucket>& buckets() const { return buckets_; }
  double communication_wait_seconds() const { return wait_seconds_; }
  std::vector<std::string> describe_buckets() const;
  void check_replicas(const std::string& when);
  void join(const std::function<void()>& loop, const JoinOptions& options);
  // What every rank's DDP must share: parameters, buffers, norm layers, options.
  std::vector<std::pair<std::string, std::string>> description() const;

 private:
  Reducer(std::shared_ptr<torch::nn::Module> module, ProcessGroup group, DdpOptions options);
  void init();
  // distinct_named(), without params_to_ignore.
  std::vector<std::pair<std::string, torch::Tensor>> synced(const torch::OrderedDict<std::string, torch::Tensor>& named) const;
  // Buckets over the parameters in `order` (the first bucket's first).
  void make_buckets(const std::vector<size_t>& order);
  // Once, after static_graph's first averaging: the buckets in the order
  // gradients became ready then, rank 0's on every rank.
  void rebuild_buckets();
  void link_grad(size_t param);
  void before_accumulating(size_t param);  // autograd's pre-hook on the accumulator
  void mark_ready(size_t param);           // its post-hook
  void ready(size_t param);                // with mutex_: param counts as ready
  void end_backward();                     // autograd's callback at the end of a backward call
  void post_ready_buckets();               // with mutex_
  // With mutex_ held (released while it waits): counts every parameter not
  // yet ready as ready (unused), posts what is left, waits for every average.
  void complete_iteration(std::unique_lock<std::mutex>& lock);
  // At a forward: an averaging left incomplete by the last backward calls
  // (parameters that got no gradient) is completed, then named.
  void finish_open_iteration();
  // A task on the stream: runs the hook on the bucket and leaves its future
  // (the task does not wait for it: several buckets are on the wire at once).
  void communicate(size_t bucket, Channel& channel);
  // Waits for every bucket's average and puts it in its bucket.
  void take_averages();
  std::string bucket_issuer(size_t bucket) const;     // "DDP bucket 0's backward"
  std::string issuer(const std::string& what) const;  // "DistributedDataParallel's buffers", "the second ..."
  // A backward through model->forward left gradients no rank averaged: an
  // error once the parameters have changed since (an optimizer stepped on
  // them); forgotten where they have not.
  void check_bypass();

  std::shared_ptr<torch::nn::Module> module_;
  ProcessGroup group_;
  DdpOptions options_;
  std::shared_ptr<CollectiveStream> stream_;  // the buckets'
  std::shared_ptr<CollectiveStream> quick_;   // what computation waits on: buffers, the start, the replica check
  int model_ = 0;  // the group's first DDP, or a later one (model_group(): streams of its own)
  bool registered_ = false;  // as the one DDP of its module
  hooks::CommHookPtr hook_;
  bool hook_registered_ = false;
  bool hook_agreed_ = false;  // compared across ranks, at the first averaging backward (on the stream's thread)
  hooks::WireStats wire_stats_;  // written by the stream's tasks
  std::vector<torch::Tensor> params_;      // registration order, without duplicates, frozen or ignored ones
  std::vector<std::string> param_names_;   // "module.fc.weight"
  std::vector<bool> sparse_;               // param -> its gradient is sparse (an Embedding's with sparse(true))
  std::vector<torch::Tensor> buffers_;
  std::vector<size_t> bucket_of_;          // param -> bucket
  std::vector<torch::Tensor> grad_views_;  // param -> view into its bucket (undefined for a sparse one)
  std::vector<hooks::GradBucket> buckets_;
  std::vector<size_t> bucket_sizes_;       // bucket -> its parameters
  // Keeps the accumulators (and so our hooks on them) alive: autograd holds
  // them only weakly.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;

  // Between forwards, on the training thread.
  int no_sync_depth_ = 0;
  // After a backward through model->forward: a checksum of the parameters
  // then (check_bypass()).
  std::optional<uint64_t> bypassed_at_;
  // The join() running, if any: how its averages are divided.
  bool divide_by_active_ = false;

  // An iteration: from a ddp.forward with gradients to its averages,
  // guarded by mutex_ (autograd may run hooks on threads of its own).
  enum class Phase { closed, accumulating, averaging };
  std::mutex mutex_;
  Phase phase_ = Phase::closed;
  bool backward_seen_ = false;       // a backward has begun: too late for register_comm_hook
  bool in_backward_ = false;         // a backward call is running (its end callback queued)
  bool bypassed_ = false;            // the running backward call follows no ddp.forward
  bool unused_found_ = false;        // find_unused_parameters: the graph walk marked them at the forward
  std::vector<int> pending_;         // bucket -> gradients not yet ready
  std::vector<bool> ready_;          // param -> ready in this iteration
  std::vector<int> fires_;           // param -> gradients it received in this iteration
  size_t next_bucket_ = 0;           // buckets [0, next_bucket_) are posted
  std::vector<CollectiveStream::Ticket> posted_;
  std::mutex averaging_mutex_;
  struct InFlight {
    size_t bucket;
    FuturePtr result;
    int active;  // ranks that had data (ddp.join())
  };
  std::vector<InFlight> in_flight_;  // under averaging_mutex_
  // static_graph: what the first averaging iteration learned.
  std::vector<int> expected_fires_;  // param -> gradients a step gives it; empty before
  std::vector<size_t> ready_order_;  // params in the order of their first gradient
  bool rebuild_next_forward_ = false;
  // Since the last averaging (no_sync's micro-batches included).
  std::vector<bool> used_;           // param -> received a gradient
  // param -> its .grad when it was counted ready without a gradient
  // (undefined where it had none), should no rank have used it.
  std::map<size_t, torch::Tensor> kept_;
  double wait_seconds_ = 0;
};

}  // namespace detail

// The Reducer behind a DistributedDataParallel, for the library's tests.
inline detail::Reducer& reducer_of(const DistributedDataParallelBase& ddp) { return ddp.impl(); }

}  // namespace mnist_ddp
