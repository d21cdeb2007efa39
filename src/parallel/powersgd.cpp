// PowerSGD's hooks (comm_hooks.hpp): the plain and the batched, their
// options, state and power iteration.
#include "mnist_ddp/parallel/comm_hooks.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <sstream>
#include <tuple>

#include "base/require.hpp"
#include "parallel/exact_math.hpp"

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

// Note on error feedback: each rank compresses M = its gradient + the error
// it carries, and keeps as its new error M minus what all ranks agreed on.
// The errors then sum to zero over ranks wherever nothing was lost, and the
// sum of applied updates plus the mean error equals the sum of the true
// averaged gradients. M is built in the error's own buffer (error += g, and
// later error -= result), which saves PyTorch's copy of the bucket.

FuturePtr PowerSgdBase::run(const GradBucket& bucket, Wire& wire) {
  FuturePtr result;
  if (compression_started()) {
    state_.layout[bucket.index()] = bucket.parameter_names();
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
  if (options.start_powersgd_iter() <= 1 && (options.use_error_feedback() || options.warm_start()))
    refuse("start_powersgd_iter " + std::to_string(options.start_powersgd_iter()) +
           " with error feedback or warm start: must be at least 2, as PyTorch's PowerSGDState requires (the state "
           "is kept by bucket, and the first step's buckets may be rebuilt); or turn both off");
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

namespace {

// A bucket's parameter names as a tensor the state can carry: "a\nb".
torch::Tensor names_tensor(const std::vector<std::string>& names) {
  std::string joined;
  for (const auto& n : names) joined += (joined.empty() ? "" : "\n") + n;
  auto t = torch::empty({static_cast<int64_t>(joined.size())}, torch::kUInt8);
  std::copy(joined.begin(), joined.end(), static_cast<char*>(t.data_ptr()));
  return t;
}

std::vector<std::string> names_of(const torch::Tensor& t) {
  const auto bytes = t.to(torch::kCPU).contiguous();
  const std::string joined(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
  std::vector<std::string> names;
  size_t at = 0;
  for (size_t next; (next = joined.find('\n', at)) != std::string::npos; at = next + 1) names.push_back(joined.substr(at, next - at));
  if (!joined.empty()) names.push_back(joined.substr(at));
  return names;
}

}  // namespace

std::vector<std::vector<std::string>> PowerSgdBase::kept_for() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& [b, names] : state_.layout) {
    if (out.size() <= b) out.resize(b + 1);
    out[b] = names;
  }
  return out;
}

HookState PowerSgdBase::state() const {
  HookState s;
  for (const auto& [b, names] : state_.layout) s.shared["layout/" + std::to_string(b)] = names_tensor(names);
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
    MNIST_DDP_REQUIRE(key == "iter" || key == "draws" || key.rfind("p/", 0) == 0 || key.rfind("q/", 0) == 0 ||
                          key.rfind("layout/", 0) == 0,
                "PowerSGD state: '", key, "' is not PowerSGD's");
  for (const auto& [key, t] : s.own) MNIST_DDP_REQUIRE(key.rfind("error/", 0) == 0, "PowerSGD state: '", key, "' is not PowerSGD's");
  PowerSgdState loaded;
  loaded.iter = s.shared.at("iter").item<int64_t>();
  loaded.draws = static_cast<uint64_t>(s.shared.at("draws").item<int64_t>());
  by_bucket(s.shared, "p", loaded.p_memory);
  by_bucket(s.shared, "q", loaded.q_memory);
  by_bucket(s.own, "error", loaded.error);
  std::map<size_t, torch::Tensor> layout;
  by_bucket(s.shared, "layout", layout);
  for (const auto& [b, t] : layout) loaded.layout[b] = names_of(t);
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

namespace {

// A bucket's gradients, those PowerSGD compresses (where P and Q are worth
// it: (n + m) r min_compression_rate < n m) and those it sends as they are.
struct Split {
  std::vector<torch::Tensor> matrices, results;  // M_i [n, m] (what to compress), and where its result goes
  std::vector<int64_t> ranks;                    // r_i
  std::vector<torch::Tensor> uncompressed, destinations;
  int64_t p_size = 0, q_size = 0;
};

Split split_bucket(const GradBucket& bucket, const std::vector<torch::Tensor>& sources, const PowerSgdOptions& opt) {
  Split split;
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& g = bucket.gradients()[i];
    const int64_t n = g.dim() ? g.size(0) : 1;
    const int64_t m = g.numel() / n;
    const int64_t r = std::min<int64_t>({n, m, opt.matrix_approximation_rank()});
    if (static_cast<double>((n + m) * r) * opt.min_compression_rate() < static_cast<double>(n * m)) {
      split.matrices.push_back(sources[i].reshape({n, m}));
      split.results.push_back(g.reshape({n, m}));
      split.ranks.push_back(r);
      split.p_size += n * r;
      split.q_size += m * r;
    } else {
      split.uncompressed.push_back(sources[i]);
      split.destinations.push_back(g);
    }
  }
  return split;
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

  const Split split = split_bucket(bucket, sources, opt);
  const auto& [matrices, results, ranks, uncompressed, destinations, p_size, q_size] = split;

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
