// The check before each collective, the watch on collectives that wait,
// and ddp.join(): ranks as threads over Gloo (and shared memory), each
// case against what every rank must say.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <chrono>
#include <mutex>

#include "mnist_ddp/ddp.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::run_ranks;
using test::Sums;

// Ranks that issue different collectives on one lane: each learns at once
// what every rank was about to issue, and says so in the same line, through
// Gloo and through shared memory.
TEST(CollectiveCheck, RanksThatIssueDifferentCollectivesEachSayWhatEveryRankWasDoing) {
  for (const Sums sums : {Sums::gloo, Sums::shared_memory}) {
    std::vector<std::string> said(2);
    std::mutex mutex;
    const auto start = std::chrono::steady_clock::now();
    try {
      run_ranks(
          2,
          [&](ProcessGroup& group) {
            std::string what = "(passed)";
            try {
              if (group.rank() == 0) {
                auto stats = torch::zeros({65});
                bulk_stream(group)->allreduce_sum(stats, "SyncBatchNorm features.1's forward");
              } else {
                auto bucket = torch::zeros({1000});
                bulk_stream(group)->allreduce_sum(bucket, "DDP bucket 0's backward");
              }
            } catch (const CollectiveMismatch& e) {
              what = e.what();
            }
            std::lock_guard<std::mutex> lock(mutex);
            said[group.rank()] = what;
            throw std::runtime_error("spent");  // no barrier on a group that mismatched
          },
          torch::kCPU, sums);
    } catch (const std::runtime_error&) {
    }
    const std::string expected =
        "rank 0 is in SyncBatchNorm features.1's forward (allreduce, 65 float32); rank 1 is in DDP bucket 0's "
        "backward (allreduce, 1000 float32): a train-mode forward through SyncBatchNorm must run on every rank "
        "(evaluate or sample under eval(), or on every rank)";
    EXPECT_EQ(said[0], expected) << (sums == Sums::gloo ? "gloo" : "shared memory");
    EXPECT_EQ(said[1], expected) << (sums == Sums::gloo ? "gloo" : "shared memory");
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "the answer was known at once";
  }
}

// Ranks waiting in collectives on two lanes cannot meet: within seconds
// every rank names both, from what each rank's heartbeat says.
TEST(CollectiveCheck, RanksWaitingOnTwoLanesAreNamedWithinSeconds) {
  std::vector<std::string> said(2);
  std::mutex mutex;
  const auto start = std::chrono::steady_clock::now();
  try {
    run_ranks(2, [&](ProcessGroup& group) {
      std::string what = "(passed)";
      try {
        auto t = torch::zeros({10});
        if (group.rank() == 0) {
          quick_stream(group)->allreduce_sum(t, "SyncBatchNorm bn1's forward without autograd");
        } else {
          bulk_stream(group)->allreduce_sum(t, "DDP bucket 0's backward");
        }
      } catch (const CollectiveMismatch& e) {
        what = e.what();
      }
      std::lock_guard<std::mutex> lock(mutex);
      said[group.rank()] = what;
      throw std::runtime_error("spent");
    });
  } catch (const std::runtime_error&) {
  }
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(said[0], "rank 0 is in SyncBatchNorm bn1's forward without autograd (allreduce, 10 float32); rank 1 is "
                     "in DDP bucket 0's backward (allreduce, 10 float32): a train-mode forward through SyncBatchNorm "
                     "must run on every rank (evaluate or sample under eval(), or on every rank)");
  EXPECT_EQ(said[1], said[0]) << "the ranks say different things";
  EXPECT_LT(took, 10s) << "not within seconds";
}

