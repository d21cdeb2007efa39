// DistributedDataParallel: replicas that stay identical because every rank
// applies the same averaged gradients.
//
//   mnist_ddp::DistributedDataParallel ddp(model, group, mnist_ddp::DdpOptions().bucket_cap_mb(25));
//   auto out = ddp.forward(a, b);   // takes what the model's forward takes, returns what it returns
//   loss(out).backward();           // returns with the gradients averaged over ranks
//
// At construction, rank 0's parameters and buffers are broadcast to all
// ranks and the parameters that require gradients are grouped into buckets
// (reverse registration order, one dtype each, fixed once:
// compute_bucket_assignment). Each parameter's .grad becomes a view into its
// bucket's flat buffer when it first receives a gradient, so gradients are
// not copied again.
//
// During backward, a hook on each parameter's gradient accumulator marks it
// ready; a bucket whose gradients are all ready is posted at once to the
// model's ordered collective stream (collectives.hpp), whose thread runs the
// communication hook on it, so its communication overlaps the rest of
// backward. When backward ends, DDP waits for every bucket: the optimizer
// then sees averaged gradients.
//
// Semantics, as PyTorch's DDP (docs/library.md says where they differ):
// - Several forwards and backwards before one optimizer step are legal:
//   each backward averages what it adds (averaging is linear).
// - no_sync(): a forward inside it is followed by a backward that only
//   accumulates into .grad; the first backward after a forward outside it
//   averages everything accumulated, whichever parameters took part.
// - find_unused_parameters(true): a parameter that got no gradient in a
//   backward (since the last averaging) counts as zero on this rank; one
//   that no rank used keeps its .grad as it was. Without it, such a
//   parameter ends backward with an error naming it (after the step's
//   buckets are sent, so no peer waits for this rank).
// - broadcast_buffers(true): before a forward that follows a forward with
//   gradients outside no_sync() (and before the first), rank 0's buffers are
//   broadcast.
// - Frozen parameters (requires_grad false) are in no bucket; a parameter
//   shared by two modules is one parameter.
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
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "mnist_ddp/comm/process_group.hpp"
#include "mnist_ddp/parallel/comm_hooks.hpp"

namespace torch::autograd {
struct Node;
}

namespace mnist_ddp {

struct DdpOptions {
  // A bucket closes once it holds at least this many MiB of gradients.
  TORCH_ARG(double, bucket_cap_mb) = 25;
  // The first bucket's cap (at most bucket_cap_mb): small, so that
  // communication starts early in backward, as PyTorch's 1 MiB.
  TORCH_ARG(double, first_bucket_cap_mb) = 1;
  TORCH_ARG(bool, find_unused_parameters) = false;
  TORCH_ARG(bool, broadcast_buffers) = true;
};

// Groups tensors, given in bucket order with their sizes in bytes and a
// kind each (their dtype: tensors of two kinds never share a bucket), into
// buckets: a bucket of a kind closes once it holds at least its cap, which
// is `first_cap_bytes` for the first bucket of each kind and `cap_bytes`
// after. Buckets are ordered by their first tensor. Returns the tensor
// indices of each bucket. `kinds` empty: all of one kind.
std::vector<std::vector<size_t>> compute_bucket_assignment(const std::vector<int64_t>& sizes_bytes,
                                                           int64_t first_cap_bytes, int64_t cap_bytes,
                                                           const std::vector<int>& kinds = {});

// What DistributedDataParallel does that does not depend on the module's
// type: buckets, the hook, averaging. Created by DistributedDataParallel;
// its other calls are for programs that report (bytes on the wire, time
// spent waiting) or check replicas.
class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // Blocks until every rank has constructed its DDP (the broadcast). Every
  // parameter and buffer must be on group.device(). Throws UsageError for a
  // model it cannot take, naming the tensor.
  static std::shared_ptr<Reducer> create(std::shared_ptr<torch::nn::Module> module, ProcessGroup group,
                                         DdpOptions options);
  // Finishes its communication first.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called before each forward of the module (DistributedDataParallel::forward).
  void prepare_forward();
  // The hook that averages each bucket, replacing allreduce(). Call it
  // once, before the first backward. Not thread-safe.
  void register_comm_hook(hooks::CommHookPtr hook);
  hooks::CommHook& comm_hook() const { return *hook_; }
  // no_sync() nests; prepare_forward() reads the depth.
  void enter_no_sync();
  void leave_no_sync();

  const ProcessGroup& process_group() const { return group_; }
  const DdpOptions& options() const { return options_; }
  // What the hook has put on the wire so far.
  const hooks::WireStats& wire() const { return wire_stats_; }
  // Seconds backward has spent, at its end, waiting for buckets still being
  // communicated: the communication that did not overlap computation.
  double communication_wait_seconds() const { return wait_seconds_; }
  const std::vector<hooks::GradBucket>& buckets() const { return buckets_; }
  // One line per bucket: index, parameters, elements, bytes.
  std::vector<std::string> describe_buckets() const;
  // Compares every rank's parameters and buffers with rank 0's, bit for bit
  // (`when` says when, for the message). Throws, on rank 0, a
  // std::runtime_error naming each differing rank, its largest difference
  // and the tensor holding it ("module." names, as PyTorch's DDP's
  // state_dict has them); on the other ranks a PeerLost. Every rank must
  // call it; it blocks until all have.
  void check_replicas(const std::string& when);

