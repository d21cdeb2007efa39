#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "app/train/checkpoint.hpp"
#include "app/train/model.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::max_abs_diff;

using test::run_ranks;

struct Case {
  std::vector<int64_t> batch_sizes;  // one per rank; they may differ, and be 0
  int steps;
  bool relu = false;  // sync_batch_norm_relu against relu(BatchNorm2d)
  test::Sums sums = test::Sums::gloo;
};

// Every rank's slice of one global batch goes through SyncBatchNorm; the
// oracle is BatchNorm2d on the whole batch in one process. The loss is
// sum(y * g) with a fixed g, so the parameter gradients of the oracle are
// the sums of the ranks' shares. The ranks compute on `device` (sharing it
// over Gloo when it is a GPU); the oracle on the CPU.
void expect_matches_batch_norm_on_the_concatenated_batch(const Case& c, torch::Device device = torch::kCPU) {
  const int world = static_cast<int>(c.batch_sizes.size());
  const int64_t channels = 5, total = std::accumulate(c.batch_sizes.begin(), c.batch_sizes.end(), int64_t{0});
  std::vector<int64_t> begin{0};
  for (auto n : c.batch_sizes) begin.push_back(begin.back() + n);

  torch::manual_seed(11);
  std::vector<torch::Tensor> xs, gs;
  for (int s = 0; s < c.steps; ++s) {
    xs.push_back(torch::randn({total, channels, 6, 7}) * 3 + 1.5);
    gs.push_back(torch::randn({total, channels, 6, 7}));
  }
  torch::nn::BatchNorm2d oracle(channels);
  torch::nn::init::uniform_(oracle->weight, 0.5, 1.5);
  torch::nn::init::uniform_(oracle->bias, -0.5, 0.5);
  const auto weight0 = oracle->weight.detach().clone(), bias0 = oracle->bias.detach().clone();
  std::vector<torch::Tensor> oracle_y, oracle_dx, oracle_dw, oracle_db;
  for (int s = 0; s < c.steps; ++s) {
    oracle->zero_grad();
    auto x = xs[s].clone().requires_grad_(true);
    auto y = oracle->forward(x);
    if (c.relu) y = torch::relu(y);
    (y * gs[s]).sum().backward();
    oracle_y.push_back(y.detach());
    oracle_dx.push_back(x.grad());
    oracle_dw.push_back(oracle->weight.grad().clone());
    oracle_db.push_back(oracle->bias.grad().clone());
  }

  run_ranks(
      world,
      [&](ProcessGroup& group) {
    SyncBatchNorm bn{torch::nn::BatchNormOptions(channels)};
    bn->set_process_group(group);
    bn->to(device);
    {
      torch::NoGradGuard no_grad;
      bn->weight.copy_(weight0);
      bn->bias.copy_(bias0);
    }
    const int64_t lo = begin[group.rank()], hi = begin[group.rank() + 1];
    for (int s = 0; s < c.steps; ++s) {
      bn->zero_grad();
      auto x = xs[s].slice(0, lo, hi).to(device).requires_grad_(true);
      auto y = c.relu ? sync_batch_norm_relu(*bn, x) : bn->forward(x);
      (y * gs[s].slice(0, lo, hi).to(device)).sum().backward();
      EXPECT_LE(max_abs_diff(y, oracle_y[s].slice(0, lo, hi)), 1e-5) << "output, step " << s;
      EXPECT_LE(max_abs_diff(x.grad(), oracle_dx[s].slice(0, lo, hi)), 1e-5) << "input gradient, step " << s;
      auto shares = torch::cat({bn->weight.grad(), bn->bias.grad()});
      bulk_stream(group)->allreduce_sum(shares);
      EXPECT_LE(max_abs_diff(shares.slice(0, 0, channels), oracle_dw[s]), 1e-5) << "weight gradient, step " << s;
      EXPECT_LE(max_abs_diff(shares.slice(0, channels), oracle_db[s]), 1e-5) << "bias gradient, step " << s;
    }
    EXPECT_LE(max_abs_diff(bn->running_mean, oracle->running_mean), 1e-5);
    EXPECT_LE(max_abs_diff(bn->running_var, oracle->running_var), 1e-5);
    EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), oracle->num_batches_tracked.item<int64_t>());
      },
      device, c.sums);
}

TEST(SyncBatchNorm, TwoRanksWithUnequalBatchesMatchBatchNormOnTheWholeBatch) {
  expect_matches_batch_norm_on_the_concatenated_batch({{3, 5}, 3});
}

TEST(SyncBatchNorm, ThreeRanksWithUnequalBatchesMatchBatchNormOnTheWholeBatch) {
  expect_matches_batch_norm_on_the_concatenated_batch({{4, 1, 6}, 3});
}

TEST(SyncBatchNorm, ARankWithAnEmptyBatchNeitherHangsNorSkews) {
  expect_matches_batch_norm_on_the_concatenated_batch({{4, 0, 3}, 2});
}