// A model with SyncBatchNorm between two layers, for ddp.join().
struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    a = register_module("a", torch::nn::Linear(4, 3));
    norm = register_module("norm", torch::nn::Sequential(torch::nn::BatchNorm1d(3)));
    b = register_module("b", torch::nn::Linear(3, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(norm->forward(a(x)))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::nn::Sequential norm{nullptr};
};
TORCH_MODULE(Normed);

// Uneven inputs on 3 ranks: rank r trains 3 - r steps inside ddp.join().
// The oracle is one process applying, at each step, the gradient of the
// active ranks' losses summed (SyncBatchNorm over their concatenated
// batches: the joined ranks contribute nothing) and divided by the world
// size at the start, as PyTorch's join divides it. Every rank ends with
// the oracle's parameters and running statistics, bit-identical replicas.
TEST(Join, UnevenInputsOnThreeRanksEndAsOneProcessApplyingTheSameAverages) {
  constexpr int kRanks = 3;
  const double lr = 0.1;
  std::mutex mutex;
  auto make = [&] {  // the same model every time: ranks as threads share LibTorch's generator
    std::lock_guard<std::mutex> lock(mutex);
    torch::manual_seed(7);
    Normed model;
    model->to(torch::kFloat64);
    return model;
  };
  torch::manual_seed(8);
  std::vector<torch::Tensor> xs, ys;  // [rank][step] batches of 4
  for (int r = 0; r < kRanks; ++r) {
    xs.push_back(torch::randn({3, 4, 4}, torch::kFloat64));
    ys.push_back(torch::randn({3, 4, 2}, torch::kFloat64));
  }
  std::vector<std::vector<torch::Tensor>> got(kRanks);
  run_ranks(kRanks, [&](ProcessGroup& group) {
    Normed model = make();
    convert_sync_batchnorm(model, group);
    DistributedDataParallel<Normed> ddp(model, group);
    torch::optim::SGD sgd(model->parameters(), lr);
    const int r = group.rank();
    ddp.join([&] {
      for (int step = 0; step < kRanks - r; ++step) {
        sgd.zero_grad();
        torch::mse_loss(ddp.forward(xs[r][step]), ys[r][step]).backward();
        sgd.step();
      }
    });
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& t : model->parameters()) got[r].push_back(t.detach().clone());
    for (const auto& t : model->buffers()) got[r].push_back(t.detach().clone());
  });
  Normed oracle = make();
  for (int step = 0; step < kRanks; ++step) {
    std::vector<torch::Tensor> x, y;
    for (int r = 0; r < kRanks - step; ++r) {  // the ranks still active
      x.push_back(xs[r][step]);
      y.push_back(ys[r][step]);
    }
    oracle->zero_grad();
    const auto out = oracle->forward(torch::cat(x));
    torch::Tensor loss = torch::zeros({}, torch::kFloat64);
    for (size_t r = 0; r < x.size(); ++r) loss = loss + torch::mse_loss(out.slice(0, 4 * r, 4 * (r + 1)), y[r]);
    loss.backward();
    torch::NoGradGuard no_grad;
    for (auto& p : oracle->parameters()) p.add_(p.grad() / kRanks, -lr);
  }
  std::vector<torch::Tensor> expected;
  for (const auto& t : oracle->parameters()) expected.push_back(t.detach());
  for (const auto& t : oracle->buffers()) expected.push_back(t.detach());
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(got[r].size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_LE(test::max_abs_diff(got[r][i].to(torch::kFloat64), expected[i].to(torch::kFloat64)), 1e-12)
          << "rank " << r << " tensor " << i;
      EXPECT_TRUE(torch::equal(got[r][i], got[0][i])) << "replica " << r << " tensor " << i;
    }
  }
}

// Under PowerSGD with float16 on the wire (compressing from the first
// step), ranks that join early serve every P and Q of the others with
// zeros; after join() every rank holds the last rank's parameters and
// PowerSGD's shared state (its step count), so the next steps agree.
TEST(Join, UnevenInputsUnderPowerSgdEndWithIdenticalReplicasAndHookState) {
  constexpr int kRanks = 3;
  std::vector<std::vector<torch::Tensor>> got(kRanks);
  std::vector<int64_t> iters(kRanks);
  std::mutex mutex;
  run_ranks(kRanks, [&](ProcessGroup& group) {
    torch::nn::Sequential model{nullptr};
    {
      std::lock_guard<std::mutex> lock(mutex);
      torch::manual_seed(3);
      model = torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
    }
    DistributedDataParallel ddp(model, group);
    auto hook = hooks::powersgd(hooks::PowerSgdOptions().start_powersgd_iter(0).matrix_approximation_rank(2));
    ddp.register_comm_hook(hooks::fp16_compress_wrapper(hook));
    torch::optim::SGD sgd(model->parameters(), 0.05);
    const int r = group.rank();
    auto step = [&](int k) {
      torch::Tensor x, y;
      {
        std::lock_guard<std::mutex> lock(mutex);
        torch::manual_seed(100 * r + k);
        x = torch::randn({8, 16});
        y = torch::randn({8, 4});
      }
      sgd.zero_grad();
      torch::mse_loss(ddp.forward(x), y).backward();
      sgd.step();
    };
    ddp.join([&] {
      for (int k = 0; k < 2 * (kRanks - r); ++k) step(k);
    });
    step(99);  // every rank again: their hooks must agree on compressing
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& t : model->parameters()) got[r].push_back(t.detach().clone());
    iters[r] = hook->powersgd_state().iter;
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(iters[r], 2 * kRanks + 1) << "rank " << r << "'s PowerSGD steps";
    for (size_t i = 0; i < got[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(got[r][i], got[0][i])) << "replica " << r << " tensor " << i;
      EXPECT_TRUE(got[r][i].isfinite().all().item<bool>());
    }
  }
}

}  // namespace
}  // namespace mnist_ddp
