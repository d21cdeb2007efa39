#include "mnist_ddp/parallel/comm_hooks.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <tuple>
#include <limits>
#include <sstream>

#include "parallel/exact_math.hpp"
#include "base/require.hpp"
#include "parallel/wires.hpp"

namespace mnist_ddp::hooks {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Draws Gaussian values into `q` from `seed` on the CPU, whatever q's device,
// so every rank draws the same numbers.
void fill_gaussian(torch::Tensor& q, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  q.copy_(torch::randn(q.sizes(), gen, q.options().device(torch::kCPU)));
}

// The tensor stored under `key`, moved to `device` (a loaded state lives on the CPU).
torch::Tensor& on_device(std::map<size_t, torch::Tensor>& memory, size_t key, const torch::Device& device) {
  torch::Tensor& t = memory.at(key);
  if (t.device() != device) t = t.to(device);
  return t;
}

// The error that `bucket` carries, a zero tensor shaped like `like` at first.
torch::Tensor& carried_error(PowerSgdState& state, size_t bucket, const torch::Tensor& like) {
  auto it = state.error.find(bucket);
  if (it == state.error.end()) return state.error[bucket] = torch::zeros_like(like);
  MNIST_DDP_REQUIRE(it->second.numel() == like.numel(), "PowerSGD: the saved error of bucket ", bucket, " has ",
              it->second.numel(), " elements, the bucket ", like.numel(), " (a different model or bucket layout?)");
  return on_device(state.error, bucket, like.device());
}

}  // namespace

std::vector<torch::Tensor> same_layout(const GradBucket& bucket, const torch::Tensor& flat) {
  std::vector<torch::Tensor> views;
  int64_t at = 0;
  for (const auto& g : bucket.gradients()) {
    views.push_back(flat.slice(0, at, at + g.numel()).view(g.sizes()));
    at += g.numel();
  }
  return views;
}

torch::Tensor future_tensor(const FuturePtr& future) {
  const c10::IValue& value = future->value();  // rethrows the future's error
  if (value.isTensor()) return value.toTensor();
  if (value.isTensorList() && value.toTensorList().size() == 1) return value.toTensorList().get(0);
  throw UsageError(c10::str("a communication hook's future must hold one tensor, got ", value.tagKind()));
}

FuturePtr Wire::allreduce_mean(torch::Tensor tensor) {
  tensor.div_(world_size());
  return allreduce_sum(tensor);
}

void GroupWire::count(const torch::Tensor& tensor) {
  stats_.elements += tensor.numel();
  stats_.bytes += tensor.numel() * static_cast<int64_t>(tensor.element_size());
}

FuturePtr GroupWire::allreduce_sum(torch::Tensor tensor) {
  count(tensor);
  return channel_.allreduce_sum(tensor);
}

FuturePtr GroupWire::allgather(const torch::Tensor& tensor) {
  count(tensor);
  return completed_future(channel_.allgather(tensor));
}

FuturePtr GroupWire::broadcast(torch::Tensor tensor, int root) {
  count(tensor);
  channel_.broadcast(tensor, root);
  return completed_future(tensor);
}

bool CastWire::lowers(const torch::Tensor& tensor) const {
  return tensor.is_floating_point() && static_cast<size_t>(tensor.element_size()) > c10::elementSize(type_);
}

FuturePtr CastWire::allreduce_sum(torch::Tensor tensor) {
  torch::Tensor low = tensor.to(type_);
  return below_.allreduce_sum(low)->then(
      [tensor, low](c10::ivalue::Future& sent) {
        sent.value();  // rethrows a failed collective
        tensor.copy_(low);
        return c10::IValue(tensor);
      },
      c10::TensorType::get());
}

FuturePtr CastWire::allreduce_mean(torch::Tensor tensor) {
  tensor.div_(world_size());  // before the cast, so the sum cannot overflow; the result replaces it anyway
  return allreduce_sum(tensor);
}

FuturePtr CastWire::allgather(const torch::Tensor& tensor) {
  if (!lowers(tensor)) return below_.allgather(tensor);
  const FuturePtr gathered = below_.allgather(tensor.to(type_));
  gathered->waitAndThrow();
  const torch::Tensor all = future_tensor(gathered);
  return completed_future(all.to(tensor.scalar_type()));
}

