// Correct programs the check must never end, each as a small program of two
// ranks under our launcher (Gloo, shared memory), beside two busy loops:
// each must run to its end with identical replicas. The check names only
// what no correct program does (watch.hpp, "Note on verdicts"); these are
// what it once named wrongly. The program is this test binary itself, run
// as `mnist_ddp_tests --gtest_filter=LegitProgram.Run` with the case in
// MNIST_DDP_TEST_LEGIT.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <thread>

#include "mnist_ddp/ddp.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace legit {  // named: a unity batch shares one anonymous namespace with the mistakes' program

using namespace std::chrono_literals;
using test::Ran;
using test::step;

// ---- the program ----

// A SyncBatchNorm between two layers (converted where the forward finds it:
// an entry of the Sequential it calls).
struct SyncedImpl : torch::nn::Module {
  explicit SyncedImpl(int64_t hidden = 8) {
    layers = register_module("layers", torch::nn::Sequential(torch::nn::Linear(4, hidden),
                                                             torch::nn::BatchNorm1d(hidden), torch::nn::ReLU(),
                                                             torch::nn::Linear(hidden, 2)));
    convert_sync_batchnorm(layers);
  }
  torch::Tensor forward(const torch::Tensor& x) { return layers->forward(x); }
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(Synced);

void say(const ProcessGroup& group, const std::string& line) {
  test::write_line("legit: rank " + std::to_string(group.rank()) + ": " + line);
}

// Rank 0 has no batch at all and joins at once; rank 1 trains a model of
// two Linear layers (no buffers, no SyncBatchNorm: nothing but its
// buckets and join's vote on the wire) for longer than the timeout.
void join_outlasting_the_timeout(const ProcessGroup& group) {
  const int rank = group.rank();
  auto model = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  DistributedDataParallel ddp(model, group);
  torch::optim::SGD opt(model->parameters(), 0.1);
  const auto until = std::chrono::steady_clock::now() + 2 * group.timeout() + 1s;
  ddp.join([&] {
    for (int k = 0; rank == 1 && std::chrono::steady_clock::now() < until; ++k) {
      step(ddp, opt, rank, k);
      std::this_thread::sleep_for(100ms);
    }
  });
  ddp.check_replicas("after joining");
  say(group, "passed");
}

void run_case(const std::string& name) {
  auto group = init_process_group();
  const int rank = group.rank();
  torch::manual_seed(0);
  if (name == "join-outlasting-the-timeout") return join_outlasting_the_timeout(group);
  Synced model;
  DistributedDataParallel<Synced> ddp(model, group);
  torch::optim::SGD opt(model->parameters(), 0.1);
  if (name == "eval-on-rank-0") {  // rank 0 evaluates through the DDP, then every rank meets at a barrier
    for (int k = 0; k < 2; ++k) step(ddp, opt, rank, k);
    if (rank == 0) {
      ddp.eval();
      torch::NoGradGuard no_grad;
      ddp.forward(torch::randn({4, 4}));
      ddp.train();
    }
    group.barrier();
    for (int k = 2; k < 4; ++k) step(ddp, opt, rank, k);
  } else if (name == "two-threads") {  // a second model on a thread of its own; rank 1's runs 6 s late once
    Synced other(6);
    DistributedDataParallel<Synced> second(other, group);
    torch::optim::SGD other_opt(other->parameters(), 0.1);
    std::exception_ptr failed;
    std::thread thread([&] {
      try {
        for (int k = 0; k < 6; ++k) {
          if (rank == 1 && k == 2) std::this_thread::sleep_for(6s);
          step(second, other_opt, rank, 100 + k);
        }
      } catch (...) {
        failed = std::current_exception();
      }
    });
    for (int k = 0; k < 6; ++k) step(ddp, opt, rank, k);
    thread.join();
    if (failed) std::rethrow_exception(failed);
    second.check_replicas("after training on its own thread");
  } else if (name == "slow-rank") {  // rank 1 stops for 8 s between two steps (a slow checkpoint, say)
    for (int k = 0; k < 4; ++k) {
      if (rank == 1 && k == 2) std::this_thread::sleep_for(8s);
      step(ddp, opt, rank, k);
    }
  } else if (name == "paused-rank") {  // the test stops rank 1 (SIGSTOP, as a debugger does) for 8 s
    say(group, "pid " + std::to_string(getpid()));
    for (int k = 0; k < 30; ++k) {
      step(ddp, opt, rank, k);
      std::this_thread::sleep_for(200ms);
    }
  } else if (name == "join-idle-rank") {  // rank 1 has no batch at all; rank 0 steps through a GradScaler
    GradScaler scaler(group);
    ddp.join([&] {
      for (int k = 0; k < (rank == 0 ? 3 : 0); ++k) {
        torch::manual_seed(k);
        opt.zero_grad();
        scaler.scale(torch::mse_loss(ddp.forward(torch::randn({8, 4})), torch::randn({8, 2}))).backward();
        scaler.step(opt);
        scaler.update();
      }
    });
  } else if (name == "local-backwards") {
    // Rank 0 accumulates gradients through a module itself (one without
    // SyncBatchNorm: its forward issues nothing), which the next averaging
    // backward takes in; then a backward in eval() that it never steps (a
    // look at the gradients).
    auto plain = std::make_shared<torch::nn::LinearImpl>(4, 2);
    DistributedDataParallel plain_ddp(plain, group);
    torch::optim::SGD plain_opt(plain->parameters(), 0.1);
    step(plain_ddp, plain_opt, rank, 0);
    plain_opt.zero_grad();
    if (rank == 0) torch::mse_loss(plain->forward(torch::randn({8, 4})), torch::randn({8, 2})).backward();
    torch::mse_loss(plain_ddp.forward(torch::randn({8, 4})), torch::randn({8, 2})).backward();
    plain_opt.step();
    plain_ddp.check_replicas("after an accumulated local backward");
    step(ddp, opt, rank, 0);
    if (rank == 0) {
      model->eval();
      model->forward(torch::randn({8, 4})).sum().backward();
      opt.zero_grad();
      model->train();
    }
    for (int k = 1; k < 3; ++k) step(ddp, opt, rank, k);
  } else {
    throw UsageError("no legit case called " + name);
  }
  ddp.check_replicas("at the end");
  say(group, "passed");
}

TEST(LegitProgram, Run) {
  const char* name = std::getenv("MNIST_DDP_TEST_LEGIT");
  if (!name) GTEST_SKIP() << "the program of Legit.*, run by them";
  try {
    run_case(name);
  } catch (const Error& e) {
    const std::string text = std::string("legit: failed: ") + e.what() + "\n";
    if (::write(2, text.data(), text.size()) < 0) std::abort();
    _exit(1);
  }
  _exit(0);
}

// ---- the tests ----

// The case under `mnist_ddp run --nproc 2 --timeout T`, beside two busy
// loops: both ranks end well, having said so.
void expect_runs_to_its_end(const std::string& name, int timeout_s = 30,
                            const std::function<void(test::Process&, const std::string&)>& meanwhile = nullptr) {
  test::BusyLoops busy;
  const Ran ran = test::run_program("LegitProgram.Run", {"MNIST_DDP_TEST_LEGIT=" + name}, timeout_s, 180s, meanwhile);
  EXPECT_EQ(ran.code, 0) << name << "\n" << ran.output;
  EXPECT_EQ(test::count_lines_with(ran.output, "legit: rank 0: passed"), 1) << name << "\n" << ran.output;
  EXPECT_EQ(test::count_lines_with(ran.output, "legit: rank 1: passed"), 1) << name << "\n" << ran.output;
}

TEST(Legit, EvaluationOnRank0ThroughTheDdpThenABarrier) { expect_runs_to_its_end("eval-on-rank-0"); }

TEST(Legit, TwoModelsOnTwoThreadsOneOfThemSixSecondsLate) { expect_runs_to_its_end("two-threads"); }

TEST(Legit, ARankThatStopsForEightSecondsWithinTheTimeout) { expect_runs_to_its_end("slow-rank"); }

TEST(Legit, JoinWithARankThatHasNoBatchAtAllAndAGradScaler) { expect_runs_to_its_end("join-idle-rank"); }

// Twice the timeout (2 s) of training on one rank while the other, joined
// at once, serves it: each wait of the joined rank lasts one step.
TEST(Legit, JoinWithAnIdleRankWhileTheOtherTrainsLongerThanTheTimeout) {
  expect_runs_to_its_end("join-outlasting-the-timeout", 2);
}

TEST(Legit, LocalBackwardsThatAreAveragedLaterOrNeverStepped) { expect_runs_to_its_end("local-backwards"); }

// As a debugger does: rank 1 stopped for 8 s under a 24 s timeout, its
// heartbeat with it.
TEST(Legit, ARankPausedEightSecondsWithinTheTimeout) {
  expect_runs_to_its_end("paused-rank", 24, [](test::Process&, const std::string& output_file) {
    pid_t pid = 0;
    ASSERT_TRUE(test::eventually(
        [&] {
          std::ifstream in(output_file);
          for (std::string line; std::getline(in, line);)
            if (line.rfind("legit: rank 1: pid ", 0) == 0) pid = std::stoi(line.substr(19));
          return pid > 0;
        },
        60s));
    std::this_thread::sleep_for(1s);  // mid-run
    test::send_signal(pid, SIGSTOP);
    std::this_thread::sleep_for(8s);
    test::send_signal(pid, SIGCONT);
  });
}

}  // namespace legit
}  // namespace mnist_ddp
