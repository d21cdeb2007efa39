// The Reducer's construction, forward and backward (reducer.hpp).
#include "parallel/reducer.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <set>
#include <unordered_set>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "comm/group.hpp"

namespace mnist_ddp {

using detail::Reducer;

namespace {

// Calls back a Reducer while it lives, before (pre) or after (post) an
// accumulator adds a gradient: autograd keeps the hook as long as the
// accumulator, which may outlive the DDP.
class AccumulatorHook : public torch::autograd::FunctionPreHook, public torch::autograd::FunctionPostHook {
 public:
  AccumulatorHook(std::weak_ptr<Reducer> reducer, std::function<void(Reducer&)> call)
      : reducer_(std::move(reducer)), call_(std::move(call)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (const auto reducer = reducer_.lock()) call_(*reducer);
    return grads;
  }
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (const auto reducer = reducer_.lock()) call_(*reducer);
    return outputs;
  }

 private:
  std::weak_ptr<Reducer> reducer_;
  std::function<void(Reducer&)> call_;
};

// The modules whose parameters some DistributedDataParallel averages: one
// model wrapped twice would average its gradients twice, or not at all.
std::mutex g_wrapped_mutex;
std::set<const torch::nn::Module*>& wrapped() {
  static std::set<const torch::nn::Module*> modules;
  return modules;
}

// The weights of Embeddings and EmbeddingBags with sparse(true).
std::set<const void*> sparse_weights(torch::nn::Module& module) {
  std::set<const void*> weights;
  for (const auto& item : module.named_modules()) {
    if (const auto* e = dynamic_cast<const torch::nn::EmbeddingImpl*>(item.value().get()); e && e->options.sparse())
      weights.insert(e->weight.unsafeGetTensorImpl());
    if (const auto* e = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(item.value().get()); e && e->options.sparse())
      weights.insert(e->weight.unsafeGetTensorImpl());
  }
  return weights;
}

// A bucket cap of `mb` MiB (positive: checked), in bytes; a cap beyond a
// TiB (infinity included) is no cap, never a conversion out of range.
int64_t mib(double mb) { return static_cast<int64_t>(std::min(mb, 1e6) * 1024 * 1024); }

}  // namespace

// One broadcast, whatever the tensors' dtypes: their bytes, laid end to
// end, widest elements first, so that each lies where a view of its own
// type may begin (a copy moves bytes alike, so every rank ends bit for bit
// with the authority's).
void broadcast_from_authority(CollectiveStream& stream, const std::vector<torch::Tensor>& tensors,
                              const Issuer& issuer) {
  if (stream.world_size() == 1 || tensors.empty()) return;
  torch::NoGradGuard no_grad;
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return tensors[a].element_size() > tensors[b].element_size(); });
  std::vector<torch::Tensor> parts;
  for (size_t i : order) parts.push_back(tensors[i].detach().contiguous().reshape(-1).view(torch::kUInt8));
  torch::Tensor flat = torch::cat(parts);
  stream.broadcast(flat, kAuthority, issuer);
  int64_t at = 0;
  for (size_t i : order) {
    const torch::Tensor& t = tensors[i];
    const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
    torch::Tensor(t).copy_(flat.slice(0, at, at + n).view(t.scalar_type()).view(t.sizes()));
    at += n;
  }
}

std::vector<std::pair<std::string, torch::Tensor>> distinct_named(
    const torch::OrderedDict<std::string, torch::Tensor>& named) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::set<const void*> seen;
  for (const auto& item : named)
    if (item.value().defined() && seen.insert(item.value().unsafeGetTensorImpl()).second)
      out.emplace_back("module." + item.key(), item.value());
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> Reducer::synced(
    const torch::OrderedDict<std::string, torch::Tensor>& named) const {
  const auto& ignored = options_.params_to_ignore();
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& item : distinct_named(named))
    if (std::find(ignored.begin(), ignored.end(), item.first.substr(7)) == ignored.end()) out.push_back(std::move(item));
  return out;
}

std::shared_ptr<Reducer> Reducer::create(std::shared_ptr<torch::nn::Module> module, ProcessGroup group,
                                         DdpOptions options) {
  std::shared_ptr<Reducer> reducer(new Reducer(std::move(module), std::move(group), std::move(options)));
  reducer->init();
  return reducer;
}

