#include <gtest/gtest.h>

#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "mnist_ddp/parallel/distributed.hpp"
#include "app/train/model.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::max_abs_diff;

using test::run_ranks;

// No BatchNorm and no dropout: per-rank batches give the same gradients as
// one batch, so one process on the concatenated batch is the oracle.
struct SmallNetImpl : torch::nn::Module {
  SmallNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    fc = register_module("fc", torch::nn::Linear(144, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::log_softmax(fc(torch::relu(conv(x)).flatten(1)), 1); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SmallNet);

TEST(BucketAssignment, ClosesABucketOnceItReachesItsCap) {
  using Buckets = std::vector<std::vector<size_t>>;
  EXPECT_EQ(compute_bucket_assignment({10, 10, 10}, 15, 100), (Buckets{{0, 1}, {2}}));
  EXPECT_EQ(compute_bucket_assignment({10, 10, 10}, 5, 10), (Buckets{{0}, {1}, {2}}));
  EXPECT_EQ(compute_bucket_assignment({1, 2, 3}, 100, 100), (Buckets{{0, 1, 2}}));
  EXPECT_EQ(compute_bucket_assignment({}, 1, 1), Buckets{});
}

TEST(BucketAssignment, NetLaysOutAsPyTorchDoes) {
  Net net;
  std::vector<int64_t> sizes;
  const auto params = net->parameters();
  for (auto it = params.rbegin(); it != params.rend(); ++it) sizes.push_back(it->numel() * 4);
  const auto buckets = compute_bucket_assignment(sizes, 1024 * 1024, 25 * 1024 * 1024);
  // fc2.bias, fc2.weight, fc1.bias, fc1.weight fill the 1 MB first bucket; the rest share the second.
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_EQ(buckets[1].size(), 8u);
}

struct Batches {
  torch::Tensor x, y;
};

Batches make_batches(int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({n, 1, 8, 8}), torch::randint(0, 10, {n}, torch::kInt64)};
}

// Models built serially: threads share LibTorch's default generator.
std::vector<SmallNet> models_with_seeds(int count, uint64_t first_seed) {
  std::vector<SmallNet> models;
  for (int r = 0; r < count; ++r) {
    torch::manual_seed(first_seed + r);
    models.emplace_back();
  }
  return models;
}

TEST(Ddp, AveragedGradientsEqualOneProcessOnTheConcatenatedBatch) {
  const int64_t per_rank = 4;
  for (test::Sums sums : {test::Sums::gloo, test::Sums::shared_memory}) {
    for (int world : {2, 3}) {
      for (double cap_mb : {25.0, 0.001}) {  // two buckets, then one bucket per parameter
        const Batches data = make_batches(world * per_rank, 1);
        auto oracle = models_with_seeds(1, 100).front();  // the same init as rank 0
        torch::nll_loss(oracle->forward(data.x), data.y).backward();

        auto models = models_with_seeds(world, 100);  // every rank starts elsewhere
        std::vector<std::vector<torch::Tensor>> grads(world), params(world);
        run_ranks(world, [&](ProcessGroup& group) {
          DistributedDataParallel ddp(models[group.rank()], group, DdpOptions().bucket_cap_mb(cap_mb));
          const int64_t begin = group.rank() * per_rank;
          auto out = ddp.forward(data.x.slice(0, begin, begin + per_rank));
          torch::nll_loss(out, data.y.slice(0, begin, begin + per_rank)).backward();
          for (const auto& p : ddp->parameters()) {
            grads[group.rank()].push_back(p.grad().clone());
            params[group.rank()].push_back(p.detach().clone());
          }
        }, torch::kCPU, sums);
        const auto expected = oracle->parameters();
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(grads[r].size(), expected.size());
          for (size_t i = 0; i < expected.size(); ++i) {
            EXPECT_TRUE(torch::equal(params[r][i], expected[i])) << "rank " << r << " did not start from rank 0's state";
            EXPECT_LE(max_abs_diff(grads[r][i], expected[i].grad()), 1e-5)
                << (sums == test::Sums::gloo ? "gloo" : "shared memory") << ", world " << world << " cap " << cap_mb
                << " rank " << r << " parameter " << i;
          }
        }
      }
    }
  }
}

