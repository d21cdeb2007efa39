#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "mnist_ddp/parallel/comm_hooks.hpp"
#include "mnist_ddp/parallel/distributed.hpp"
#include "app/train/model.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::max_abs_diff;

using test::run_ranks;
using namespace hooks;

// A bucket over fresh storage whose gradients have the given shapes.
GradBucket make_bucket(const std::vector<std::vector<int64_t>>& shapes, size_t index = 0, bool is_last = true) {
  int64_t total = 0;
  for (const auto& s : shapes) total += c10::multiply_integers(s);
  const torch::Tensor buffer = torch::zeros({total});
  std::vector<torch::Tensor> gradients;
  int64_t at = 0;
  for (const auto& s : shapes) {
    const int64_t n = c10::multiply_integers(s);
    gradients.push_back(buffer.slice(0, at, at + n).view(s));
    at += n;
  }
  return GradBucket(index, is_last, buffer, gradients, {}, {});
}

// A wire for hooks called on the test's own thread: each collective is a
// task on the rank's stream, through the production GroupWire.
class StreamWire : public Wire {
 public:
  explicit StreamWire(ProcessGroup& group) : group_(group) {}
  int rank() const override { return group_.rank(); }
  int world_size() const override { return group_.world_size(); }
  FuturePtr allreduce_sum(torch::Tensor tensor) override {
    return on_stream([&](Wire& w) { return w.allreduce_sum(tensor); });
  }
  FuturePtr allgather(const torch::Tensor& tensor) override {
    return on_stream([&](Wire& w) { return w.allgather(tensor); });
  }
  FuturePtr broadcast(torch::Tensor tensor, int root) override {
    return on_stream([&](Wire& w) { return w.broadcast(tensor, root); });
  }
  int64_t elements_sent() const { return stats_.elements; }
  int64_t bytes_sent() const { return stats_.bytes; }

 private:
  template <typename Call>
  FuturePtr on_stream(Call call) {
    FuturePtr done;
    bulk_stream(group_)->run([&](Channel& channel) {
      GroupWire wire(channel, stats_);
      done = call(wire);
      done->waitAndThrow();
    });
    return done;
  }
  ProcessGroup& group_;
  WireStats stats_;
};

torch::Tensor run_hook(CommHook& hook, GradBucket& bucket, Wire& wire) {
  auto result = hook.run(bucket, wire);
  result->waitAndThrow();
  return future_tensor(result);
}

PowerSgdOptions powersgd(int rank, int64_t start, bool error_feedback = true, bool warm_start = true) {
  return PowerSgdOptions()
      .matrix_approximation_rank(rank)
      .start_powersgd_iter(start)
      .use_error_feedback(error_feedback)
      .warm_start(warm_start);
}

// Per-rank inputs drawn serially: ranks are threads sharing one generator.
std::vector<torch::Tensor> per_rank(int world, const std::function<torch::Tensor(int)>& make) {
  std::vector<torch::Tensor> out;
  for (int r = 0; r < world; ++r) out.push_back(make(r));
  return out;
}

// fp16 and bf16: the mean within the type's rounding (float16 keeps ~3
// decimal digits, bfloat16 ~2), two bytes an element on the wire.
TEST(Fp16, EqualsAllreduceWithinFloat16Tolerance) {
  torch::manual_seed(1);
  const auto inputs = per_rank(3, [](int) { return torch::randn({1000}); });
  const auto mean = (inputs[0] + inputs[1] + inputs[2]) / 3;
  for (const auto& [name, tolerance] : std::vector<std::pair<std::string, double>>{{"fp16", 4e-3}, {"bf16", 3e-2}}) {
    run_ranks(3, [&](ProcessGroup& group) {
      StreamWire wire(group);
      auto hook = make_comm_hook(name, {});
      auto bucket = make_bucket({{1000}});
      bucket.buffer().copy_(inputs[group.rank()]);
      const auto out = run_hook(*hook, bucket, wire);
      EXPECT_LE(max_abs_diff(out, mean), tolerance) << name;
      EXPECT_GT(max_abs_diff(out, mean), 0) << name << " sent float32";
      EXPECT_EQ(wire.bytes_sent(), 2000) << name;
      EXPECT_TRUE(out.is_same(bucket.buffer()) || torch::equal(out, bucket.buffer())) << name;
    });
  }
}