Reducer::Reducer(std::shared_ptr<torch::nn::Module> module, ProcessGroup group, DdpOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(std::move(options)) {}

Reducer::~Reducer() {
  std::lock_guard<std::mutex> lock(g_wrapped_mutex);
  if (registered_) wrapped().erase(module_.get());
}

void Reducer::init() {
  use_library_advice();
  if (!module_) throw UsageError("DistributedDataParallel: the module is null (an empty module holder?)");
  for (const double cap : {options_.bucket_cap_mb(), options_.first_bucket_cap_mb()})
    if (!(cap > 0))  // NaN and negatives; infinity is no cap
      throw UsageError("DistributedDataParallel: bucket_cap_mb and first_bucket_cap_mb must be positive numbers of MiB");
  for (const auto& name : options_.params_to_ignore()) {
    auto named = [&](const auto& list) {
      return std::any_of(list.begin(), list.end(), [&](const auto& item) { return item.first == "module." + name; });
    };
    if (!named(distinct_named(module_->named_parameters())) && !named(distinct_named(module_->named_buffers())))
      throw UsageError("DistributedDataParallel: params_to_ignore names " + name + ", which the module does not have");
  }
  collect_parameters();
  claim_module();
  const ProcessGroup given = group_;
  const ModelPlace place = model_group(given);
  group_ = place.group;
  naming_ = DdpNames(place.model, place.models);
  stream_ = bulk_stream(group_);
  quick_ = quick_stream(group_);
  averager_ = std::make_shared<Averager>(stream_, naming_);
  compare_and_broadcast(given);
  // Buckets in reverse registration order: roughly the order in which
  // backward produces gradients.
  std::vector<size_t> order(params_.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = params_.size() - 1 - k;
  iteration_ = std::make_unique<Iteration>(params_.size(), options_.find_unused_parameters(), options_.static_graph(),
                                            static_cast<Iteration::Effects&>(*this));
  make_buckets(order);
  hook_accumulators();
}

void Reducer::collect_parameters() {
  const torch::Device& device = group_.device();
  auto on_device = [&](const std::string& what, const std::string& name, const torch::Tensor& t) {
    if (t.device() != device)
      throw UsageError("DistributedDataParallel: " + what + " " + name + " is on " + t.device().str() +
                       ", the process group's device is " + device.str() + ": call model->to(group.device()) first");
  };
  const auto sparse = sparse_weights(*module_);
  for (const auto& [name, t] : synced(module_->named_parameters())) {
    on_device("parameter", name, t);
    if (!t.requires_grad()) continue;  // frozen: in no bucket
    if (!t.is_floating_point() && !t.is_complex())
      throw UsageError("DistributedDataParallel: parameter " + name + " requires a gradient but is not floating-point");
    params_.push_back({t, name.substr(7), sparse.count(t.unsafeGetTensorImpl()) > 0});
    names_.push_back(name.substr(7));
  }
  if (params_.empty())
    throw UsageError("DistributedDataParallel is not needed when a module doesn't have any parameter that requires "
                     "a gradient");
  for (const auto& [name, t] : synced(module_->named_buffers())) {
    on_device("buffer", name, t);
    buffers_.push_back(t);
  }
}

void Reducer::claim_module() {
  std::lock_guard<std::mutex> lock(g_wrapped_mutex);
  if (!wrapped().insert(module_.get()).second)
    throw UsageError("DistributedDataParallel: this module is wrapped in another DistributedDataParallel already; "
                     "wrap each model once");
  registered_ = true;
}

// Every rank wraps the same model, with the same options: compared before
// anything of a size another rank does not expect is sent. Then every rank
// starts from rank 0's state: its parameters (frozen ones too) and buffers.
void Reducer::compare_and_broadcast(const ProcessGroup& given) {
  const std::string difference = quick_->disagreement(description(), "DistributedDataParallel", kSameModel,
                                                      issuer(kDdpStart, "DistributedDataParallel's start"));
  if (!difference.empty()) throw UsageError(difference);
  broadcast_from_authority(*quick_, state_tensors(),
                           issuer(kDdpStart, "DistributedDataParallel's start: rank 0's parameters and buffers"));
  // A SyncBatchNorm that names no group (or this DDP's) takes this model's
  // view of it, and its name in the model, for what its collectives say of
  // themselves.
  for (const auto& item : module_->named_modules())
    if (auto* sync = dynamic_cast<SyncBatchNormImpl*>(item.value().get())) {
      const auto& named = sync->process_group();
      if (!named || GroupAccess::share(*named) == GroupAccess::share(given)) sync->set_process_group(group_);
      if (sync->layer_name().empty()) sync->set_layer_name(item.key());
    }
}

void Reducer::hook_accumulators() {
  const std::weak_ptr<Reducer> self = weak_from_this();
  for (size_t p = 0; p < params_.size(); ++p) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[p].tensor);
    accumulator->add_pre_hook(std::make_unique<AccumulatorHook>(self, [p](Reducer& r) { r.before_accumulating(p); }));
    accumulator->add_post_hook(std::make_unique<AccumulatorHook>(self, [p](Reducer& r) { r.mark_ready(p); }));
    accumulators_.push_back(std::move(accumulator));
  }
}

