#include "mnist_ddp/parallel/sync_batch_norm.hpp"

#include <torch/torch.h>
#include "parallel/norm.hpp"

#include <ATen/Parallel.h>

#include <algorithm>

#include "mnist_ddp/base/errors.hpp"
#include "comm/group.hpp"
#include "parallel/advice.hpp"

namespace mnist_ddp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<int64_t> non_channel_dims(const torch::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// [C] -> [1, C, 1, ...], to broadcast over an input of x's rank.
torch::Tensor per_channel(const torch::Tensor& v, const torch::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = v.size(0);
  return v.view(shape);
}

struct GlobalStats {
  torch::Tensor mean;    // [C], biased over all ranks' elements
  torch::Tensor invstd;  // [C], 1 / sqrt(var + eps)
  torch::Tensor var;     // [C], biased
  double count;          // elements per channel over all ranks
};

// This rank's per-channel mean and centred sum of squares (M2), in float64,
// and its element count per channel.
struct LocalStats {
  torch::Tensor mean, m2;  // [C]
  double count = 0;
};

LocalStats local_stats(const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  const int64_t c = x.size(1);
  const double n = c ? static_cast<double>(x.numel() / c) : 0.0;
  if (n == 0) return {torch::zeros({c}, torch::kFloat64), torch::zeros({c}, torch::kFloat64), 0};
  const auto dims = non_channel_dims(x);
  const auto mean = x.sum(dims).div_(n);
  const auto m2 = x.sub(per_channel(mean, x)).square_().sum(dims);
  return {mean.to(torch::kFloat64), m2.to(torch::kFloat64), n};
}

// One allreduce of [sum | sum of squares | count], in float64. Each rank
// forms its sum of squares as M2 + n * mean^2 from its own mean and centred
// M2, so the subtraction var = E[x^2] - mean^2 happens in float64 over
// quantities that are exact to float32 precision: no catastrophic
// cancellation, even for inputs whose mean dwarfs their spread. Statistics
// are constants to autograd (the backward functions account for them), so
// nothing here is recorded.
GlobalStats global_stats(const LocalStats& local, c10::ScalarType type, CollectiveStream& stream, double eps,
                         const Issuer& issuer) {
  torch::NoGradGuard no_grad;
  const int64_t c = local.mean.size(0);
  auto stats = torch::zeros({2 * c + 1}, local.mean.options());
  stats.slice(0, 0, c).copy_(local.mean * local.count);
  stats.slice(0, c, 2 * c).copy_(local.m2 + local.mean * local.mean * local.count);
  stats[2 * c].fill_(local.count);
  stream.allreduce_sum(stats, issuer);
  const double count = stats[2 * c].item<double>();
  if (!(count > 0)) throw UsageError(issuer.text + ": the batch is empty on every rank");
  // Divided by the count as a tensor: CUDA turns a division by a host scalar
  // into a multiplication by its reciprocal, which the CPU does not.
  const auto counts = stats.slice(0, 2 * c, 2 * c + 1);
  const auto mean = stats.slice(0, 0, c) / counts;
  const auto var = (stats.slice(0, c, 2 * c) / counts - mean * mean).clamp_min_(0);
  return {mean.to(type), (var + eps).rsqrt().to(type), var, count};
}

// ---- The CPU kernels of SyncBatchNorm followed by ReLU, for a contiguous
// float32 NCHW input (Net's): three passes over the activations forward and
// two backward, where the general path makes some fifteen. Every channel's
// sums are taken by one thread in one fixed order (16 lanes, then the lanes
// in order), so the results never depend on the thread count.

bool fused_kernels_apply(const torch::Tensor& x) {
  return x.is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 4 && x.is_contiguous();
}

// Sums f(p[i]) over a plane of n values in 16 float lanes.
template <typename F>
double plane_sum(const float* p, int64_t n, F f) {
  float lane[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lane[j] += f(p[i + j]);
  double sum = 0;
  for (float v : lane) sum += v;
  for (; i < n; ++i) sum += f(p[i]);
  return sum;
}

LocalStats fused_local_stats(const torch::Tensor& x) {
  const int64_t batch = x.size(0), c = x.size(1), plane = x.size(2) * x.size(3);
  auto mean = torch::zeros({c}, torch::kFloat64), m2 = torch::zeros({c}, torch::kFloat64);
  const double n = static_cast<double>(batch * plane);
  if (n == 0) return {mean, m2, 0};
  const float* in = x.data_ptr<float>();
  double* means = mean.data_ptr<double>();
  double* m2s = m2.data_ptr<double>();
  at::parallel_for(0, c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ch = begin; ch < end; ++ch) {
      double sum = 0;
      for (int64_t b = 0; b < batch; ++b) sum += plane_sum(in + (b * c + ch) * plane, plane, [](float v) { return v; });
      const auto mu = static_cast<float>(sum / n);
      double dev = 0;
      for (int64_t b = 0; b < batch; ++b)
        dev += plane_sum(in + (b * c + ch) * plane, plane, [mu](float v) { return (v - mu) * (v - mu); });
      means[ch] = mu;
      m2s[ch] = dev;
    }
  });
  return {mean, m2, n};
}

