// The Reducer's construction and its buckets (reducer.hpp); forward,
// backward and averaging are in averaging.cpp.
#include "parallel/reducer.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "parallel/norm.hpp"
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

// A tensor of `type` over part of `buffer`'s memory (from `offset`
// elements of the buffer's) that autograd does not treat as a view, so
// optimizers may detach_() and zero_() it in place. It keeps the buffer
// alive. A complex one lies over twice as many of the buffer's reals.
torch::Tensor alias(const torch::Tensor& buffer, int64_t offset, at::IntArrayRef sizes, c10::ScalarType type) {
  auto* data = static_cast<char*>(buffer.data_ptr()) + offset * buffer.element_size();
  return torch::from_blob(data, sizes, [keep = buffer](void*) {}, buffer.options().dtype(type));
}

std::string megabytes(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f MB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}

// The modules whose parameters some DistributedDataParallel averages: one
// model wrapped twice would average its gradients twice, or not at all.
std::mutex g_wrapped_mutex;
std::set<const torch::nn::Module*>& wrapped() {
  static std::set<const torch::nn::Module*> modules;
  return modules;
}

}  // namespace

// Every rank gets the authority's `tensors` (rank 0's, or while ranks have
// joined the highest active rank's): one broadcast per dtype, complex
// tensors as their real and imaginary parts.
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
    torch::Tensor sent = flat.is_complex() ? torch::view_as_real(flat).reshape(-1) : flat;
    stream.broadcast(sent, kAuthority, issuer);
    int64_t offset = 0;
    for (auto& t : list) {
      t.copy_(flat.slice(0, offset, offset + t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

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
    : module_(std::move(module)),
      group_(std::move(group)),
      options_(std::move(options)),
      hook_(hooks::allreduce()) {}

void Reducer::init() {
  if (!module_) throw UsageError("DistributedDataParallel: the module is null");
  if (!(options_.bucket_cap_mb() > 0) || !(options_.first_bucket_cap_mb() > 0))
    throw UsageError("DistributedDataParallel: bucket_cap_mb and first_bucket_cap_mb must be positive");
  const torch::Device& device = group_.device();
  for (const auto& name : options_.params_to_ignore()) {
    auto named = [&](const auto& list) {
      return std::any_of(list.begin(), list.end(), [&](const auto& item) { return item.first == "module." + name; });
    };
    if (!named(distinct_named(module_->named_parameters())) && !named(distinct_named(module_->named_buffers())))
      throw UsageError("DistributedDataParallel: params_to_ignore names " + name + ", which the module does not have");
  }
  const auto params = synced(module_->named_parameters());
  auto on_device = [&](const std::string& what, const std::string& name, const torch::Tensor& t) {
    if (t.device() != device)
      throw UsageError("DistributedDataParallel: " + what + " " + name + " is on " + t.device().str() +
                       ", the process group's device is " + device.str() + ": call model->to(group.device()) first");
  };
  std::set<const void*> sparse_weights;  // Embeddings' and EmbeddingBags' with sparse(true)
  for (const auto& item : module_->named_modules()) {
    if (const auto* e = dynamic_cast<const torch::nn::EmbeddingImpl*>(item.value().get()); e && e->options.sparse())
      sparse_weights.insert(e->weight.unsafeGetTensorImpl());
    if (const auto* e = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(item.value().get()); e && e->options.sparse())
      sparse_weights.insert(e->weight.unsafeGetTensorImpl());
  }
  for (const auto& [name, t] : params) {
    on_device("parameter", name, t);
    if (!t.requires_grad()) continue;  // frozen: in no bucket
    if (!t.is_floating_point() && !t.is_complex())
      throw UsageError("DistributedDataParallel: parameter " + name + " requires a gradient but is not floating-point");
    params_.push_back(t);
    param_names_.push_back(name);
    sparse_.push_back(sparse_weights.count(t.unsafeGetTensorImpl()) > 0);
  }
  if (params_.empty())
    throw UsageError("DistributedDataParallel is not needed when a module doesn't have any parameter that requires "
                     "a gradient");
  for (const auto& [name, t] : synced(module_->named_buffers())) {
    on_device("buffer", name, t);
    buffers_.push_back(t);
  }
  {
    std::lock_guard<std::mutex> lock(g_wrapped_mutex);
    if (!wrapped().insert(module_.get()).second)
      throw UsageError("DistributedDataParallel: this module is wrapped in another DistributedDataParallel already; "
                       "wrap each model once");
    registered_ = true;
  }
  const ProcessGroup given = group_;
  std::tie(group_, model_) = model_group(given);
  stream_ = bulk_stream(group_);
  quick_ = quick_stream(group_);

  // Every rank wraps the same model, with the same options: compared before
  // anything of a size another rank does not expect is sent.
  const std::string difference =
      quick_->disagreement(description(), "DistributedDataParallel", kSameModel, issuer("DistributedDataParallel's start"));
  if (!difference.empty()) throw UsageError(difference);

  // Every rank starts from rank 0's state: its parameters (frozen ones too)
  // and buffers.
  std::vector<torch::Tensor> state;
  for (const auto& [name, t] : params) state.push_back(t);
  for (const auto& t : buffers_) state.push_back(t);
  broadcast_from_authority(*quick_, state, issuer("DistributedDataParallel's start: rank 0's parameters and buffers"));

  // A SyncBatchNorm that names no group (or this DDP's) takes this model's
  // view of it, and its name in the model, for what its collectives say of
  // themselves.
  for (const auto& item : module_->named_modules())
    if (auto* sync = dynamic_cast<SyncBatchNormImpl*>(item.value().get())) {
      const auto& named = sync->process_group();
      if (!named || named->state() == given.state()) sync->set_process_group(group_);
      if (sync->layer_name().empty()) sync->set_layer_name(item.key());
    }

  // Buckets in reverse registration order: roughly the order in which
  // backward produces gradients.
  std::vector<size_t> order(params_.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = params_.size() - 1 - k;
  make_buckets(order);
  used_.assign(params_.size(), false);
  fires_.assign(params_.size(), 0);
  ready_.assign(params_.size(), false);

  const std::weak_ptr<Reducer> self = weak_from_this();
  for (size_t p = 0; p < params_.size(); ++p) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[p]);
    accumulator->add_pre_hook(
        std::make_unique<AccumulatorHook>(self, [p](Reducer& r) { r.before_accumulating(p); }));
    accumulator->add_post_hook(std::make_unique<AccumulatorHook>(self, [p](Reducer& r) { r.mark_ready(p); }));
    accumulators_.push_back(std::move(accumulator));
  }
}

// One dtype a bucket (a complex parameter's bucket holds reals); a sparse
// gradient in a bucket of its own, without a buffer.
void Reducer::make_buckets(const std::vector<size_t>& order) {
  std::vector<int64_t> sizes;
  std::vector<int> kinds;
  for (size_t p : order) {
    sizes.push_back(params_[p].numel() * params_[p].element_size());
    kinds.push_back(sparse_[p] ? -1 - static_cast<int>(p) : static_cast<int>(params_[p].scalar_type()));
  }
  const auto mib = [](double mb) { return static_cast<int64_t>(mb * 1024 * 1024); };
  const auto assignment = compute_bucket_assignment(
      sizes, std::min(mib(options_.first_bucket_cap_mb()), mib(options_.bucket_cap_mb())), mib(options_.bucket_cap_mb()),
      kinds);
  std::vector<torch::Tensor> old_views = grad_views_;
  buckets_.clear();
  bucket_sizes_.clear();
  bucket_of_.assign(params_.size(), 0);
  grad_views_.assign(params_.size(), torch::Tensor());
  for (size_t b = 0; b < assignment.size(); ++b) {
    const torch::Tensor& first = params_[order[assignment[b].front()]];
    const bool sparse = sparse_[order[assignment[b].front()]];
    const c10::ScalarType real = c10::toRealValueType(first.scalar_type());
    int64_t total = 0;
    for (size_t k : assignment[b]) total += params_[order[k]].numel() * (params_[order[k]].is_complex() ? 2 : 1);
    torch::Tensor buffer;
    if (!sparse) buffer = torch::zeros({total}, first.options().dtype(real).requires_grad(false));
    std::vector<torch::Tensor> gradients, parameters;
    std::vector<std::string> names;
    int64_t offset = 0;
    for (size_t k : assignment[b]) {
      const size_t p = order[k];
      const torch::Tensor& param = params_[p];
      if (!sparse) {
        grad_views_[p] = alias(buffer, offset, param.sizes(), param.scalar_type());
        gradients.push_back(param.is_complex() ? torch::view_as_real(grad_views_[p]) : grad_views_[p]);
        offset += param.numel() * (param.is_complex() ? 2 : 1);
      }
      parameters.push_back(param);
      names.push_back(param_names_[p].substr(7));  // without "module."
      bucket_of_[p] = b;
    }
    buckets_.emplace_back(b, b + 1 == assignment.size(), buffer, gradients, parameters, names);
    bucket_sizes_.push_back(assignment[b].size());
  }
  // Gradients already in the old buckets move to the new ones.
  torch::NoGradGuard no_grad;
  for (size_t p = 0; p < params_.size() && !old_views.empty(); ++p) {
    torch::Tensor& grad = params_[p].mutable_grad();
    if (grad.defined() && old_views[p].defined() && grad.is_same(old_views[p])) {
      grad_views_[p].copy_(grad);
      grad = grad_views_[p];
    }
  }
  pending_.assign(bucket_sizes_.begin(), bucket_sizes_.end());
}

void Reducer::rebuild_buckets() {
  // The order of rank 0, on every rank: every rank must bucket alike.
  auto order = torch::tensor(std::vector<int64_t>(ready_order_.begin(), ready_order_.end()), torch::kInt64)
                   .to(quick_->device());  // NCCL's collectives take the device's tensors only
  quick_->broadcast(order, 0, issuer("DistributedDataParallel's buckets rebuilt in rank 0's order"));
  order = order.cpu();
  std::vector<size_t> first_ready;
  for (int64_t i = 0; i < order.numel(); ++i) first_ready.push_back(static_cast<size_t>(order[i].item<int64_t>()));
  make_buckets(first_ready);
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
  std::lock_guard<std::mutex> lock(g_wrapped_mutex);
  if (registered_) wrapped().erase(module_.get());
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
  static const char* const words[] = {"first", "second", "third", "fourth", "fifth",
                                      "sixth", "seventh", "eighth", "ninth", "tenth"};
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

std::vector<std::string> Reducer::describe_buckets() const {
  std::vector<std::string> lines;
  for (const auto& b : buckets_) {
    std::ostringstream s;
    const bool sparse = !b.buffer().defined();
    const int64_t elements = sparse ? b.parameters()[0].numel() : b.buffer().numel();
    s << "bucket " << b.index() << ": " << b.parameters().size() << " parameters, " << elements << " elements ("
      << (sparse ? "sparse" : megabytes(elements * b.buffer().element_size())) << "):";
    for (const auto& name : b.parameter_names()) s << " " << name;
    lines.push_back(s.str());
  }
  return lines;
}

}  // namespace mnist_ddp