FuturePtr CastWire::broadcast(torch::Tensor tensor, int root) {
  if (!lowers(tensor)) return below_.broadcast(tensor, root);
  torch::Tensor low = tensor.to(type_);
  below_.broadcast(low, root)->waitAndThrow();
  tensor.copy_(low);
  return completed_future(tensor);
}

FuturePtr AllreduceHook::run(const GradBucket& bucket, Wire& wire) { return wire.allreduce_mean(bucket.buffer()); }

CompressWrapper::CompressWrapper(CommHookPtr inner, c10::ScalarType type) : inner_(std::move(inner)), type_(type) {
  MNIST_DDP_REQUIRE(inner_, "a compression wrapper needs a hook to wrap");
  MNIST_DDP_REQUIRE(type == torch::kHalf || type == torch::kBFloat16, "a compression wrapper sends float16 or bfloat16");
}

std::string CompressWrapper::name() const {
  const std::string suffix = type_ == torch::kHalf ? "fp16" : "bf16";
  return inner_->name() == "none" ? suffix : inner_->name() + "_" + suffix;
}

std::string CompressWrapper::describe() const {
  return (type_ == torch::kHalf ? "float16" : "bfloat16") + std::string(" on the wire, over ") + inner_->describe();
}

FuturePtr CompressWrapper::run(const GradBucket& bucket, Wire& wire) {
  CastWire low(wire, type_);
  FuturePtr result = inner_->run(bucket, low);
  result->waitAndThrow();  // `low` lives in this frame
  return result;
}

CommHookPtr allreduce() { return std::make_shared<AllreduceHook>(); }
CommHookPtr fp16_compress() { return fp16_compress_wrapper(allreduce()); }
CommHookPtr bf16_compress() { return bf16_compress_wrapper(allreduce()); }
CommHookPtr fp16_compress_wrapper(CommHookPtr hook) { return std::make_shared<CompressWrapper>(std::move(hook), torch::kHalf); }
CommHookPtr bf16_compress_wrapper(CommHookPtr hook) {
  return std::make_shared<CompressWrapper>(std::move(hook), torch::kBFloat16);
}
std::shared_ptr<PowerSgdHook> powersgd(const PowerSgdOptions& options) { return std::make_shared<PowerSgdHook>(options); }
std::shared_ptr<BatchedPowerSgdHook> batched_powersgd(const PowerSgdOptions& options) {
  return std::make_shared<BatchedPowerSgdHook>(options);
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const CommHook& hook) {
  const HookState state = hook.state();
  auto dict_of = [](const std::map<std::string, torch::Tensor>& from) {
    c10::Dict<std::string, torch::Tensor> dict;
    for (const auto& [key, t] : from) dict.insert(key, t.detach().cpu());
    return dict;
  };
  archive.write("hook", c10::IValue(hook.name()));
  archive.write("shared", c10::IValue(dict_of(state.shared)));
  archive.write("own", c10::IValue(dict_of(state.own)));
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, CommHook& hook) {
  c10::IValue name, shared, own;
  archive.read("hook", name);
  MNIST_DDP_REQUIRE(name.isString() && name.toStringRef() == hook.name(), "the saved hook state is ",
              name.isString() ? name.toStringRef() : std::string("not a hook's"), "'s, this hook is ", hook.name());
  archive.read("shared", shared);
  archive.read("own", own);
  HookState state;
  auto read = [](const c10::IValue& from, std::map<std::string, torch::Tensor>& to) {
    for (const auto& item : from.toGenericDict()) to[item.key().toStringRef()] = item.value().toTensor();
  };
  read(shared, state.shared);
  read(own, state.own);
  hook.load_state(state);
  return archive;
}

// Note on error feedback: each rank compresses M = its gradient + the error
// it carries, and keeps as its new error M minus what all ranks agreed on.
// The errors then sum to zero over ranks wherever nothing was lost, and the
// sum of applied updates plus the mean error equals the sum of the true
// averaged gradients. M is built in the error's own buffer (error += g, and
// later error -= result), which saves PyTorch's copy of the bucket.

FuturePtr PowerSgdBase::run(const GradBucket& bucket, Wire& wire) {
  FuturePtr result;
  if (compression_started()) {
    compress(bucket, wire);
    result = completed_future(bucket.buffer());
  } else {
    result = wire.allreduce_mean(bucket.buffer());
  }
  if (bucket.is_last()) ++state_.iter;
  return result;
}