// A large tensor's sum: float32 through Gloo; float16 round the ring
// (comm_hooks.hpp, "the link") on 3 ranks, in chunks of two pieces, the
// second short, the last chunk padded. Every rank gets the same sum, that
// of what the ranks sent.
TEST(GroupWire, EveryRankGetsTheSumOfALargeTensor) {
  const int world = 3;
  const int64_t n = 2 * kLinkPieceBytes + 7;  // float16: a chunk is 1.33 pieces
  torch::manual_seed(5);
  const auto inputs = per_rank(world, [&](int) { return torch::randn({n}); });
  for (const auto type : {torch::kFloat32, torch::kHalf, torch::kBFloat16}) {
    std::vector<torch::Tensor> got(world);
    run_ranks(world, [&](ProcessGroup& group) {
      StreamWire wire(group);
      auto t = inputs[group.rank()].to(type, /*non_blocking=*/false, /*copy=*/true);
      wire.allreduce_sum(t)->waitAndThrow();
      got[group.rank()] = t.clone();
      EXPECT_EQ(wire.bytes_sent(), n * t.element_size());
    });
    for (int r = 1; r < world; ++r) EXPECT_TRUE(torch::equal(got[r], got[0])) << "rank " << r << ", " << type;
    torch::Tensor sum = torch::zeros({n});  // of what each rank sent
    for (const auto& input : inputs) sum += input.to(type).to(torch::kFloat32);
    const double tolerance = type == torch::kHalf ? 1e-2 : type == torch::kBFloat16 ? 8e-2 : 1e-5;
    EXPECT_LE(max_abs_diff(got[0].to(torch::kFloat32), sum), tolerance) << type;
  }
}

