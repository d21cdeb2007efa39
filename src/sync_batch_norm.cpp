#include "mnist_ddp/sync_batch_norm.hpp"

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

// One allreduce of [sum | sum of squares | count], in float64. Each rank
// forms its sum of squares as M2 + n * mean^2 from its own mean and centred
// M2, so the subtraction var = E[x^2] - mean^2 happens in float64 over
// quantities that are exact to float32 precision: no catastrophic
// cancellation, even for inputs whose mean dwarfs their spread. Statistics
// are constants to autograd (SyncBatchNormFunction's backward accounts for
// them), so nothing here is recorded.
GlobalStats global_stats(const torch::Tensor& x, Collectives& comm, double eps) {
  torch::NoGradGuard no_grad;
  const int64_t c = x.size(1);
  const double n = c ? static_cast<double>(x.numel() / c) : 0.0;
  auto stats = torch::zeros({2 * c + 1}, x.options().dtype(torch::kFloat64));
  if (n > 0) {
    const auto dims = non_channel_dims(x);
    const auto mean = x.sum(dims).div_(n);
    const auto m2 = x.sub(per_channel(mean, x)).square_().sum(dims);
    const auto m = mean.to(torch::kFloat64);
    stats.slice(0, 0, c).copy_(m * n);
    stats.slice(0, c, 2 * c).copy_(m2.to(torch::kFloat64) + m * m * n);
  }
  stats[2 * c].fill_(n);
  comm.allreduce_sum(stats);
  const double count = stats[2 * c].item<double>();
  TORCH_CHECK(count > 0, "SyncBatchNorm: the batch is empty on every rank");
  // Divided by the count as a tensor: CUDA turns a division by a host scalar
  // into a multiplication by its reciprocal, which the CPU does not.
  const auto counts = stats.slice(0, 2 * c, 2 * c + 1);
  const auto mean = stats.slice(0, 0, c) / counts;
  const auto var = (stats.slice(0, c, 2 * c) / counts - mean * mean).clamp_min_(0);
  return {mean.to(x.scalar_type()), (var + eps).rsqrt().to(x.scalar_type()), var, count};
}

// Carries the stream through autograd's saved data, which holds
// intrusive pointers only.
struct CommHolder : torch::CustomClassHolder {
  explicit CommHolder(std::shared_ptr<Collectives> c) : comm(std::move(c)) {}
  std::shared_ptr<Collectives> comm;
};

// Normalises with given global statistics; backward completes the chain
// rule through those statistics with one more allreduce.
class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, const torch::Tensor& weight,
                               const torch::Tensor& bias, const torch::Tensor& mean, const torch::Tensor& invstd,
                               double count, std::shared_ptr<Collectives> comm) {
    // Separate mul and add: on CPU a broadcast addcmul is several times slower.
    const auto x_hat = input.sub(per_channel(mean, input)).mul_(per_channel(invstd, input));
    const auto y = x_hat.mul(per_channel(weight, input)).add_(per_channel(bias, input));
    ctx->save_for_backward({x_hat, weight, invstd});
    ctx->saved_data["count"] = count;
    ctx->saved_data["comm"] = c10::IValue::make_capsule(c10::make_intrusive<CommHolder>(std::move(comm)));
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& x_hat = saved[0];
    const auto& weight = saved[1];
    const auto& invstd = saved[2];
    const double count = ctx->saved_data["count"].toDouble();
    auto holder = c10::static_intrusive_pointer_cast<CommHolder>(ctx->saved_data["comm"].toCapsule());
    const auto dy = grad_outputs[0];
    const int64_t c = x_hat.size(1);

    const auto dims = non_channel_dims(x_hat);
    const auto sum_dy = dy.sum(dims);
    const auto sum_dy_xhat = (dy * x_hat).sum(dims);
    auto sums = torch::cat({sum_dy, sum_dy_xhat}).to(torch::kFloat64);
    holder->comm->allreduce_sum(sums);
    const auto mean_dy = (sums.slice(0, 0, c) / count).to(dy.scalar_type());
    const auto mean_dy_xhat = (sums.slice(0, c, 2 * c) / count).to(dy.scalar_type());

    // dx = weight * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), means over all ranks.
    const auto a = weight * invstd;
    const auto dx = dy.mul(per_channel(a, dy))
                        .add_(x_hat.mul(per_channel(-a * mean_dy_xhat, dy)))
                        .add_(per_channel(-a * mean_dy, dy));
    // This rank's sums over its own batch; DDP averages them over ranks.
    return {dx, sum_dy_xhat, sum_dy, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_, std::shared_ptr<Collectives> comm_)
    : options(options_), comm(std::move(comm_)) {
  reset();
}

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNorm2dImpl& bn, std::shared_ptr<Collectives> comm_)
    : options(bn.options), comm(std::move(comm_)) {
  weight = bn.weight;
  bias = bn.bias;
  running_mean = bn.running_mean;
  running_var = bn.running_var;
  num_batches_tracked = bn.num_batches_tracked;
  register_state();
}

