// DistributedDataParallel: replicas that stay identical because every rank
// applies the same averaged gradients.
//
//   mnist_ddp::DistributedDataParallel ddp(model, group, mnist_ddp::DdpOptions().bucket_cap_mb(25));
//   auto out = ddp.forward(a, b);   // takes what the model's forward takes, returns what it returns
//   loss(out).backward();           // returns with the gradients averaged over ranks
//
// At construction, every rank's model is compared with every other's (the
// names, shapes, dtypes and requires_grad of its parameters, its buffers,
// the options: a difference is a UsageError naming it on every rank), rank
// 0's parameters and buffers are broadcast to all ranks, and the parameters
// that require gradients are grouped into buckets (reverse registration
// order, one dtype each). A parameter's .grad, once a backward writes it,
// is a view into its bucket's flat buffer, so gradients are not copied
// again.
//
// During backward, each parameter's gradient accumulator marks it ready; a
// bucket whose gradients are all ready is posted at once to the model's
// ordered collective stream, whose thread runs the communication hook on
// it, so its communication overlaps the rest of backward (several buckets
// may be on the wire at once). Once every bucket has been posted, the
// backward call that posted the last one waits for every average: the
// optimizer then sees averaged gradients.
//
// Semantics, as PyTorch's DDP (docs/library.md says where they differ):
// - The gradients of one ddp.forward may come in several backward calls
//   (a loss per output): buckets are averaged once every parameter has its
//   gradient, at the end of the backward call that completes them.
// - .grad stays undefined until a backward writes it; a parameter no rank
//   used keeps .grad as it was (undefined where it was).
// - no_sync(): a forward inside it is followed by a backward that only
//   accumulates into .grad; the first backward after a forward outside it
//   averages everything accumulated, whichever parameters took part.
// - find_unused_parameters(true): after the forward, the autograd graph of
//   its outputs (a tensor, or tuples, pairs and vectors of them) is walked,
//   and a parameter it does not reach counts as zero on this rank at once;
//   one that no rank used keeps its .grad as it was. (An output of another
//   type: what got no gradient by the end of the backward call is unused.)
//   Without it, a parameter that got no gradient by the next forward is a
//   UsageError there naming it (after the buckets are sent, so no peer
//   waits for this rank).
// - static_graph(true): the graph is the same every step. The first
//   averaging backward learns how many gradients each parameter gets
//   (several, with reentrant backwards or activation checkpointing) and in
//   which order they come; the buckets are then rebuilt once in that order
//   (rank 0's, on every rank), and a parameter is ready once it has had as
//   many gradients as then.
// - broadcast_buffers(true): before a forward with gradients outside
//   no_sync(), rank 0's buffers are broadcast; a forward under NoGradGuard
//   broadcasts nothing.
// - Frozen parameters (requires_grad false) and params_to_ignore are in no
//   bucket; a parameter shared by two modules is one parameter; complex
//   parameters are averaged as their real and imaginary parts; sparse
//   gradients (Embedding and EmbeddingBag with sparse(true)) are averaged
//   as sparse tensors, each in a bucket of its own, without the hook.
// - A backward through the module's own forward (model->forward in place of
//   ddp.forward) leaves gradients no rank averaged: fine if a later
//   averaging backward takes them in, or if nothing steps on them; a
//   UsageError at the next ddp.forward, check_replicas() or join() once
//   the parameters have changed since.
//
// Thread safety: a DistributedDataParallel is used from one thread (the
// training loop); autograd may run its backward on threads of its own,
// which the class allows for. Two DDPs may be trained on two threads
// (docs/library.md, "Threads").
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/arg.h>

#include <functional>
#include <tuple>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mnist_ddp/comm/process_group.hpp"
#include "mnist_ddp/parallel/comm_hooks.hpp"