// Calls f(channel, offset of the plane) for every (sample, channel) plane of x.
template <typename F>
void for_each_plane(const torch::Tensor& x, F f) {
  const int64_t c = x.size(1), plane = x.size(2) * x.size(3);
  at::parallel_for(0, x.size(0) * c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(i % c, i * plane, plane);
  });
}

// Carries the stream through autograd's saved data, which holds
// intrusive pointers only.
struct StreamHolder : torch::CustomClassHolder {
  StreamHolder(std::shared_ptr<CollectiveStream> c, Issuer i) : stream(std::move(c)), issuer(std::move(i)) {}
  std::shared_ptr<CollectiveStream> stream;
  Issuer issuer;  // "SyncBatchNorm bn1's backward"
};

// Who a layer's collectives say issues them.
Issuer layer_issuer(SyncBatchNormImpl& bn, IssuerKind kind) {
  const std::string& name = bn.layer_name();
  const char* pass = kind == kSyncBnBackward ? "backward" : kind == kSyncBnForward ? "forward" : "forward without autograd";
  return Issuer(kind, 0, -1, "SyncBatchNorm " + (name.empty() ? std::string("(a layer no DDP wraps)") : name) + "'s " + pass);
}

// Normalises with given global statistics; backward completes the chain
// rule through those statistics with one more allreduce.
class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, const torch::Tensor& weight,
                               const torch::Tensor& bias, const torch::Tensor& mean, const torch::Tensor& invstd,
                               double count, std::shared_ptr<CollectiveStream> stream, Issuer issuer) {
    // Separate mul and add: on CPU a broadcast addcmul is several times slower.
    const auto x_hat = input.sub(per_channel(mean, input)).mul_(per_channel(invstd, input));
    const auto y = x_hat.mul(per_channel(weight, input)).add_(per_channel(bias, input));
    ctx->save_for_backward({x_hat, weight, invstd});
    ctx->saved_data["count"] = count;
    ctx->saved_data["stream"] =
        c10::IValue::make_capsule(c10::make_intrusive<StreamHolder>(std::move(stream), std::move(issuer)));
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& x_hat = saved[0];
    const auto& weight = saved[1];
    const auto& invstd = saved[2];
    const double count = ctx->saved_data["count"].toDouble();
    auto holder = c10::static_intrusive_pointer_cast<StreamHolder>(ctx->saved_data["stream"].toCapsule());
    const auto dy = grad_outputs[0];
    const int64_t c = x_hat.size(1);

    const auto dims = non_channel_dims(x_hat);
    const auto sum_dy = dy.sum(dims);
    const auto sum_dy_xhat = (dy * x_hat).sum(dims);
    auto sums = torch::cat({sum_dy, sum_dy_xhat}).to(torch::kFloat64);
    holder->stream->allreduce_sum(sums, holder->issuer);
    const auto mean_dy = (sums.slice(0, 0, c) / count).to(dy.scalar_type());
    const auto mean_dy_xhat = (sums.slice(0, c, 2 * c) / count).to(dy.scalar_type());

    // dx = weight * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), means over all ranks.
    const auto a = weight * invstd;
    const auto dx = dy.mul(per_channel(a, dy))
                        .add_(x_hat.mul(per_channel(-a * mean_dy_xhat, dy)))
                        .add_(per_channel(-a * mean_dy, dy));
    // This rank's sums over its own batch; DDP averages them over ranks.
    return {dx, sum_dy_xhat, sum_dy, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

// SyncBatchNormFunction followed by ReLU, through the CPU kernels above.
// Saves the input and the output (ReLU's mask), not x_hat: backward
// recomputes x_hat in the pass that needs it.
// This rank's sums of dz (dy where ReLU passed) and of dz * x_hat, in one
// pass, each channel in one fixed order: [dz (C) | dz * x_hat (C)], float64.
torch::Tensor relu_backward_sums(const torch::Tensor& input, const torch::Tensor& y, const torch::Tensor& dy,
                                 const torch::Tensor& mean, const torch::Tensor& invstd) {
  const int64_t batch = input.size(0), c = input.size(1), plane = input.size(2) * input.size(3);
  const float *in = input.data_ptr<float>(), *out = y.data_ptr<float>(), *g = dy.data_ptr<float>(),
              *mu = mean.data_ptr<float>(), *is = invstd.data_ptr<float>();
  auto sums = torch::zeros({2 * c}, torch::kFloat64);
  double* sum = sums.data_ptr<double>();
  at::parallel_for(0, c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ch = begin; ch < end; ++ch) {
      const float m = mu[ch], s = is[ch];
      float lane_dz[16] = {}, lane_dzx[16] = {};
      double dz = 0, dzx = 0;
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t at = (b * c + ch) * plane;
        int64_t i = 0;
        for (; i + 16 <= plane; i += 16)
          for (int j = 0; j < 16; ++j) {
            const float gj = g[at + i + j];  // loaded unconditionally: a select, which vectorises
            const float d = out[at + i + j] > 0 ? gj : 0.0f;
            lane_dz[j] += d;
            lane_dzx[j] += d * ((in[at + i + j] - m) * s);
          }
        for (; i < plane; ++i) {
          const float gi = g[at + i];
          const float d = out[at + i] > 0 ? gi : 0.0f;
          dz += d;
          dzx += d * ((in[at + i] - m) * s);
        }
      }
      for (int j = 0; j < 16; ++j) {
        dz += lane_dz[j];
        dzx += lane_dzx[j];
      }
      sum[ch] = dz;
      sum[c + ch] = dzx;
    }
  });
  return sums;
}