PowerSgdBase::PowerSgdBase(const PowerSgdOptions& options) : options_(options) {
  auto refuse = [](const std::string& what) { throw UsageError("PowerSgdOptions: " + what); };
  if (options.matrix_approximation_rank() < 1)
    refuse("matrix_approximation_rank " + std::to_string(options.matrix_approximation_rank()) + ": must be at least 1");
  if (options.start_powersgd_iter() < 0)
    refuse("start_powersgd_iter " + std::to_string(options.start_powersgd_iter()) + ": must be at least 0");
  if (!(options.min_compression_rate() > 0) || !std::isfinite(options.min_compression_rate()))
    refuse("min_compression_rate must be a positive number");
  if (!(options.orthogonalization_epsilon() >= 0) || !std::isfinite(options.orthogonalization_epsilon()))
    refuse("orthogonalization_epsilon must be a number >= 0");
}

bool PowerSgdBase::compression_started() const { return state_.iter >= options_.start_powersgd_iter(); }

std::string PowerSgdBase::describe() const {
  const PowerSgdOptions& o = options_;
  std::ostringstream s;
  s << name() << " (matrix_approximation_rank " << o.matrix_approximation_rank() << ", start_powersgd_iter "
    << o.start_powersgd_iter() << ", min_compression_rate " << o.min_compression_rate() << ", use_error_feedback "
    << o.use_error_feedback() << ", warm_start " << o.warm_start() << ", orthogonalization_epsilon "
    << o.orthogonalization_epsilon() << ", random_seed " << o.random_seed() << ")";
  return s.str();
}

uint64_t PowerSgdBase::next_seed() { return splitmix64(options_.random_seed() + state_.draws++); }

namespace {

// "<what>/<bucket>" entries of `from` into `to`, by bucket index.
void by_bucket(const std::map<std::string, torch::Tensor>& from, const std::string& what,
               std::map<size_t, torch::Tensor>& to) {
  for (const auto& [key, t] : from) {
    if (key.compare(0, what.size() + 1, what + "/") != 0) continue;
    const std::string digits = key.substr(what.size() + 1);
    MNIST_DDP_REQUIRE(!digits.empty() && digits.size() < 10 &&
                    std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); }),
                "PowerSGD state: '", key, "' names no bucket");
    to[static_cast<size_t>(std::stoul(digits))] = t.detach().clone();
  }
}

}  // namespace

HookState PowerSgdBase::state() const {
  HookState s;
  s.shared["iter"] = torch::tensor(state_.iter, torch::kInt64);
  s.shared["draws"] = torch::tensor(static_cast<int64_t>(state_.draws), torch::kInt64);
  for (const auto& [b, t] : state_.p_memory) s.shared["p/" + std::to_string(b)] = t.detach().cpu().clone();
  for (const auto& [b, t] : state_.q_memory) s.shared["q/" + std::to_string(b)] = t.detach().cpu().clone();
  for (const auto& [b, t] : state_.error) s.own["error/" + std::to_string(b)] = t.detach().cpu().clone();
  return s;
}

void PowerSgdBase::load_state(const HookState& s) {
  for (const char* key : {"iter", "draws"})
    MNIST_DDP_REQUIRE(s.shared.count(key) && s.shared.at(key).numel() == 1, "PowerSGD state: no '", key,
                "' (the state of another hook?)");
  for (const auto& [key, t] : s.shared)
    MNIST_DDP_REQUIRE(key == "iter" || key == "draws" || key.rfind("p/", 0) == 0 || key.rfind("q/", 0) == 0,
                "PowerSGD state: '", key, "' is not PowerSGD's");
  for (const auto& [key, t] : s.own) MNIST_DDP_REQUIRE(key.rfind("error/", 0) == 0, "PowerSGD state: '", key, "' is not PowerSGD's");
  PowerSgdState loaded;
  loaded.iter = s.shared.at("iter").item<int64_t>();
  loaded.draws = static_cast<uint64_t>(s.shared.at("draws").item<int64_t>());
  by_bucket(s.shared, "p", loaded.p_memory);
  by_bucket(s.shared, "q", loaded.q_memory);
  by_bucket(s.own, "error", loaded.error);
  state_ = std::move(loaded);
}