std::vector<torch::Tensor> Reducer::state_tensors() const {
  std::vector<torch::Tensor> state;
  for (const auto& [name, t] : synced(module_->named_parameters())) state.push_back(t);
  for (const auto& t : buffers_) state.push_back(t);
  return state;
}

void Reducer::make_buckets(const std::vector<size_t>& order) {
  auto layout = std::make_unique<BucketLayout>(params_, order, mib(options_.first_bucket_cap_mb()), mib(options_.bucket_cap_mb()));
  if (layout_) layout->adopt_gradients(params_, *layout_);  // gradients already in the old buckets move
  layout_ = std::move(layout);
  iteration_->use_layout(*layout_);
}

void Reducer::rebuild_buckets() {
  // The authority's order, on every rank: every rank must bucket alike.
  const auto& learned = iteration_->ready_order();
  auto order = torch::tensor(std::vector<int64_t>(learned.begin(), learned.end()), torch::kInt64).to(quick_->device());
  quick_->broadcast(order, kAuthority, issuer(kRebuild, "DistributedDataParallel's buckets rebuilt in rank 0's order"));
  order = order.cpu();
  std::vector<size_t> first_ready;
  for (int64_t i = 0; i < order.numel(); ++i) first_ready.push_back(static_cast<size_t>(order[i].item<int64_t>()));
  make_buckets(first_ready);
  iteration_->rebuilt();
}

void Reducer::register_comm_hook(hooks::CommHookPtr hook) {
  if (!hook) throw UsageError("register_comm_hook: the hook is null");
  if (hook_registered_)
    throw UsageError("register_comm_hook: this DistributedDataParallel has a hook (" + averager_->hook()->name() +
                     "); register one, once, before the first backward");
  std::lock_guard<std::mutex> lock(mutex_);
  if (iteration_->backward_seen())
    throw UsageError("register_comm_hook: called after the first backward, whose buckets " + averager_->hook()->name() +
                     " averaged; register the hook once, before the first backward, on every rank");
  averager_->set_hook(std::move(hook));
  hook_registered_ = true;
  hook_layout_known_ = false;
}

Issuer Reducer::issuer(IssuerKind kind, const std::string& what) const { return naming_.issuer(kind, what); }

// ---- forward and backward ----

// Buffers are broadcast as PyTorch's DDP does: before a forward with
// gradients that will be averaged; so a forward under NoGradGuard on one
// rank (evaluating, sampling) issues no collective.
void Reducer::prepare_forward() {
  check_bypass();
  if (!torch::GradMode::is_enabled()) return;
  finish_open_iteration();
  if (!hook_layout_known_) follow_hook_layout();
  if (counting_) scale_ = counting_();
  if (iteration_->rebuild_due()) rebuild_buckets();
  if (no_sync_depth_ == 0 && options_.broadcast_buffers())
    broadcast_from_authority(*quick_, buffers_, issuer(kBuffers, "DistributedDataParallel's buffers before a forward"));
  std::lock_guard<std::mutex> lock(mutex_);
  iteration_->open(no_sync_depth_ > 0);
}

// PyTorch's search for unused parameters: every node the outputs' graph
// reaches; a parameter whose accumulator is not among them gets nothing.
void Reducer::after_forward(const std::vector<torch::Tensor>& outputs, bool all) {
  if (!torch::GradMode::is_enabled() || !all) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!iteration_->wants_walk()) return;
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
  std::vector<bool> reached(params_.size());
  for (size_t p = 0; p < params_.size(); ++p) reached[p] = seen.count(accumulators_[p].get()) > 0;
  iteration_->walked(reached);
}

// Makes params_[p].grad the view into its bucket, keeping its value (zero
// when it had none). Optimizers may have reset .grad (zero_grad() sets it
// to undefined in LibTorch 2) or replaced it.
void Reducer::link_grad(size_t p) {
  if (params_[p].sparse) return;
  torch::Tensor& grad = params_[p].tensor.mutable_grad();
  const torch::Tensor& view = layout_->view(p);
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
  if (!params_[p].tensor.grad().defined()) link_grad(p);
}