class SyncBatchNormReluFunction : public torch::autograd::Function<SyncBatchNormReluFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, const torch::Tensor& weight,
                               const torch::Tensor& bias, const torch::Tensor& mean, const torch::Tensor& invstd,
                               double count, std::shared_ptr<CollectiveStream> stream, Issuer issuer) {
    auto y = torch::empty_like(input);
    const auto w = weight.contiguous(), b = bias.contiguous();
    const float *in = input.data_ptr<float>(), *mu = mean.data_ptr<float>(), *is = invstd.data_ptr<float>(),
                *ws = w.data_ptr<float>(), *bs = b.data_ptr<float>();
    float* out = y.data_ptr<float>();
    for_each_plane(input, [&](int64_t ch, int64_t at, int64_t n) {
      const float m = mu[ch], s = is[ch], g = ws[ch], h = bs[ch];
      for (int64_t i = at; i < at + n; ++i) out[i] = std::max((in[i] - m) * s * g + h, 0.0f);
    });
    ctx->save_for_backward({input, y, weight, mean, invstd});
    ctx->saved_data["count"] = count;
    ctx->saved_data["stream"] =
        c10::IValue::make_capsule(c10::make_intrusive<StreamHolder>(std::move(stream), std::move(issuer)));
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &input = saved[0], &y = saved[1], &weight = saved[2], &mean = saved[3], &invstd = saved[4];
    const double count = ctx->saved_data["count"].toDouble();
    auto holder = c10::static_intrusive_pointer_cast<StreamHolder>(ctx->saved_data["stream"].toCapsule());
    const auto dy = grad_outputs[0].contiguous();
    const int64_t c = input.size(1);
    const float *in = input.data_ptr<float>(), *out = y.data_ptr<float>(), *g = dy.data_ptr<float>(),
                *mu = mean.data_ptr<float>(), *is = invstd.data_ptr<float>();
    auto sums = relu_backward_sums(input, y, dy, mean, invstd);
    const auto local = sums.to(torch::kFloat);  // this rank's bias and weight gradients; DDP averages them
    holder->stream->allreduce_sum(sums, holder->issuer);
    const auto mean_dz = (sums.slice(0, 0, c) / count).to(torch::kFloat);
    const auto mean_dzx = (sums.slice(0, c, 2 * c) / count).to(torch::kFloat);

    // dx = weight * invstd * (dz - mean(dz) - x_hat * mean(dz * x_hat)), means over all ranks.
    const auto a = (weight * invstd).contiguous();
    const auto ax = (-a * mean_dzx).contiguous(), a0 = (-a * mean_dz).contiguous();
    const float *as = a.data_ptr<float>(), *axs = ax.data_ptr<float>(), *a0s = a0.data_ptr<float>();
    auto dx = torch::empty_like(input);
    float* d = dx.data_ptr<float>();
    for_each_plane(input, [&](int64_t ch, int64_t at, int64_t n) {
      const float m = mu[ch], s = is[ch], k = as[ch], kx = axs[ch], k0 = a0s[ch];
      for (int64_t i = at; i < at + n; ++i) {
        const float gi = g[i];
        d[i] = (out[i] > 0 ? gi : 0.0f) * k + ((in[i] - m) * s) * kx + k0;
      }
    });
    return {dx, local.slice(0, c, 2 * c), local.slice(0, 0, c), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

// Counts a training batch; returns the running statistics' update factor
// (the momentum, or 1 / batches for a cumulative average).
double count_batch(SyncBatchNormImpl& bn) {
  if (!bn.options.track_running_stats()) return 0.0;
  bn.num_batches_tracked.add_(1);
  return bn.options.momentum() ? *bn.options.momentum() : 1.0 / bn.num_batches_tracked.item<double>();
}

// The layer's weight and bias, or ones and zeros where it has none (not affine).
std::pair<torch::Tensor, torch::Tensor> affine_of(const SyncBatchNormImpl& bn, const torch::Tensor& input) {
  if (bn.options.affine()) return {bn.weight, bn.bias};
  const auto options = input.options().requires_grad(false);
  return {torch::ones({bn.options.num_features()}, options), torch::zeros({bn.options.num_features()}, options)};
}

// A training forward over every rank's batch, from this rank's statistics:
// updates the running statistics and normalises (then ReLU, when `relu`).
torch::Tensor train_synced(SyncBatchNormImpl& bn, std::shared_ptr<CollectiveStream> stream, const torch::Tensor& input,
                           const LocalStats& local, bool relu) {
  const double factor = count_batch(bn);
  const GlobalStats stats =
      global_stats(local, input.scalar_type(), *stream, bn.options.eps(),
                   layer_issuer(bn, torch::GradMode::is_enabled() ? kSyncBnForward : kSyncBnSampling));
  if (bn.options.track_running_stats()) {
    // Separate multiplies and adds, no fused forms: exact (see the header).
    torch::NoGradGuard no_grad;
    const double unbiased = stats.count > 1 ? stats.count / (stats.count - 1) : 1.0;
    bn.running_mean.mul_(1 - factor).add_(stats.mean.to(bn.running_mean.scalar_type()).mul(factor));
    bn.running_var.mul_(1 - factor).add_((stats.var * unbiased).to(bn.running_var.scalar_type()).mul(factor));
  }
  const auto [weight, bias] = affine_of(bn, input);
  Issuer backward = layer_issuer(bn, kSyncBnBackward);
  if (relu)
    return SyncBatchNormReluFunction::apply(input, weight, bias, stats.mean, stats.invstd, stats.count, std::move(stream),
                                            std::move(backward));
  return SyncBatchNormFunction::apply(input, weight, bias, stats.mean, stats.invstd, stats.count, std::move(stream),
                                      std::move(backward));
}

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_) : options(options_) {
  use_library_advice();
  reset();
}

void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = torch::ones({c});
    bias = torch::zeros({c});
  }
  if (options.track_running_stats()) {
    running_mean = torch::zeros({c});
    running_var = torch::ones({c});
    num_batches_tracked = torch::zeros({}, torch::kLong);
  }
  register_state();
}

