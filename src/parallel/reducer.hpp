// The state behind a DistributedDataParallel. Not installed;
// distributed.hpp is its contract.
//
// Three parts a reader can hold, and the Reducer that joins them to the
// model and its streams:
// - BucketLayout (layout.hpp): which parameters each bucket holds, and the
//   buffers their gradients are views into. Pure.
// - Iteration (iteration.hpp): one iteration, forward to averages, as a
//   state machine (no_sync, several backwards, unused parameters, a
//   backward that bypasses the DDP).
// - Averager (averager.hpp): the hook over each bucket, as tasks of the
//   model's bulk stream that own what they touch, and the averages taken
//   back.
// ddp.join() is a layer above them (join.cpp). The code: reducer.cpp
// (construction, forward, backward), distributed.cpp (the public face,
// what the ranks compare, the replica check, the buckets a hook's state
// was kept for).
//
// Note on order: buckets are posted strictly in index order, from
// autograd's thread; a hook issues all of a bucket's collectives (PowerSGD
// issues several) within its one task. So every rank issues the same
// collectives in the same order (collectives.hpp). The first DDP of a
// process group sends its buckets on the group's bulk stream, each later
// one on a stream of its own, so that two models' buckets never need
// matching against each other.
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
#include "parallel/advice.hpp"
#include "parallel/averager.hpp"
#include "parallel/iteration.hpp"
#include "parallel/layout.hpp"

namespace torch::autograd {
struct Node;
}

namespace mnist_ddp {

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

// Every rank gets the authority's `tensors` (rank 0's, or while ranks have
// joined the highest rank with data): one broadcast per dtype, complex
// tensors as their real and imaginary parts.
void broadcast_from_authority(CollectiveStream& stream, const std::vector<torch::Tensor>& tensors,
                              const Issuer& issuer);

namespace detail {

class Reducer : public std::enable_shared_from_this<Reducer>, private Iteration::Effects {
 public:
  // Blocks until every rank has constructed its DDP (the broadcast).
  static std::shared_ptr<Reducer> create(std::shared_ptr<torch::nn::Module> module, ProcessGroup group,
                                         DdpOptions options);
  // Lets go of its module. Its buckets' tasks still queued own what they
  // touch (averager.hpp); its autograd hooks hold it weakly.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  void prepare_forward();
  void after_forward(const std::vector<torch::Tensor>& outputs, bool all);
  void register_comm_hook(hooks::CommHookPtr hook);
  hooks::CommHook& comm_hook() const { return *averager_->hook(); }
  // no_sync() nests; prepare_forward() reads the depth.
  void enter_no_sync() { ++no_sync_depth_; }
  void leave_no_sync() { --no_sync_depth_; }

  const ProcessGroup& process_group() const { return group_; }
  const DdpOptions& options() const { return options_; }
  const hooks::WireStats& wire() const { return averager_->wire(); }
  const std::vector<hooks::GradBucket>& buckets() const { return layout_->buckets(); }
  double communication_wait_seconds() const { return averager_->wait_seconds(); }
  std::vector<std::string> describe_buckets() const { return layout_->describe(); }
  void check_replicas(const std::string& when);
  void join(const std::function<void()>& loop, const JoinOptions& options);
  // What every rank's DDP must share: parameters, buffers, norm layers, options.
  std::vector<std::pair<std::string, std::string>> description() const;

  // For the join layer (join.cpp).
  Issuer issuer(IssuerKind kind, const std::string& what) const;
  const std::shared_ptr<CollectiveStream>& bulk() const { return stream_; }
  const std::shared_ptr<CollectiveStream>& quick() const { return quick_; }
  // The parameters and buffers every rank must end with alike.
  std::vector<torch::Tensor> state_tensors() const;
  // What static_graph learned, and the bucket order: the last rank's is
  // everyone's after join() (`adopt`).
  torch::Tensor learned() const;
  void adopt(const torch::Tensor& learned);
  // While join() runs its loop (`counting`, null once it returns): every
  // forward with gradients first counts the ranks with data (join.cpp),
  // which says how that iteration's averages are scaled: the world size
  // over the ranks with data (divide_by_initial_world_size off), else 1.
  void join_with(std::function<double()> counting);