namespace {

// The P and Q memories of bucket `b`, of `p_size` and `q_size` elements: the
// ones kept from the step before when warm-starting, else fresh, with Q
// drawn from the next seed (the same on every rank).
std::pair<torch::Tensor, torch::Tensor> memories(PowerSgdState& st, bool warm_start,
                                                 const std::function<uint64_t()>& next_seed, size_t b,
                                                 int64_t p_size, int64_t q_size, const torch::TensorOptions& options) {
  if (!warm_start || !st.p_memory.count(b)) {
    st.p_memory[b] = torch::empty({p_size}, options);
    st.q_memory[b] = torch::empty({q_size}, options);
    fill_gaussian(st.q_memory[b], next_seed());
  }
  // A loaded memory may be shaped as the matrix it holds: the elements count.
  torch::Tensor& p = on_device(st.p_memory, b, options.device());
  torch::Tensor& q = on_device(st.q_memory, b, options.device());
  MNIST_DDP_REQUIRE(p.numel() == p_size && q.numel() == q_size, "PowerSGD: the saved P/Q of bucket ", b,
              " do not fit its gradients");
  p = p.reshape({p_size});
  q = q.reshape({q_size});
  return {p, q};
}

// Note on the power iteration. One pass for all of a bucket's compressed
// matrices M_i [n_i, m_i], with P_i [n_i, r_i] and Q_i [m_i, r_i] laid one
// after another in the flat `p` and `q`: orthogonalise each Q_i, P_i = M_i
// Q_i, average every P in one allreduce, orthogonalise each P_i, Q_i =
// M_i^T P_i, average every Q in one allreduce, and write M_i ~ P_i Q_i^T
// into results[i] (exact math). P is orthonormalised after its allreduce,
// so its scale is irrelevant: averaging instead of PyTorch's sum keeps
// float16 sums finite.
void power_iteration(const std::vector<torch::Tensor>& matrices, const std::vector<int64_t>& ranks,
                     const std::vector<torch::Tensor>& results, torch::Tensor& p, torch::Tensor& q, Wire& wire,
                     double epsilon) {
  std::vector<torch::Tensor> ps, qs;
  for (size_t i = 0, p_at = 0, q_at = 0; i < matrices.size(); ++i) {
    const int64_t n = matrices[i].size(0), m = matrices[i].size(1), r = ranks[i];
    ps.push_back(p.slice(0, p_at, p_at + n * r).view({n, r}));
    qs.push_back(q.slice(0, q_at, q_at + m * r).view({m, r}));
    p_at += n * r;
    q_at += m * r;
  }
  for (auto& qi : qs) orthogonalize(qi, epsilon, Sums::kFast);
  for (size_t i = 0; i < matrices.size(); ++i) torch::mm_out(ps[i], matrices[i], qs[i]);
  wire.allreduce_mean(p)->waitAndThrow();
  for (auto& pi : ps) orthogonalize(pi, epsilon);
  for (size_t i = 0; i < matrices.size(); ++i) torch::mm_out(qs[i], matrices[i].t(), ps[i]);
  wire.allreduce_mean(q)->waitAndThrow();
  for (size_t i = 0; i < matrices.size(); ++i) exact_outer_product(results[i], ps[i], qs[i]);
}

// Ends bucket b's step; returns whether what it sent was finite. Without
// warm start the next step draws a fresh Q. An inf or NaN (a float16 loss
// scale too large for the step) reaches every rank alike through the
// allreduced P, Q and plain part; the step is then skipped (GradScaler),
// and lest the memories carry it into every later step, the bucket's error
// is zeroed and its P and Q drawn afresh, on every rank the same.
bool end_step(PowerSgdState& st, bool warm_start, size_t b, const std::vector<torch::Tensor>& sent,
              const torch::Tensor& error) {
  bool finite = true;
  for (const auto& t : sent) finite = finite && (!t.defined() || t.numel() == 0 || t.isfinite().all().item<bool>());
  if (!warm_start || !finite) {
    st.p_memory.erase(b);
    st.q_memory.erase(b);
  }
  if (!finite && error.defined()) error.zero_();
  return finite;
}

}  // namespace