void Reducer::took_gradient(size_t p) { link_grad(p); }

// Ready without a gradient: what its .grad was is kept, should no rank use
// it; its bucket holds .grad, or zeros (.grad stays undefined unless
// another rank used it).
void Reducer::counted_unused(size_t p) {
  if (kept_.count(p)) return;
  const torch::Tensor& grad = params_[p].tensor.grad();
  kept_[p] = grad.defined() ? grad.detach().clone() : torch::Tensor();
  if (grad.defined()) {
    link_grad(p);
  } else if (!params_[p].sparse) {
    torch::NoGradGuard no_grad;
    layout_->view(p).zero_();
  }
}

void Reducer::bucket_ready(size_t b) { averager_->post(layout_->bucket(b)); }

void Reducer::round_began() { averager_->announce(layout_->bucket(0)); }

void Reducer::mark_ready(size_t p) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!iteration_->gradient(p, names_[p])) return;
  std::weak_ptr<Reducer> self = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([self] {
    if (const auto reducer = self.lock()) reducer->end_backward();
  });
}

void Reducer::end_backward() {
  std::unique_lock<std::mutex> lock(mutex_);
  switch (iteration_->end_backward()) {
    case Iteration::End::bypassed:  // named only if an optimizer steps on these gradients (check_bypass())
      if (!bypassed_at_) {
        std::vector<torch::Tensor> tensors;
        for (const auto& p : params_) tensors.push_back(p.tensor);
        bypassed_at_ = checksum(tensors);
      }
      return;
    case Iteration::End::complete: return complete_iteration(lock);
    case Iteration::End::open:
    case Iteration::End::ignored: return;
  }
}

// Note on parameters without a gradient. Every rank posts every bucket, in
// order, whatever its graph: a parameter that got no gradient joins its
// bucket as whatever its .grad holds (what no_sync's micro-batches
// accumulated, or zero). Where they may (find_unused_parameters,
// static_graph) one more allreduce counts the ranks that used each
// parameter since the last averaging; one that no rank used gets its .grad
// back as it was.
void Reducer::complete_iteration(std::unique_lock<std::mutex>& lock) {
  const std::vector<bool> used = iteration_->close();
  auto used_by = std::make_shared<torch::Tensor>();  // param -> ranks that used it
  if (options_.find_unused_parameters() || options_.static_graph()) {
    auto mine = torch::zeros({static_cast<int64_t>(params_.size())}, torch::kFloat32);
    for (size_t p = 0; p < params_.size(); ++p) mine[static_cast<int64_t>(p)] = used[p] ? 1.0f : 0.0f;
    averager_->post_count(mine, used_by);
  }
  std::map<size_t, torch::Tensor> kept;
  kept.swap(kept_);
  lock.unlock();
  averager_->take(scale_, static_cast<double>(group_.world_size()) / scale_);
  if (used_by->defined()) restore_unused(kept, *used_by);
}

void Reducer::restore_unused(const std::map<size_t, torch::Tensor>& kept, const torch::Tensor& used_by) {
  torch::NoGradGuard no_grad;
  for (const auto& [p, before] : kept) {
    torch::Tensor& grad = params_[p].tensor.mutable_grad();
    if (used_by[static_cast<int64_t>(p)].item<float>() > 0) {  // another rank's gradient, averaged
      if (!grad.defined() && !params_[p].sparse) grad = layout_->view(p);
    } else if (before.defined() && !params_[p].sparse) {
      layout_->view(p).copy_(before);
    } else {
      grad = before;  // undefined where it was (a sparse gradient is no view)
    }
  }
}

void Reducer::finish_open_iteration() {
  std::unique_lock<std::mutex> lock(mutex_);
  const Iteration::LeftOpen left = iteration_->left_open(names_);
  if (!left.open) return;
  complete_iteration(lock);  // the buckets go out all the same, so that no peer waits for this rank
  if (!left.had_gradients) return;
  throw UsageError("DistributedDataParallel: the last backward ended before these parameters received " +
                   std::string(options_.static_graph() ? "as many gradients as in the first step:" : "a gradient:") +
                   left.missing + "; every parameter must take part in the loss, or construct DDP with "
                   "DdpOptions().find_unused_parameters(true)");
}

}  // namespace mnist_ddp