void SyncBatchNormImpl::register_state() {
  if (options.affine()) {
    weight = register_parameter("weight", weight);
    bias = register_parameter("bias", bias);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", running_mean);
    running_var = register_buffer("running_var", running_var);
    num_batches_tracked = register_buffer("num_batches_tracked", num_batches_tracked);
  }
}

namespace {

// The stream a forward of `bn` syncs over; nullptr: none (one process).
std::shared_ptr<CollectiveStream> active_stream(const SyncBatchNormImpl& bn) {
  std::optional<ProcessGroup> group = bn.process_group();
  if (!group) group = default_process_group();
  if (!group || group->world_size() == 1) return nullptr;
  return quick_stream(*group);
}

void check_channels(const SyncBatchNormImpl& bn, const torch::Tensor& input) {
  const int64_t c = bn.options.num_features();
  if (input.dim() < 2 || input.dim() > 5 || input.size(1) != c)
    throw UsageError("SyncBatchNorm: expected " + std::to_string(c) +
                     " channels in dimension 1 of a 2- to 5-dimensional input, got input of shape " +
                     c10::str(input.sizes()));
}

}  // namespace

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  check_channels(*this, input);
  if (is_training())
    if (auto s = active_stream(*this)) return train_synced(*this, std::move(s), input, local_stats(input), false);
  // One process, or eval: BatchNorm's own computation. Without running
  // statistics, eval normalises with the batch's own, as BatchNorm does.
  const double factor = is_training() ? count_batch(*this) : 0.0;
  const bool batch_stats = is_training() || !options.track_running_stats();
  return torch::batch_norm(input, weight, bias, running_mean, running_var, batch_stats, factor, options.eps(),
                           /*cudnn_enabled=*/true);
}

torch::Tensor sync_batch_norm_relu(SyncBatchNormImpl& bn, const torch::Tensor& input) {
  check_channels(bn, input);
  if (bn.is_training() && bn.options.affine() && fused_kernels_apply(input))
    if (auto s = active_stream(bn)) return train_synced(bn, std::move(s), input, fused_local_stats(input), true);
  return torch::relu(bn.forward(input));
}

torch::Tensor batch_norm_relu(torch::nn::Module& layer, const torch::Tensor& input) {
  if (auto* sync = dynamic_cast<SyncBatchNormImpl*>(&layer)) return sync_batch_norm_relu(*sync, input);
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm1dImpl*>(&layer)) return torch::relu(bn->forward(input));
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm2dImpl*>(&layer)) return torch::relu(bn->forward(input));
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm3dImpl*>(&layer)) return torch::relu(bn->forward(input));
  throw UsageError("batch_norm_relu: " + layer.name() + " is neither a BatchNorm nor a SyncBatchNorm");
}

}  // namespace mnist_ddp