// The ring's sends and receives are waited for whole: a rank that reaches
// the sum 300 ms after the others (a checkpoint, a log line) delays it, and
// fails nothing (a wait in 100 ms slices failed every pair of the group).
TEST(GroupWire, ARankLateToTheRingDelaysTheSumAndFailsNothing) {
  const int world = 2;
  const int64_t n = 2 * kLinkPieceBytes;
  std::vector<torch::Tensor> got(world);
  run_ranks(world, [&](ProcessGroup& group) {
    StreamWire wire(group);
    auto t = torch::full({n}, group.rank() + 1.0, torch::kHalf);
    if (group.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    wire.allreduce_sum(t)->waitAndThrow();
    got[group.rank()] = t.clone();
  });
  for (int r = 0; r < world; ++r) EXPECT_TRUE(torch::equal(got[r], torch::full({n}, 3.0, torch::kHalf))) << "rank " << r;
}

TEST(Fp16, GradientsNearFloat16MaxDoNotOverflow) {
  // 3 x 60000 would overflow float16 (max 65504) if summed before dividing;
  // 3 x 2e38 bfloat16 (max 3.39e38).
  for (const auto& [name, value] : std::vector<std::pair<std::string, float>>{{"fp16", 60000.0f}, {"bf16", 2e38f}}) {
    run_ranks(3, [&](ProcessGroup& group) {
      StreamWire wire(group);
      auto hook = make_comm_hook(name, {});
      auto bucket = make_bucket({{4}});
      bucket.buffer().fill_(value);
      const auto out = run_hook(*hook, bucket, wire);
      EXPECT_TRUE(torch::isfinite(out).all().item<bool>()) << name;
      EXPECT_LE(max_abs_diff(out, torch::full({4}, value)) / value, 1e-2) << name;
    });
  }
}

TEST(PowerSgd, BeforeTheStartIterationIsBitIdenticalToNone) {
  torch::manual_seed(2);
  const auto inputs = per_rank(2, [](int) { return torch::randn({64 * 30 + 64}); });
  run_ranks(2, [&](ProcessGroup& group) {
    StreamWire wire(group);
    AllreduceHook none;
    for (const std::string name :
       {"powersgd", "powersgd_fp16", "batched_powersgd_fp16", "powersgd_bf16", "batched_powersgd_bf16"}) {
      auto hook = make_comm_hook(name, powersgd(2, 5));
      for (int step = 0; step < 5; ++step) {
        EXPECT_FALSE(name == "powersgd" && hook->compression_started());
        auto a = make_bucket({{64, 30}, {64}}), b = make_bucket({{64, 30}, {64}});
        a.buffer().copy_(inputs[group.rank()] * (step + 1));
        b.buffer().copy_(inputs[group.rank()] * (step + 1));
        const auto expected = run_hook(none, a, wire);
        const auto got = run_hook(*hook, b, wire);
        if (name == "powersgd") {
          EXPECT_TRUE(torch::equal(got, expected)) << name << " step " << step;
        } else {
          EXPECT_LE(max_abs_diff(got, expected), name.find("bf16") != std::string::npos ? 0.15 : 1e-2)
              << name << " step " << step;  // a 16-bit wire
        }
      }
      EXPECT_TRUE(hook->compression_started()) << name;
    }
  });
}

TEST(PowerSgd, ReconstructsTheAveragedMatrixExactlyWhenItsRankIsAtMostR) {
  // Every rank's matrix lies in one rank-2 column space, so their mean does too.
  torch::manual_seed(3);
  const auto basis = torch::randn({40, 2});
  const auto inputs = per_rank(3, [&](int) { return torch::mm(basis, torch::randn({2, 25})); });
  const auto bias = per_rank(3, [](int) { return torch::randn({40}); });
  const auto mean = (inputs[0] + inputs[1] + inputs[2]) / 3;
  const auto mean_bias = (bias[0] + bias[1] + bias[2]) / 3;
  run_ranks(3, [&](ProcessGroup& group) {
    StreamWire wire(group);
    PowerSgdHook hook(powersgd(2, 0, /*error_feedback=*/false, /*warm_start=*/false));
    auto bucket = make_bucket({{40, 25}, {40}});
    bucket.gradients()[0].copy_(inputs[group.rank()]);
    bucket.gradients()[1].copy_(bias[group.rank()]);
    run_hook(hook, bucket, wire);
    EXPECT_LE(max_abs_diff(bucket.gradients()[0], mean), 1e-4);
    EXPECT_LE(max_abs_diff(bucket.gradients()[1], mean_bias), 1e-6);  // uncompressed: exact mean
    // 40x25 at rank 2 sends P 80 + Q 50, the bias 40: 170 float32 elements.
    EXPECT_EQ(wire.elements_sent(), 170);
  });
}

TEST(PowerSgd, WarmStartApproachesTheBestRankRApproximation) {
  // A fixed matrix, fed every step: warm-started PowerSGD is subspace
  // iteration and must approach the SVD's rank-2 error.
  torch::manual_seed(4);
  const auto u = std::get<0>(at::linalg_qr(torch::randn({60, 60})));
  const auto v = std::get<0>(at::linalg_qr(torch::randn({50, 50})));
  auto sigma = torch::zeros({60, 50});
  const std::vector<float> values = {10, 8, 4, 3, 2, 1.5, 1, 0.5};
  for (size_t i = 0; i < values.size(); ++i) sigma[i][i] = values[i];
  const auto m = torch::mm(torch::mm(u, sigma), v.t());
  const double best = std::sqrt(4 * 4 + 3 * 3 + 2 * 2 + 1.5 * 1.5 + 1 + 0.25);  // sigma_3.. of the SVD
  run_ranks(2, [&](ProcessGroup& group) {
    StreamWire wire(group);
    PowerSgdHook hook(powersgd(2, 2, /*error_feedback=*/false, /*warm_start=*/true));
    double error = 0;
    for (int step = 0; step < 22; ++step) {  // 2 plain steps, then 20 compressed
      auto bucket = make_bucket({{60, 50}});
      bucket.buffer().copy_(m.reshape(-1));
      run_hook(hook, bucket, wire);
      error = (bucket.gradients()[0] - m).norm().item<double>();
    }
    EXPECT_LE(error, 1.01 * best) << "rank-2 error " << error << " vs the SVD's " << best;
  });
}

TEST(PowerSgd, ErrorFeedbackLosesNothingOverSteps) {
  // sum of applied updates + mean of final errors == sum of true averaged gradients
  const int world = 3, steps = 6;
  torch::manual_seed(5);
  std::vector<std::vector<torch::Tensor>> grads(steps);
  for (auto& g : grads) g = per_rank(world, [](int) { return torch::randn({30 * 20 + 30}); });
  torch::Tensor truth = torch::zeros({30 * 20 + 30}, torch::kFloat64);
  for (const auto& g : grads)
    for (const auto& r : g) truth += r.to(torch::kFloat64) / world;
  std::vector<torch::Tensor> applied(world), errors(world);
  run_ranks(world, [&](ProcessGroup& group) {
    StreamWire wire(group);
    PowerSgdHook hook(powersgd(1, 2));
    torch::Tensor sum = torch::zeros({30 * 20 + 30}, torch::kFloat64);
    for (int s = 0; s < steps; ++s) {
      auto bucket = make_bucket({{30, 20}, {30}});
      bucket.buffer().copy_(grads[s][group.rank()]);
      sum += run_hook(hook, bucket, wire).to(torch::kFloat64);
    }
    applied[group.rank()] = sum;
    errors[group.rank()] = hook.state().own.at("error/0").to(torch::kFloat64);
  });
  for (int r = 1; r < world; ++r) EXPECT_TRUE(torch::equal(applied[r], applied[0]));
  const auto mean_error = (errors[0] + errors[1] + errors[2]) / world;
  EXPECT_LE(max_abs_diff(applied[0] + mean_error, truth), 1e-5);
  EXPECT_GT(mean_error.abs().max().item<double>(), 1e-3) << "rank-1 compression of 30x20 must lose something";
}

TEST(BatchedPowerSgd, EqualsTheRankRApproximationOfThePaddedMeanMatrix) {
  // 70 elements pad to a 9x9 matrix. Each input is a rank-r 9x9 matrix with
  // columns 7 and 8 zeroed; the padding zeroes row 8 too. Zeroed rows and
  // columns keep the rank at most r, so the padded mean has rank r.
  for (int rank : {1, 2}) {
    torch::manual_seed(6 + rank);
    const auto basis = torch::randn({9, rank});
    const auto inputs = per_rank(2, [&](int) {
      auto full = torch::mm(basis, torch::randn({rank, 9}));
      full.slice(1, 7, 9).zero_();
      return full;
    });
    auto padded_mean = ((inputs[0] + inputs[1]) / 2).reshape(-1);
    run_ranks(2, [&](ProcessGroup& group) {
      StreamWire wire(group);
      BatchedPowerSgdHook hook(powersgd(rank, 0, false, false));
      auto bucket = make_bucket({{70}});
      bucket.buffer().copy_(inputs[group.rank()].reshape(-1).slice(0, 0, 70));
      const auto out = run_hook(hook, bucket, wire);
      EXPECT_LE(max_abs_diff(out, padded_mean.slice(0, 0, 70)), 1e-5) << "rank " << rank;
      EXPECT_EQ(wire.elements_sent(), 2 * 9 * rank);  // P and Q, 9 x r each
    });
  }
}

TEST(PowerSgd, SaveAndRestoreResumeBitIdentically) {
  torch::manual_seed(8);
  std::vector<std::vector<torch::Tensor>> grads(8);
  for (auto& g : grads) g = per_rank(2, [](int) { return torch::randn({20 * 16 + 20}); });
  for (const std::string name :
       {"powersgd", "powersgd_fp16", "batched_powersgd_fp16", "powersgd_bf16", "batched_powersgd_bf16"}) {
    run_ranks(2, [&](ProcessGroup& group) {
      StreamWire wire(group);
      auto step = [&](CommHook& hook, int s) {
        auto bucket = make_bucket({{20, 16}, {20}});
        bucket.buffer().copy_(grads[s][group.rank()]);
        return run_hook(hook, bucket, wire).clone();
      };
      auto straight = make_comm_hook(name, powersgd(2, 2));
      for (int s = 0; s < 4; ++s) step(*straight, s);
      const HookState saved = straight->state();
      auto resumed = make_comm_hook(name, powersgd(2, 2));
      resumed->load_state(saved);
      for (int s = 4; s < 8; ++s) EXPECT_TRUE(torch::equal(step(*straight, s), step(*resumed, s))) << name << " step " << s;
    });
  }
}

TEST(Hooks, EveryRankEndsEveryStepWithBitIdenticalGradients) {
  for (const test::Sums sums : {test::Sums::gloo, test::Sums::shared_memory}) {
    for (const std::string& name : kAllCompressions) {
      std::vector<Net> nets;
      for (int r = 0; r < 2; ++r) nets.emplace_back();
      std::vector<std::vector<torch::Tensor>> grads(2);  // per rank: every step's gradients
      torch::manual_seed(9);
      const auto x = torch::randn({8, 1, 28, 28});
      const auto y = torch::randint(0, 10, {8}, torch::kInt64);
      run_ranks(2, [&](ProcessGroup& group) {
        DistributedDataParallel ddp(nets[group.rank()], group);
        ddp.register_comm_hook(make_comm_hook(name, powersgd(2, 2)));
        torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.01));
        const auto mine = x.slice(0, group.rank() * 4, group.rank() * 4 + 4), labels = y.slice(0, group.rank() * 4, group.rank() * 4 + 4);
        for (int step = 0; step < 5; ++step) {
          opt.zero_grad();
          torch::nll_loss(ddp.forward(mine), labels).backward();
          for (const auto& p : ddp->parameters()) grads[group.rank()].push_back(p.grad().clone());
          opt.step();
        }
      }, torch::kCPU, sums);
      ASSERT_EQ(grads[0].size(), grads[1].size());
      ASSERT_EQ(grads[0].size(), 5 * nets[0]->parameters().size());
      const size_t per_step = nets[0]->parameters().size();
      for (size_t i = 0; i < grads[0].size(); ++i)
        EXPECT_TRUE(torch::equal(grads[0][i], grads[1][i])) << name << " step " << i / per_step << " parameter " << i % per_step;
    }
  }
}

}  // namespace
}  // namespace mnist_ddp