namespace mnist_ddp {

struct DdpOptions {
  // A bucket closes once it holds at least this many MiB of gradients.
  TORCH_ARG(double, bucket_cap_mb) = 25;
  // The first bucket's cap (at most bucket_cap_mb): small, so that
  // communication starts early in backward, as PyTorch's 1 MiB.
  TORCH_ARG(double, first_bucket_cap_mb) = 1;
  TORCH_ARG(bool, find_unused_parameters) = false;
  TORCH_ARG(bool, broadcast_buffers) = true;
  // The same graph every step (see the top of this file).
  TORCH_ARG(bool, static_graph) = false;
  // Parameters and buffers DDP leaves alone (PyTorch's
  // _set_params_and_buffers_to_ignore_for_model), by name in the module
  // ("fc.weight", "bn.running_mean"): neither compared nor broadcast nor
  // averaged. A name the module does not have is a UsageError.
  TORCH_ARG(std::vector<std::string>, params_to_ignore) = {};
};

// ddp.join()'s options, as PyTorch's Join context takes them.
struct JoinOptions {
  // Off: join() runs the loop and nothing more.
  TORCH_ARG(bool, enable) = true;
  // Every rank throws an Error as soon as one rank's loop has ended (the
  // way PyTorch asks programs whose collectives it cannot shadow to end).
  TORCH_ARG(bool, throw_on_early_termination) = false;
  // Averages divided by the world size at the start (every sample weighs
  // the same); off: by the ranks still active at each step.
  TORCH_ARG(bool, divide_by_initial_world_size) = true;
};

namespace detail {
class Reducer;         // the state behind every DistributedDataParallel (not installed)
class ReducerAccess;   // the library's own way to it (not installed)
}

// What DistributedDataParallel does whatever the module's type. Not made
// directly: DistributedDataParallel<M> below is one.
class DistributedDataParallelBase {
 public:
  // While the guard lives, the backward after each forward accumulates
  // gradients locally and sends nothing. Nests.
  class NoSync {
   public:
    NoSync(NoSync&& other) noexcept : reducer_(std::move(other.reducer_)) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;
    ~NoSync();

   private:
    friend class DistributedDataParallelBase;
    explicit NoSync(std::shared_ptr<detail::Reducer> reducer);
    std::shared_ptr<detail::Reducer> reducer_;
  };
  [[nodiscard]] NoSync no_sync() const;

  // The hook that averages each bucket, in place of hooks::allreduce().
  // Once, before the first backward; every rank registers the same hook
  // (the same kind and options: compared across ranks at the first
  // backward, a difference a UsageError naming both).
  void register_comm_hook(hooks::CommHookPtr hook);
  hooks::CommHook& comm_hook() const;

  const ProcessGroup& process_group() const;
  const DdpOptions& options() const;

  // Compares every rank's parameters and buffers with rank 0's, bit for bit.
  // Collective: every rank calls it. Throws, on rank 0, an Error naming each
  // differing rank, its largest difference and the tensor holding it
  // ("module." names, as PyTorch's DDP's state_dict has them); on the other
  // ranks a PeerLost. `when` says when, for the message ("after epoch 3").
  void check_replicas(const std::string& when = "now");

  // Uneven inputs, as PyTorch's Join context for DDP: runs `loop` (this
  // rank's training loop, its ddp.forward()s and backwards). Once it
  // returns, this rank serves the others' collectives, on this DDP's own
  // streams, with zeros, until every rank's loop has returned: a rank
  // whose data ran out counts as zero gradients in the others' averages
  // (see JoinOptions for the divisor), their buffer broadcasts come from
  // the highest rank still active once rank 0 has joined, and their
  // SyncBatchNorm statistics are served, the joined ranks contributing
  // nothing. Then every rank takes the parameters, buffers and the hook's
  // shared state of the rank that joined last, so the replicas end
  // identical. Collective: every rank calls join() around its loop. A
  // GradScaler's scale on a rank that joined early stays where it was.
  // Needs the collective check (ProcessGroupOptions::check_collectives);
  // not for a model with sparse gradients.
  void join(const std::function<void()>& loop, const JoinOptions& options = {});

  // What the hook has put on the wire so far.
  hooks::WireStats wire_stats() const;
  // Seconds backward has spent, at its end, waiting for buckets still being
  // communicated: the communication that did not overlap computation.
  double communication_wait_seconds() const;
  // One line per bucket: index, parameters, elements, bytes, names.
  std::vector<std::string> describe_buckets() const;

 protected:
  // Blocks until every rank has constructed its DDP. Every parameter and
  // buffer must be on group.device(). Throws UsageError for a model it
  // cannot take or one that differs from another rank's, naming the tensor.
  DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module, const ProcessGroup& group,
                              const DdpOptions& options);
  // Called before each forward of the module, and after it with the
  // tensors it returned (`all`: whether those are all of what it returned).
  void prepare_forward();
  void after_forward(const std::vector<at::Tensor>& outputs, bool all);

 private:
  friend class detail::ReducerAccess;
  std::shared_ptr<detail::Reducer> reducer_;
};