 private:
  Reducer(std::shared_ptr<torch::nn::Module> module, ProcessGroup group, DdpOptions options);
  void init();
  void collect_parameters();
  void claim_module();
  void compare_and_broadcast(const ProcessGroup& given);
  void hook_accumulators();
  // distinct_named(), without params_to_ignore.
  std::vector<std::pair<std::string, torch::Tensor>> synced(const torch::OrderedDict<std::string, torch::Tensor>& named) const;
  // Buckets over the parameters in `order` (the first bucket's first).
  void make_buckets(const std::vector<size_t>& order);
  // Once, after static_graph's first averaging: the buckets in the order
  // gradients became ready then, the authority's on every rank.
  void rebuild_buckets();
  // A hook whose state was kept for other buckets (CommHook::kept_for()):
  // static_graph before its first step lays its buckets out so; any other
  // DDP refuses it. Until a hook's state says which buckets it is for.
  void follow_hook_layout();
  // The iteration's effects.
  void took_gradient(size_t p) override;
  void counted_unused(size_t p) override;
  void bucket_ready(size_t b) override;
  void round_began() override;
  // Makes params_[p].grad the view into its bucket, keeping its value.
  void link_grad(size_t p);
  void before_accumulating(size_t p);  // autograd's pre-hook on the accumulator
  void mark_ready(size_t p);           // its post-hook
  void end_backward();                 // autograd's callback at the end of a backward call
  // With mutex_ held (released while it waits): closes the iteration,
  // waits for every average.
  void complete_iteration(std::unique_lock<std::mutex>& lock);
  void restore_unused(const std::map<size_t, torch::Tensor>& kept, const torch::Tensor& used_by);
  // At a forward: an averaging left incomplete by the last backward calls
  // (parameters that got no gradient) is completed, then named.
  void finish_open_iteration();
  // A backward through model->forward left gradients no rank averaged: an
  // error once the parameters have changed since (an optimizer stepped on
  // them); forgotten where they have not.
  void check_bypass();

  std::shared_ptr<torch::nn::Module> module_;
  ProcessGroup group_;
  DdpOptions options_;
  std::shared_ptr<CollectiveStream> stream_;  // the buckets'
  std::shared_ptr<CollectiveStream> quick_;   // what computation waits on: buffers, the start, the replica check
  DdpNames naming_;  // which DDP of its group (model_group(): a later one has streams of its own)
  bool registered_ = false;  // as the one DDP of its module
  bool hook_registered_ = false;
  std::function<double()> counting_;  // join_with()
  double scale_ = 1;                   // this iteration's averages: times scale_, over the world size
  bool hook_layout_known_ = false;  // follow_hook_layout() has compared the hook's buckets with ours
  std::vector<AveragedParam> params_;  // registration order, without duplicates, frozen or ignored ones
  std::vector<std::string> names_;     // params_' names
  std::vector<torch::Tensor> buffers_;
  std::unique_ptr<BucketLayout> layout_;
  std::shared_ptr<Averager> averager_;
  // Keeps the accumulators (and so our hooks on them) alive: autograd holds
  // them only weakly.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  // Between forwards, on the training thread.
  int no_sync_depth_ = 0;
  // After a backward through model->forward: a checksum of the parameters
  // then (check_bypass()).
  std::optional<uint64_t> bypassed_at_;
  // The iteration, under mutex_ (autograd may run hooks on threads of its own).
  std::mutex mutex_;
  std::unique_ptr<Iteration> iteration_;
  // param -> its .grad when it was counted ready without a gradient
  // (undefined where it had none), should no rank have used it.
  std::map<size_t, torch::Tensor> kept_;
};

class ReducerAccess {
 public:
  static const std::shared_ptr<Reducer>& of(const DistributedDataParallelBase& ddp) { return ddp.reducer_; }
};

}  // namespace detail

// The Reducer behind a DistributedDataParallel, for the library's tests.
detail::Reducer& reducer_of(const DistributedDataParallelBase& ddp);

}  // namespace mnist_ddp