TEST(Ddp, ReplicasStayIdenticalAndTrackTheOracleOverSteps) {
  const int world = 3, per_rank = 4, steps = 6;
  auto oracle = models_with_seeds(1, 7).front();
  torch::optim::SGD oracle_opt(oracle->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(5e-4));
  std::vector<Batches> data;
  for (int s = 0; s < steps; ++s) data.push_back(make_batches(world * per_rank, 50 + s));
  for (const auto& d : data) {
    oracle_opt.zero_grad();
    torch::nll_loss(oracle->forward(d.x), d.y).backward();
    oracle_opt.step();
  }

  auto models = models_with_seeds(world, 7);
  std::vector<std::vector<torch::Tensor>> final_params(world);
  run_ranks(world, [&](ProcessGroup& group) {
    DistributedDataParallel ddp(models[group.rank()], group, DdpOptions().bucket_cap_mb(0.001));
    torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(5e-4));
    for (const auto& d : data) {
      opt.zero_grad();
      const int64_t begin = group.rank() * per_rank;
      torch::nll_loss(ddp.forward(d.x.slice(0, begin, begin + per_rank)), d.y.slice(0, begin, begin + per_rank))
          .backward();
      opt.step();
    }
    for (const auto& p : ddp->parameters()) final_params[group.rank()].push_back(p.detach().clone());
  });
  const auto expected = oracle->parameters();
  for (size_t i = 0; i < expected.size(); ++i) {
    for (int r = 1; r < world; ++r) EXPECT_TRUE(torch::equal(final_params[r][i], final_params[0][i]));
    EXPECT_LE(max_abs_diff(final_params[0][i], expected[i]), 1e-5);
  }
}

TEST(Ddp, GradientsStayBucketViewsWhenTheOptimiserResetsThem) {
  // PyTorch 2's zero_grad sets .grad to undefined; DDP must relink it.
  auto models = models_with_seeds(2, 3);
  run_ranks(2, [&](ProcessGroup& group) {
    DistributedDataParallel ddp(models[group.rank()], group);
    const Batches d = [&] {
      static std::mutex m;
      std::lock_guard<std::mutex> lock(m);
      return make_batches(4, 9);
    }();
    for (int step = 0; step < 2; ++step) {
      for (auto& p : ddp->parameters()) p.mutable_grad() = torch::Tensor();
      torch::nll_loss(ddp.forward(d.x), d.y).backward();
      for (const auto& p : ddp->parameters()) {
        ASSERT_TRUE(p.grad().defined());
        const auto* begin = static_cast<const char*>(reducer_of(ddp).buckets()[0].buffer().data_ptr());
        const auto* end = begin + 4 * reducer_of(ddp).buckets()[0].buffer().numel();
        const auto* g = static_cast<const char*>(p.grad().data_ptr());
        EXPECT_TRUE(g >= begin && g < end) << "a gradient is no longer a view into its bucket";
      }
    }
  });
}

TEST(Ddp, TheReplicaCheckNamesEachDifferingRankAndItsLargestDifference) {
  auto models = models_with_seeds(3, 5);
  std::vector<std::string> outcome(3);
  run_ranks(3, [&](ProcessGroup& group) {
    DistributedDataParallel ddp(models[group.rank()], group);
    ddp.check_replicas("at the start");  // rank 0's state was broadcast: nothing to say
    if (group.rank() == 2) {
      torch::NoGradGuard no_grad;
      ddp->named_parameters()["conv.bias"][1].add_(0.25);
      ddp->named_parameters()["fc.weight"][3][7].add_(0.5);
    }
    try {
      ddp.check_replicas("after epoch 3");
      outcome[group.rank()] = "(passed)";
    } catch (const PeerLost& e) {
      outcome[group.rank()] = std::string("echo: ") + e.what();
    } catch (const std::exception& e) {
      outcome[group.rank()] = e.what();
    }
  });
  EXPECT_EQ(outcome[0],
            "the replicas diverged after epoch 3: rank 2 differs from rank 0 by up to 0.5 (largest in module.fc.weight) "
            "- something changed some ranks' parameters and not the others' (an optimizer step, a load or an edit on "
            "some ranks only); if nothing did, it is a bug in mnist_ddp: please report it");
  for (int r : {1, 2}) EXPECT_EQ(outcome[r], "echo: rank 0 found the replicas diverged after epoch 3");
}

struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    used = register_module("used", torch::nn::Linear(4, 2));
    unused = register_module("unused", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return used(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};
TORCH_MODULE(TwoHeads);

// As PyTorch's DDP: the backward leaves the averaging incomplete (another
// backward call could still bring the gradient), and the next forward names
// what got none.
TEST(Ddp, AParameterWithoutGradientIsNamedAtTheNextForward) {
  std::vector<TwoHeads> models{TwoHeads(), TwoHeads()};
  std::vector<std::string> errors(2);
  run_ranks(2, [&](ProcessGroup& group) {
    DistributedDataParallel ddp(models[group.rank()], group);
    ddp.forward(torch::ones({3, 4})).sum().backward();
    try {
      ddp.forward(torch::ones({3, 4}));
    } catch (const std::exception& e) {
      errors[group.rank()] = e.what();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("unused.weight"), std::string::npos) << e;
    EXPECT_EQ(e.find(" used.weight"), std::string::npos) << e;
  }
}

// Every tensor as float64, flat.
std::vector<torch::Tensor> flatten(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.reshape(-1).to(torch::kFloat64));
  return out;
}

// Conv, BatchNorm (made synchronous), linear: the shape of Net without its
// dropout, whose masks come from each device's own generator.
struct ConvBnNetImpl : torch::nn::Module {
  ConvBnNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    register_module("bn", torch::nn::BatchNorm2d(4));
    fc = register_module("fc", torch::nn::Linear(144, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = batch_norm_relu(*named_children()["bn"], conv(x));
    return torch::log_softmax(fc(x.flatten(1)), 1);
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvBnNet);

constexpr int kPerRank = 4;

ConvBnNet conv_bn_net() {
  torch::manual_seed(21);
  return ConvBnNet();
}

std::vector<Batches> conv_bn_batches(int world, int steps) {
  std::vector<Batches> data;
  for (int s = 0; s < steps; ++s) data.push_back(make_batches(world * kPerRank, 60 + s));
  return data;
}

// Models built serially: ranks as threads share LibTorch's default generator.
std::vector<ConvBnNet> conv_bn_nets(int count) {
  std::vector<ConvBnNet> models;
  for (int r = 0; r < count; ++r) models.push_back(conv_bn_net());
  return models;
}

// This rank trains `model`, its BatchNorm made synchronous, under `hook`
// (PowerSGD from step 2); returns its parameters and buffers, on the CPU.
std::vector<torch::Tensor> train_conv_bn_net(ProcessGroup& group, ConvBnNet model, const std::string& hook,
                                             const std::vector<Batches>& data,
                                             std::vector<torch::Tensor>* first_grads = nullptr) {
  convert_sync_batchnorm(model, group);
  model->to(group.device());
  DistributedDataParallel ddp(model, group);
  ddp.register_comm_hook(make_comm_hook(hook, hooks::PowerSgdOptions().matrix_approximation_rank(2).start_powersgd_iter(2)));
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(5e-4));
  const int64_t begin = group.rank() * kPerRank;
  for (const auto& d : data) {
    opt.zero_grad();
    torch::nll_loss(ddp.forward(d.x.slice(0, begin, begin + kPerRank).to(group.device())),
                    d.y.slice(0, begin, begin + kPerRank).to(group.device()))
        .backward();
    if (first_grads && first_grads->empty())
      for (const auto& p : ddp->parameters()) first_grads->push_back(p.grad().cpu().clone());
    opt.step();
  }
  std::vector<torch::Tensor> state;
  for (const auto& t : ddp->parameters()) state.push_back(t.detach().cpu().clone());
  for (const auto& t : ddp->buffers()) state.push_back(t.detach().cpu().clone());
  return state;
}

// One process, BatchNorm2d on the concatenated batch, on the CPU.
std::vector<torch::Tensor> train_oracle(const std::vector<Batches>& data, std::vector<torch::Tensor>* first_grads) {
  ConvBnNet model = conv_bn_net();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(5e-4));
  for (const auto& d : data) {
    opt.zero_grad();
    torch::nll_loss(model->forward(d.x), d.y).backward();
    if (first_grads->empty())
      for (const auto& p : model->parameters()) first_grads->push_back(p.grad().clone());
    opt.step();
  }
  std::vector<torch::Tensor> state;
  for (const auto& t : model->parameters()) state.push_back(t.detach().clone());
  for (const auto& t : model->buffers()) state.push_back(t.detach().clone());
  return state;
}

const torch::Device kGpu(torch::kCUDA, 0);

TEST(Ddp, SyncBatchNormRanksTrackOneProcessOnTheConcatenatedBatch) {
  const auto data = conv_bn_batches(2, 3);
  std::vector<torch::Tensor> oracle_grads;
  const auto oracle = train_oracle(data, &oracle_grads);
  const auto models = conv_bn_nets(2);
  run_ranks(2, [&](ProcessGroup& group) {
    std::vector<torch::Tensor> grads;
    const auto state = train_conv_bn_net(group, models[group.rank()], "none", data, &grads);
    for (size_t i = 0; i < oracle_grads.size(); ++i) EXPECT_LE(max_abs_diff(grads[i], oracle_grads[i]), 1e-5) << i;
    for (size_t i = 0; i < oracle.size(); ++i) EXPECT_LE(max_abs_diff(state[i], oracle[i]), 1e-4) << i;
  });
}

// The GPU's gradients equal the CPU's (TF32 off: it rounds convolutions to 10 bits).
TEST(CudaDdp, OneStepOnTheGpuGivesTheCpusGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device is visible to this LibTorch";
  at::globalContext().setAllowTF32CuDNN(false);
  const auto data = conv_bn_batches(2, 1);
  std::vector<torch::Tensor> oracle_grads;
  train_oracle(data, &oracle_grads);
  const auto models = conv_bn_nets(2);
  run_ranks(
      2,
      [&](ProcessGroup& group) {
        at::globalContext().setAllowTF32CuDNN(false);
        std::vector<torch::Tensor> grads;
        train_conv_bn_net(group, models[group.rank()], "none", data, &grads);
        for (size_t i = 0; i < oracle_grads.size(); ++i)
          EXPECT_LE(max_abs_diff(grads[i], oracle_grads[i]), 1e-5) << "rank " << group.rank() << " parameter " << i;
      },
      kGpu);
}

TEST(CudaDdp, RanksSharingAGpuStayBitIdenticalUnderEveryHook) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device is visible to this LibTorch";
  const auto data = conv_bn_batches(2, 5);
  run_ranks(
      2,
      [&](ProcessGroup& group) {
        for (const std::string& hook : kAllCompressions) {
          const auto state = torch::cat(flatten(train_conv_bn_net(group, conv_bn_net(), hook, data)));
          const auto all = bulk_stream(group)->gather_to_rank0(state);
          for (size_t r = 1; r < all.size(); ++r)
            EXPECT_TRUE(torch::equal(all[r], all[0])) << hook << ": rank " << r << " differs from rank 0";
          EXPECT_TRUE(torch::isfinite(state).all().item<bool>()) << hook;
        }
      },
      kGpu);
}

}  // namespace
}  // namespace mnist_ddp
