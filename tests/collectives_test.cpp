// The ordered collective stream, and the exact math that keeps replicas
// bit-identical whatever each rank's threads.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <random>

#include "comm/collectives.hpp"
#include "comm/group.hpp"
#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "mnist_ddp/parallel/distributed.hpp"
#include "app/train/model.hpp"
#include "mnist_ddp/parallel/sync_batch_norm.hpp"
#include "parallel/exact_math.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::run_ranks;

// Records every collective a stream issues, and sleeps up to `max` at
// random (seeded) wherever a task is posted or run, to shake thread timing.
class ShakingRecorder : public StreamProbe {
 public:
  ShakingRecorder(uint64_t seed, std::chrono::microseconds max) : rng_(seed), max_(max) {}
  void posting() override { shake(); }
  void running() override { shake(); }
  void issued(const std::string& collective) override { log.push_back(collective); }
  std::vector<std::string> log;  // written on the communication thread only

 private:
  void shake() {
    std::chrono::microseconds pause;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pause = std::chrono::microseconds(static_cast<int64_t>(rng_() % static_cast<uint64_t>(max_.count())));
    }
    std::this_thread::sleep_for(pause);
  }
  std::mutex mutex_;
  std::mt19937_64 rng_;
  const std::chrono::microseconds max_;
};

hooks::PowerSgdOptions start_at(int64_t step) {
  auto o = hooks::PowerSgdOptions().matrix_approximation_rank(2);
  o.start_powersgd_iter(step);
  return o;
}

TEST(CollectiveStream, TasksRunOneAtATimeInTheOrderPosted) {
  run_ranks(1, [](ProcessGroup& group) {
    std::vector<int> order;
    std::atomic<int> inside{0};
    bool overlapped = false;
    std::vector<CollectiveStream::Ticket> tickets;
    bulk_stream(group)->watch(std::make_shared<ShakingRecorder>(1, std::chrono::microseconds(300)));
    for (int i = 0; i < 50; ++i)
      tickets.push_back(bulk_stream(group)->post([&, i](Channel&) {
        overlapped |= inside.fetch_add(1) != 0;
        order.push_back(i);
        inside.fetch_sub(1);
      }));
    bulk_stream(group)->wait(tickets.back());
    std::vector<int> expected(50);
    for (int i = 0; i < 50; ++i) expected[i] = i;
    EXPECT_EQ(order, expected);
    EXPECT_FALSE(overlapped);
  });
}

TEST(CollectiveStream, AfterAFailedTaskNoLaterTaskRunsAndEachWaitSaysWhy) {
  run_ranks(1, [](ProcessGroup& group) {
    bool ran = false;
    const auto good = bulk_stream(group)->post([](Channel&) {});
    const auto bad = bulk_stream(group)->post([](Channel&) { throw std::runtime_error("the peer is gone"); });
    const auto later = bulk_stream(group)->post([&](Channel&) { ran = true; });
    EXPECT_NO_THROW(bulk_stream(group)->wait(good));
    EXPECT_THROW(bulk_stream(group)->wait(bad), PeerLost) << "a backend's exception, in the library's words";
    try {
      bulk_stream(group)->wait(later);
      ADD_FAILURE() << "a task after a failure passed";
    } catch (const PeerLost& e) {
      EXPECT_STREQ(e.what(), "a task on the stream: a collective failed: the peer is gone");
    }
    EXPECT_FALSE(ran);
  });
}