 private:
  Reducer(std::shared_ptr<torch::nn::Module> module, ProcessGroup group, DdpOptions options);
  void init();
  void link_grad(size_t param);
  void mark_ready(size_t param);
  void finalize_backward();
  void post_ready_buckets();  // with mutex_ held
  void communicate(size_t bucket, Channel& channel);  // a task on the stream

  std::shared_ptr<torch::nn::Module> module_;
  ProcessGroup group_;
  DdpOptions options_;
  std::shared_ptr<CollectiveStream> stream_;
  hooks::CommHookPtr hook_;
  bool hook_registered_ = false;
  hooks::WireStats wire_stats_;  // written by the stream's tasks
  std::vector<torch::Tensor> params_;      // registration order, without duplicates or frozen ones
  std::vector<std::string> param_names_;   // "module.fc.weight"
  std::vector<torch::Tensor> buffers_;
  std::vector<size_t> bucket_of_;          // param -> bucket
  std::vector<torch::Tensor> grad_views_;  // param -> view into its bucket
  std::vector<hooks::GradBucket> buckets_;
  std::vector<size_t> bucket_sizes_;       // bucket -> its parameters
  // Keeps the accumulators (and so our hooks on them) alive: autograd holds
  // them only weakly.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;

  // Between forwards, on the training thread.
  int no_sync_depth_ = 0;
  bool sync_buffers_next_ = true;  // PyTorch's require_forward_param_sync

  // A backward's state, guarded by mutex_ (autograd may run hooks on
  // threads of its own).
  std::mutex mutex_;
  bool sync_next_backward_ = false;  // the last forward asks for averaging
  bool in_backward_ = false;
  bool averaging_ = false;           // this backward averages
  std::vector<int> pending_;         // bucket -> gradients not yet ready
  std::vector<bool> ready_;          // param -> ready in this backward
  size_t next_bucket_ = 0;           // buckets [0, next_bucket_) are posted
  std::vector<CollectiveStream::Ticket> posted_;
  // Since the last averaging (no_sync's micro-batches included).
  std::vector<bool> used_;           // param -> received a gradient
  std::vector<bool> was_undefined_;  // param -> its .grad was undefined before
  double wait_seconds_ = 0;
};

template <typename ModuleType>
class DistributedDataParallel {
 public:
  // `module`'s parameters and buffers must be on group.device() already
  // (model->to(group.device())). Blocks until every rank has constructed
  // its DDP: every rank wraps the same model, in the same order.
  DistributedDataParallel(std::shared_ptr<ModuleType> module, const ProcessGroup& group,
                          const DdpOptions& options = {})
      : module_(std::move(module)), reducer_(Reducer::create(module_, group, options)) {}
  DistributedDataParallel(const torch::nn::ModuleHolder<ModuleType>& module, const ProcessGroup& group,
                          const DdpOptions& options = {})
      : DistributedDataParallel(module.ptr(), group, options) {}

  // The module's forward, with what it takes and what it returns.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    reducer_->prepare_forward();
    return module_->forward(std::forward<Args>(args)...);
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // While the guard lives, the backward after each forward accumulates
  // gradients locally and sends nothing.
  class NoSync {
   public:
    explicit NoSync(std::shared_ptr<Reducer> reducer) : reducer_(std::move(reducer)) { reducer_->enter_no_sync(); }
    ~NoSync() {
      if (reducer_) reducer_->leave_no_sync();
    }
    NoSync(NoSync&& other) noexcept : reducer_(std::move(other.reducer_)) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    std::shared_ptr<Reducer> reducer_;
  };
  NoSync no_sync() const { return NoSync(reducer_); }

  // See Reducer::register_comm_hook.
  void register_comm_hook(hooks::CommHookPtr hook) { reducer_->register_comm_hook(std::move(hook)); }
  hooks::CommHook& comm_hook() const { return reducer_->comm_hook(); }

  const std::shared_ptr<ModuleType>& module() const { return module_; }
  ModuleType* operator->() const { return module_.get(); }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }
  bool is_training() const { return module_->is_training(); }
  const ProcessGroup& process_group() const { return reducer_->process_group(); }
  // Buckets, bytes on the wire, time waited, replica checks.
  Reducer& reducer() const { return *reducer_; }

 private:
  std::shared_ptr<ModuleType> module_;
  std::shared_ptr<Reducer> reducer_;
};

template <typename ModuleType>
DistributedDataParallel(const torch::nn::ModuleHolder<ModuleType>&, const ProcessGroup&, const DdpOptions& = {})
    -> DistributedDataParallel<ModuleType>;

}  // namespace mnist_ddp