void SyncBatchNormImpl::reset() {
  TORCH_CHECK(options.affine() && options.track_running_stats(),
              "SyncBatchNorm supports affine layers with running statistics only");
  const int64_t c = options.num_features();
  weight = torch::ones({c});
  bias = torch::zeros({c});
  running_mean = torch::zeros({c});
  running_var = torch::ones({c});
  num_batches_tracked = torch::zeros({}, torch::kLong);
  register_state();
}

void SyncBatchNormImpl::register_state() {
  weight = register_parameter("weight", weight);
  bias = register_parameter("bias", bias);
  running_mean = register_buffer("running_mean", running_mean);
  running_var = register_buffer("running_var", running_var);
  num_batches_tracked = register_buffer("num_batches_tracked", num_batches_tracked);
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2 && input.size(1) == options.num_features(), "SyncBatchNorm: expected ",
              options.num_features(), " channels in dimension 1, got input of shape ", input.sizes());
  double factor = 0.0;
  if (is_training()) {
    num_batches_tracked.add_(1);
    factor = options.momentum() ? *options.momentum() : 1.0 / num_batches_tracked.item<double>();
  }
  if (!is_training() || !comm || comm->world_size() == 1) {
    return torch::batch_norm(input, weight, bias, running_mean, running_var, is_training(), factor, options.eps(),
                             /*cudnn_enabled=*/true);
  }
  const GlobalStats stats = global_stats(input, *comm, options.eps());
  {
    // Separate multiplies and adds, no fused forms: exact (see the header).
    torch::NoGradGuard no_grad;
    const double unbiased = stats.count > 1 ? stats.count / (stats.count - 1) : 1.0;
    running_mean.mul_(1 - factor).add_(stats.mean.to(running_mean.scalar_type()).mul(factor));
    running_var.mul_(1 - factor).add_((stats.var * unbiased).to(running_var.scalar_type()).mul(factor));
  }
  return SyncBatchNormFunction::apply(input, weight, bias, stats.mean, stats.invstd, stats.count, comm);
}

void convert_sync_batchnorm(torch::nn::Module& module, const std::shared_ptr<Collectives>& comm) {
  for (const auto& child : module.named_children()) {
    if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(child.value())) {
      auto sync = std::make_shared<SyncBatchNormImpl>(*bn, comm);
      sync->train(bn->is_training());
      module.replace_module(child.key(), sync);
    } else {
      convert_sync_batchnorm(*child.value(), comm);
    }
  }
}

torch::Tensor forward_batch_norm(torch::nn::Module& layer, const torch::Tensor& input) {
  if (auto* sync = dynamic_cast<SyncBatchNormImpl*>(&layer)) return sync->forward(input);
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm2dImpl*>(&layer)) return bn->forward(input);
  TORCH_CHECK(false, "forward_batch_norm: ", layer.name(), " is neither BatchNorm2d nor SyncBatchNorm");
}

}  // namespace mnist_ddp