// Three ranks train the real Net with SyncBatchNorm for a few steps under
// every hook, with random delays in every thread that posts or runs a
// collective (a different seed per rank): each rank records what it issued.
TEST(CollectiveOrder, EveryRankIssuesTheSameCollectivesInTheSameOrderForEveryHook) {
  const int world = 3, steps = 4;
  for (const std::string& name : kAllCompressions) {
    std::vector<Net> nets;
    for (int r = 0; r < world; ++r) nets.emplace_back();
    torch::manual_seed(11);
    const auto x = torch::randn({4 * world, 1, 28, 28});
    const auto y = torch::randint(0, 10, {4 * world}, torch::kInt64);
    // Each rank's record of each lane: the bulk stream and the quick one.
    std::vector<std::vector<std::string>> bulk(world), quick(world);
    run_ranks(world, [&](ProcessGroup& group) {
      convert_sync_batchnorm(nets[group.rank()], group);  // as the trainer does
      DistributedDataParallel ddp(nets[group.rank()], group, DdpOptions().broadcast_buffers(false));
      ddp.register_comm_hook(make_comm_hook(name, start_at(2)));
      torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      const auto mine = x.slice(0, 4 * group.rank(), 4 * group.rank() + 4);
      const auto labels = y.slice(0, 4 * group.rank(), 4 * group.rank() + 4);
      const auto on_bulk = std::make_shared<ShakingRecorder>(1000 + group.rank(), std::chrono::microseconds(1500));
      const auto on_quick = std::make_shared<ShakingRecorder>(2000 + group.rank(), std::chrono::microseconds(1500));
      ASSERT_NE(bulk_stream(group), quick_stream(group)) << "a Gloo job of several ranks has two lanes";
      bulk_stream(group)->watch(on_bulk);
      quick_stream(group)->watch(on_quick);
      for (int step = 0; step < steps; ++step) {
        opt.zero_grad();
        const auto loss = torch::nll_loss(ddp.forward(mine), labels);
        loss.backward();
        opt.step();
        auto metric = loss.detach().to(torch::kFloat64).reshape({1});
        quick_stream(group)->allreduce_sum(metric);  // as the trainer's log line does
      }
      bulk_stream(group)->watch(nullptr);
      quick_stream(group)->watch(nullptr);
      bulk[group.rank()] = on_bulk->log;
      quick[group.rank()] = on_quick->log;
    });
    for (int r = 1; r < world; ++r) {
      EXPECT_EQ(bulk[r], bulk[0]) << name << ": rank " << r << " issued another sequence on the bulk lane";
      EXPECT_EQ(quick[r], quick[0]) << name << ": rank " << r << " issued another sequence on the quick lane";
    }
    // Per step: SyncBatchNorm's forward statistics and backward sums of
    // both layers and one metric on the quick lane, at least one collective
    // per bucket on the bulk one.
    const auto count = [&](const std::string& entry) {
      return std::count(quick[0].begin(), quick[0].end(), entry);
    };
    EXPECT_EQ(count("allreduce Double [65]"), steps) << name;   // bn1 statistics: 32 sums, 32 squares, count
    EXPECT_EQ(count("allreduce Double [129]"), steps) << name;  // bn2's
    EXPECT_EQ(count("allreduce Double [64]"), steps) << name;   // bn1 backward: 32 + 32 sums
    EXPECT_EQ(count("allreduce Double [1]"), steps) << name;
    EXPECT_GE(quick[0].size(), static_cast<size_t>(steps * 5)) << name;
    EXPECT_GE(bulk[0].size(), static_cast<size_t>(steps * 2)) << name;
  }
}

// See src/parallel/exact_math.hpp.
TEST(ExactMath, ResultsAreBitIdenticalWhateverTheThreadCount) {
  torch::manual_seed(12);
  const auto p = torch::randn({1087, 2}), q = torch::randn({1087, 2});
  const auto wide = torch::randn({300000, 3});
  // ATen's own sum of these squares differs in its last bits between 1 and 2
  // threads (LibTorch 1.13, OpenMP): what the old replica check tripped on.
  const auto long_column = torch::randn({1200074, 1}, torch::kFloat64).square();
  const int before = at::get_num_threads();
  auto compute = [&](int threads) {
    at::set_num_threads(threads);
    auto orthonormal = p.clone();
    orthogonalize(orthonormal, 0);
    auto product = torch::empty({1087, 1087});
    exact_outer_product(product, orthonormal, q);
    return std::vector<torch::Tensor>{orthonormal, product, exact_row_sum(wide), exact_row_sum(product),
                                      exact_row_sum(long_column)};
  };
  const auto one = compute(1);
  for (int threads : {2, 3, 8}) {
    const auto many = compute(threads);
    for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(torch::equal(one[i], many[i])) << threads << " threads, result " << i;
  }
  at::set_num_threads(before);
}