void PowerSgdHook::compress(const GradBucket& bucket, Wire& wire) {
  PowerSgdState& st = state_;
  const std::function<uint64_t()> seed = [this] { return next_seed(); };
  const PowerSgdOptions& opt = options_;
  const torch::Tensor& input = bucket.buffer();
  const size_t b = bucket.index();
  torch::Tensor error;
  std::vector<torch::Tensor> sources = bucket.gradients();  // what to compress: the views of M
  if (opt.use_error_feedback()) {
    error = carried_error(st, b, input);
    error.add_(input);
    sources = same_layout(bucket, error);
  }

  // Which gradients to compress: those where P and Q are worth it.
  std::vector<torch::Tensor> matrices, results, uncompressed, destinations;
  std::vector<int64_t> ranks;
  int64_t p_size = 0, q_size = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& g = bucket.gradients()[i];
    const int64_t n = g.dim() ? g.size(0) : 1;
    const int64_t m = g.numel() / n;
    const int64_t r = std::min<int64_t>({n, m, opt.matrix_approximation_rank()});
    if (static_cast<double>((n + m) * r) * opt.min_compression_rate() < static_cast<double>(n * m)) {
      matrices.push_back(sources[i].reshape({n, m}));
      results.push_back(g.reshape({n, m}));
      ranks.push_back(r);
      p_size += n * r;
      q_size += m * r;
    } else {
      uncompressed.push_back(sources[i]);
      destinations.push_back(g);
    }
  }

  // Uncompressed gradients: one allreduce, in flight while P is computed.
  torch::Tensor flat;
  FuturePtr flat_done;
  if (!uncompressed.empty()) {
    std::vector<torch::Tensor> parts;
    for (const auto& g : uncompressed) parts.push_back(g.reshape(-1));
    flat = torch::cat(parts);
    flat_done = wire.allreduce_mean(flat);
  }

  torch::Tensor p, q;
  if (!matrices.empty()) {
    std::tie(p, q) = memories(st, opt.warm_start(), seed, b, p_size, q_size, input.options());
    power_iteration(matrices, ranks, results, p, q, wire, opt.orthogonalization_epsilon());
  }

  if (flat_done) {
    flat_done->waitAndThrow();
    int64_t at = 0;
    for (auto& g : destinations) {
      g.copy_(flat.slice(0, at, at + g.numel()).view_as(g));
      at += g.numel();
    }
  }
  if (end_step(st, opt.warm_start(), b, {p, q, flat}, error) && opt.use_error_feedback()) error.sub_(input);
  elements_before_ += input.numel();
  elements_after_ += p_size + q_size + (flat.defined() ? flat.numel() : 0);
}

void BatchedPowerSgdHook::compress(const GradBucket& bucket, Wire& wire) {
  PowerSgdState& st = state_;
  const std::function<uint64_t()> seed = [this] { return next_seed(); };
  const PowerSgdOptions& opt = options_;
  const torch::Tensor& input = bucket.buffer();
  const size_t b = bucket.index();
  const int64_t total = input.numel();
  auto side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  while (side * side < total) ++side;
  while (side > 1 && (side - 1) * (side - 1) >= total) --side;
  const int64_t r = std::min<int64_t>(opt.matrix_approximation_rank(), side);

  // M: the bucket zero-padded to side x side, plus the carried error.
  torch::Tensor padded, error;
  if (opt.use_error_feedback()) {
    error = carried_error(st, b, input.new_empty({side * side}));
    error.slice(0, 0, total).add_(input);
    padded = error;
  } else {
    padded = torch::zeros({side * side}, input.options());
    padded.slice(0, 0, total).copy_(input);
  }
  torch::Tensor result = torch::empty({side, side}, input.options());
  auto [p, q] = memories(st, opt.warm_start(), seed, b, side * r, side * r, input.options());
  elements_before_ += total;
  elements_after_ += 2 * side * r;
  power_iteration({padded.view({side, side})}, {r}, {result}, p, q, wire, opt.orthogonalization_epsilon());
  result = result.view(-1);
  if (end_step(st, opt.warm_start(), b, {p, q}, error) && opt.use_error_feedback()) error.sub_(result);
  input.copy_(result.slice(0, 0, total));
}

}  // namespace mnist_ddp::hooks