// The fused CPU kernels of SyncBatchNorm + ReLU (planes of 42 values: the
// 16-lane loops and their tails), under the same three cases.
TEST(SyncBatchNorm, FusedWithReluMatchesReluOfBatchNormOnTheWholeBatch) {
  expect_matches_batch_norm_on_the_concatenated_batch({{3, 5}, 3, true});
  expect_matches_batch_norm_on_the_concatenated_batch({{4, 1, 6}, 3, true});
  expect_matches_batch_norm_on_the_concatenated_batch({{4, 0, 3}, 2, true});
}

// As a job on one host runs: its statistics summed through shared memory.
TEST(SyncBatchNorm, RanksSummingThroughSharedMemoryMatchBatchNormOnTheWholeBatch) {
  expect_matches_batch_norm_on_the_concatenated_batch({{4, 1, 6}, 3, false, test::Sums::shared_memory});
  expect_matches_batch_norm_on_the_concatenated_batch({{4, 0, 3}, 2, true, test::Sums::shared_memory});
}

TEST(CudaSyncBatchNorm, TwoRanksSharingOneGpuMatchBatchNormOnTheWholeBatch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device is visible to this LibTorch";
  at::globalContext().setAllowTF32CuDNN(false);
  expect_matches_batch_norm_on_the_concatenated_batch({{3, 5}, 3}, torch::Device(torch::kCUDA, 0));
  expect_matches_batch_norm_on_the_concatenated_batch({{3, 5}, 3, true}, torch::Device(torch::kCUDA, 0));
}

TEST(SyncBatchNorm, WorldSizeOneIsBatchNorm2dExactly) {
  torch::manual_seed(3);
  const auto x = torch::randn({6, 4, 5, 5});
  torch::nn::BatchNorm2d plain(4);
  run_ranks(1, [&](ProcessGroup& group) {
    SyncBatchNorm sync{torch::nn::BatchNormOptions(4)};
    sync->set_process_group(group);
    for (int step = 0; step < 2; ++step) {
      auto a = x.clone().requires_grad_(true), b = x.clone().requires_grad_(true);
      auto ya = plain->forward(a), yb = sync->forward(b);
      ya.pow(2).sum().backward();
      yb.pow(2).sum().backward();
      EXPECT_TRUE(torch::equal(ya, yb));
      EXPECT_TRUE(torch::equal(a.grad(), b.grad()));
    }
    EXPECT_TRUE(torch::equal(plain->running_var, sync->running_var));
    EXPECT_TRUE(torch::equal(plain->weight.grad(), sync->weight.grad()));
  });
}

TEST(SyncBatchNorm, EvalUsesRunningStatisticsAndNeverCommunicates) {
  // Rank r evaluates r + 1 batches: any collective would leave a rank waiting.
  std::vector<torch::Tensor> outputs(3);
  run_ranks(3, [&](ProcessGroup& group) {
    SyncBatchNorm bn{torch::nn::BatchNormOptions(2)};
    bn->set_process_group(group);
    {
      torch::NoGradGuard no_grad;
      bn->running_mean.copy_(torch::tensor({1.0f, -2.0f}));
      bn->running_var.copy_(torch::tensor({4.0f, 0.25f}));
    }
    bn->eval();
    torch::Tensor y;
    for (int b = 0; b <= group.rank(); ++b) y = bn->forward(torch::ones({2, 2, 3, 3}));
    outputs[group.rank()] = y;
  });
  const auto expected = torch::tensor({(1 - 1) / std::sqrt(4 + 1e-5), (1 + 2) / std::sqrt(0.25 + 1e-5)});
  for (const auto& y : outputs) EXPECT_LE(max_abs_diff(y.select(0, 0).mean({1, 2}), expected), 1e-5);
}

TEST(SyncBatchNorm, ConvertingNetKeepsItsStateDictNamesAndValues) {
  torch::manual_seed(5);
  Net net;
  {
    torch::NoGradGuard no_grad;
    net->named_buffers()["bn1.running_mean"].uniform_();  // not the defaults, so a copy would show
  }
  const auto before = state_dict(*net);
  const void* weight_before = net->named_parameters()["bn2.weight"].data_ptr();
  run_ranks(1, [&](ProcessGroup& group) { convert_sync_batchnorm(net, group); });
  const auto after = state_dict(*net);
  ASSERT_EQ(before.size(), after.size());
  auto a = before.begin();
  auto b = after.begin();
  for (; a != before.end(); ++a, ++b) {
    EXPECT_EQ(a->key(), b->key());
    EXPECT_TRUE(torch::equal(a->value(), b->value())) << a->key();
  }
  int converted = 0;
  for (const auto& child : net->named_children()) {
    const bool is_bn = child.key() == "bn1" || child.key() == "bn2";
    EXPECT_EQ(std::dynamic_pointer_cast<SyncBatchNormImpl>(child.value()) != nullptr, is_bn) << child.key();
    converted += is_bn;
  }
  EXPECT_EQ(converted, 2);
  // The same tensors, not copies: an optimiser built before the conversion still updates the model.
  EXPECT_EQ(std::dynamic_pointer_cast<SyncBatchNormImpl>(net->named_children()["bn2"])->weight.data_ptr(),
            weight_before);
}

}  // namespace
}  // namespace mnist_ddp