// The CPU's one-pass outer product rounds as the tensor ops do (a GPU's
// ranks run those): each product, then each add, in order.
TEST(ExactMath, TheCpusOnePassOuterProductRoundsAsTheTensorOps) {
  torch::manual_seed(14);
  const auto p = torch::randn({37, 3}), q = torch::randn({53, 3}) * 1e3;
  auto expected = p.narrow(1, 0, 1) * q.narrow(1, 0, 1).t();
  for (int64_t k = 1; k < 3; ++k) expected.add_(p.narrow(1, k, 1) * q.narrow(1, k, 1).t());
  auto out = torch::empty({37, 53});
  exact_outer_product(out, p, q);
  EXPECT_TRUE(torch::equal(out, expected));
  auto strided = torch::empty({53, 37}).t();  // not contiguous: the tensor ops themselves
  exact_outer_product(strided, p, q);
  EXPECT_TRUE(torch::equal(strided, expected));
}

TEST(ExactMath, AgreesWithFloat64MathWithinRounding) {
  torch::manual_seed(13);
  for (int64_t n : {1, 2, 3, 7, 64, 1000}) {
    const auto a = torch::randn({n, 5});
    EXPECT_LE((exact_row_sum(a).to(torch::kFloat64) - a.to(torch::kFloat64).sum(0)).abs().max().item<double>(), 1e-5 * n)
        << n << " rows";
    auto m = torch::randn({n, std::min<int64_t>(n, 3)});
    orthogonalize(m, 0);
    const auto gram = torch::mm(m.t().to(torch::kFloat64), m.to(torch::kFloat64));
    EXPECT_LE((gram - torch::eye(m.size(1), torch::kFloat64)).abs().max().item<double>(), 1e-5) << n << " rows";
    const auto q = torch::randn({9, m.size(1)});
    auto out = torch::empty({n, 9});
    exact_outer_product(out, m, q);
    EXPECT_LE((out - torch::mm(m, q.t())).abs().max().item<double>(), 1e-5) << n << " rows";
  }
  auto zero = torch::zeros({5, 2});
  orthogonalize(zero, 0);
  EXPECT_TRUE(torch::equal(zero, torch::zeros({5, 2}))) << "a zero column must stay zero, not NaN";
}

// NCCL's own reduce_scatter (Link::reduce_scatter_sum), one rank a GPU,
// up to two: each rank's chunk is the sum of that chunk over the ranks.
TEST(CudaCollectives, NcclsReduceScatterGivesEachRankTheSumOfItsChunk) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device is visible to this LibTorch";
  const int world = std::min<int>(static_cast<int>(torch::cuda::device_count()), 2);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<torch::Tensor> got(world);
  std::vector<std::string> failed(world);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < world; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        const torch::Device gpu(torch::kCUDA, rank);
        ProcessGroup group = make_process_group(store, rank, world, "nccl", gpu, std::chrono::seconds(60));
        auto out = torch::zeros({3}, gpu);
        group.reduce_scatter(out, torch::arange(3 * world, torch::TensorOptions(gpu).dtype(torch::kFloat32)) * (rank + 1));
        got[rank] = out.cpu();
        group.barrier();
      } catch (const std::exception& e) {
        failed[rank] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  const double ranks_sum = world * (world + 1) / 2.0;  // 1 + 2 + ... + world
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(failed[r], "") << "rank " << r;
    EXPECT_TRUE(torch::equal(got[r], torch::arange(3 * r, 3 * r + 3, torch::kFloat32) * ranks_sum)) << "rank " << r;
  }
}

}  // namespace
}  // namespace mnist_ddp