namespace detail {
template <typename T>
constexpr bool is_module_holder_v = std::is_base_of_v<torch::detail::ModuleHolderIndicator, T>;
// The module class behind M: M itself, or the Impl of a TORCH_MODULE holder.
template <typename M, bool = is_module_holder_v<M>>
struct module_of {
  using type = M;
};
template <typename M>
struct module_of<M, true> {
  using type = typename M::ContainedType;
};
template <typename>
constexpr bool always_false_v = false;
// The tensors in a module's output: a tensor, or tuples, pairs and vectors
// of them; anything else sets `all` false.
inline void collect_tensors(std::vector<at::Tensor>& out, bool&, const at::Tensor& t) { out.push_back(t); }
template <typename T>
void collect_tensors(std::vector<at::Tensor>&, bool& all, const T&) {
  all = false;
}
template <typename A, typename B>
void collect_tensors(std::vector<at::Tensor>& out, bool& all, const std::pair<A, B>& p);
template <typename T>
void collect_tensors(std::vector<at::Tensor>& out, bool& all, const std::vector<T>& v);
template <typename... T>
void collect_tensors(std::vector<at::Tensor>& out, bool& all, const std::tuple<T...>& t);
template <typename A, typename B>
void collect_tensors(std::vector<at::Tensor>& out, bool& all, const std::pair<A, B>& p) {
  collect_tensors(out, all, p.first);
  collect_tensors(out, all, p.second);
}
template <typename T>
void collect_tensors(std::vector<at::Tensor>& out, bool& all, const std::vector<T>& v) {
  for (const auto& e : v) collect_tensors(out, all, e);
}
template <typename... T>
void collect_tensors(std::vector<at::Tensor>& out, bool& all, const std::tuple<T...>& t) {
  std::apply([&](const auto&... e) { (collect_tensors(out, all, e), ...); }, t);
}
// A module itself, not a pointer or holder of one.
template <typename T>
constexpr bool is_module_by_value_v = std::is_base_of_v<torch::nn::Module, std::decay_t<T>>;
}  // namespace detail

// ModuleType: the module's class (NetImpl, or any torch::nn::Module) or its
// TORCH_MODULE holder (Net): DistributedDataParallel<Net> and
// DistributedDataParallel<NetImpl> both take either.
template <typename ModuleType>
class DistributedDataParallel : public DistributedDataParallelBase {
 public:
  using Module = typename detail::module_of<ModuleType>::type;
  static_assert(std::is_base_of_v<torch::nn::Module, Module>,
                "DistributedDataParallel<M>: M must be a torch::nn::Module or a TORCH_MODULE holder of one");

  // `module`'s parameters and buffers must be on group.device() already
  // (model->to(group.device())). Blocks until every rank has constructed
  // its DDP: every rank wraps the same model, in the same order.
  DistributedDataParallel(std::shared_ptr<Module> module, const ProcessGroup& group, const DdpOptions& options = {})
      : DistributedDataParallelBase(module, group, options), module_(std::move(module)) {}
  // An empty holder (`Net net{nullptr}`) is a UsageError, as a null module.
  DistributedDataParallel(const torch::nn::ModuleHolder<Module>& module, const ProcessGroup& group,
                          const DdpOptions& options = {})
      : DistributedDataParallel(module.is_empty() ? nullptr : module.ptr(), group, options) {}
  // A model held by value (`Net model;`) cannot be shared with DDP: refused
  // at compile time.
  template <typename T, typename = std::enable_if_t<detail::is_module_by_value_v<T>>>
  DistributedDataParallel(T& model_by_value, const ProcessGroup& group, const DdpOptions& options = {})
      : DistributedDataParallelBase(nullptr, group, options) {
    static_assert(detail::always_false_v<T>,
                  "DistributedDataParallel takes the model by std::shared_ptr or as a TORCH_MODULE holder, "
                  "not by value or reference: hold it in a std::make_shared<Net>() or a TORCH_MODULE(Net) holder");
  }

  // The module's forward, with what it takes and what it returns.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    prepare_forward();
    if constexpr (std::is_void_v<decltype(module_->forward(std::forward<Args>(args)...))>) {
      module_->forward(std::forward<Args>(args)...);
      after_forward({}, false);
    } else {
      decltype(auto) out = module_->forward(std::forward<Args>(args)...);
      std::vector<at::Tensor> tensors;
      bool all = true;
      detail::collect_tensors(tensors, all, out);
      after_forward(tensors, all);
      return out;
    }
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  const std::shared_ptr<Module>& module() const { return module_; }
  Module* operator->() const { return module_.get(); }
  void train(bool on = true) { module_->train(on); }
  void eval() { module_->eval(); }
  bool is_training() const { return module_->is_training(); }

 private:
  std::shared_ptr<Module> module_;
};

template <typename M>
DistributedDataParallel(std::shared_ptr<M>, const ProcessGroup&, const DdpOptions& = {}) -> DistributedDataParallel<M>;
template <typename H, typename = std::enable_if_t<detail::is_module_holder_v<H>>>
DistributedDataParallel(const H&, const ProcessGroup&, const DdpOptions& = {}) -> DistributedDataParallel<H>;
template <typename T, typename = std::enable_if_t<detail::is_module_by_value_v<T>>, typename = void>
DistributedDataParallel(T&, const ProcessGroup&, const DdpOptions& = {}) -> DistributedDataParallel<T>;

}  // namespace mnist_ddp
