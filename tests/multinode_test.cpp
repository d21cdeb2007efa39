// More than one machine, played on one: several launchers (or torchrun-style
// processes) meeting at node 0's store over loopback, and, where this
// machine lets us, over a virtual network between two network namespaces.
#include <gtest/gtest.h>

#include <sys/prctl.h>
#include <unistd.h>

#include <random>
#include <thread>

#include "app/train/checkpoint.hpp"
#include "app/base/files.hpp"
#include "app/base/options.hpp"
#include "run_util.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::eventually;
using test::exit_code;
using test::Process;
using test::read_text;
using test::TempDir;

class MultiNode : public test::JobsOnThisMachine {
 protected:
  // One node's command line; `path` is that node's own directory.
  std::vector<std::string> node(int rank, int nproc, const std::string& path, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--backend", "gloo", "--nnodes", "2", "--node-rank", std::to_string(rank),
                                     "--nproc", std::to_string(nproc), "--master-port", port_, "--epochs", "1",
                                     "--compression", "powersgd_fp16", "--start-powersgd-iter", "4",
                                     "--data-dir", dir_ / "data", "--path", path, "--timeout", "20"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
};

// Node 0's two workers compute with one thread each, node 1's one worker
// with two: the local math after each collective must not care (see
// src/parallel/exact_math.hpp), or the replica check fails the run.
TEST_F(MultiNode, TwoLaunchersOfDifferentSizesAndThreadCountsTrainAsOneJobUnderEveryHook) {
  for (const std::string& compression : kCompressions) {
    const std::vector<std::string> hook = {"--compression", compression, "--checkpoint-every", "0"};
    const std::string out0 = dir_ / (compression + "0"), out1 = dir_ / (compression + "1");
    Process node1(node(1, 1, out1, hook), out1 + ".txt", {"OMP_NUM_THREADS=2"});
    Process node0(node(0, 2, out0, hook), out0 + ".txt", {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(exit_code(node0.wait(180s)), 0) << read_text(out0 + ".txt");
    EXPECT_EQ(exit_code(node1.wait(30s)), 0) << read_text(out1 + ".txt");
    const std::string log = read_text(out0 + "/mnist_train.log");
    EXPECT_NE(log.find("Process group: gloo over 3 rank(s), device cpu, 1 intra-op thread(s) on rank 0"),
              std::string::npos) << log;
    EXPECT_NE(log.find("Replicas: all 3 ranks hold identical parameters"), std::string::npos) << compression << log;
    EXPECT_NE(log.find("Compression: " + compression + " "), std::string::npos) << log;
    EXPECT_FALSE(files::exists(out1 + "/mnist_train.log")) << "only rank 0 writes the log";
    // Without a shared secret, node 0 says what a process that reaches the store can do.
    EXPECT_NE(read_text(out0 + ".txt").find("takes any process that reaches it at its word: give every node the same "
                                            "MNIST_DDP_SECRET"),
              std::string::npos)
        << read_text(out0 + ".txt");
  }
}

// Each node writes under its own --path, and only rank 0 checkpoints: on
// --resume auto, node 1 has no checkpoint of its own and follows node 0's,
// whether the job is started again by hand (stopped by --max-steps at the
// end of epoch 0) or restarted by the launchers. A worker lost on node 1,
// then one on node 0: each time both launchers meet in a restart round at
// node 0's store (which its launcher holds, so it outlives the workers),
// start again from node 0's newest step checkpoint, and the job ends where
// the job stopped and resumed by hand ends (itself the straight job's end,
// see resume_test.cpp), bit for bit.
TEST_F(MultiNode, AResumedOrRestartedJobFollowsTheCheckpointOnNode0) {
  const std::vector<std::string> one_thread = {"OMP_NUM_THREADS=1"};
  const std::string out0 = dir_ / "n0", out1 = dir_ / "n1";
  for (const auto& extra : {std::vector<std::string>{"--epochs", "2", "--max-steps", "16"},
                            {"--epochs", "2", "--resume", "auto"}}) {
    Process node1(node(1, 1, out1, extra), out1 + ".txt", one_thread);
    Process node0(node(0, 1, out0, extra), out0 + ".txt", one_thread);
    ASSERT_EQ(exit_code(node0.wait(120s)), 0) << read_text(out0 + ".txt");
    ASSERT_EQ(exit_code(node1.wait(30s)), 0) << read_text(out1 + ".txt");
  }
  EXPECT_FALSE(files::exists(out1 + "/checkpoint"));
  const std::string log = read_text(out0 + "/mnist_train.log");
  EXPECT_NE(log.find("Resuming from " + out0 + "/checkpoint: epoch 1, batch 0"), std::string::npos) << log;
  EXPECT_NE(log.find("Test Epoch: 1:"), std::string::npos) << log;

  const std::vector<std::string> extra = {"--epochs", "2", "--checkpoint-steps", "3", "--max-restarts", "2"};
  const std::string straight = out0, killed = dir_ / "killed0";
  // Node 1's worker (rank 1) dies after a random step of the first start,
  // node 0's (rank 0) after a later one of the second (trainer.cpp's
  // fault-injection seam); neither step is a multiple of 3, so the newest
  // checkpoint is the one before it.
  std::mt19937 random(test::test_seed());
  auto step_after = [&](int first) {
    int step;
    do step = first + static_cast<int>(random() % 6);
    while (step % 3 == 0);
    return step;
  };
  const int first_kill = step_after(1), second_kill = step_after(first_kill + 1);
  const std::string kills = "MNIST_DDP_KILL_AFTER_STEP=0:1:" + std::to_string(first_kill) + ",1:0:" + std::to_string(second_kill);
  SCOPED_TRACE(kills);
  Process node1(node(1, 1, dir_ / "killed1", extra), dir_ / "killed1.txt", {"OMP_NUM_THREADS=1", kills});
  Process node0(node(0, 1, killed, extra), dir_ / "killed0.txt", {"OMP_NUM_THREADS=1", kills});
  ASSERT_EQ(exit_code(node0.wait(120s)), 0) << read_text(dir_ / "killed0.txt");
  ASSERT_EQ(exit_code(node1.wait(30s)), 0) << read_text(dir_ / "killed1.txt");
  for (const std::string& console : {read_text(dir_ / "killed0.txt"), read_text(dir_ / "killed1.txt")}) {
    EXPECT_NE(console.find("node 1: worker local rank 0 (pid "), std::string::npos) << console;
    EXPECT_NE(console.find("restart 1 of 2"), std::string::npos) << console;
    EXPECT_NE(console.find("node 0: worker local rank 0 (pid "), std::string::npos) << console;
    EXPECT_NE(console.find("restart 2 of 2"), std::string::npos) << console;
  }
  const Checkpoint got = load_checkpoint(killed + "/checkpoint"), expected = load_checkpoint(straight + "/checkpoint");
  EXPECT_EQ(got.step, expected.step);
  EXPECT_EQ(test::max_abs_diff(got.model, expected.model), 0);
  EXPECT_EQ(test::max_abs_diff(got.training, expected.training), 0);
  EXPECT_TRUE(test::processes_mentioning(killed).empty()) << "a worker of the restarted job outlived it";
}

TEST_F(MultiNode, TorchrunStyleProcessesRunAsOneWorkerEachWithoutForking) {
  std::vector<std::unique_ptr<Process>> ranks;
  const std::vector<std::string> args = {"--backend", "gloo", "--compression", "none", "--epochs", "1",
                                         "--data-dir", dir_ / "data", "--path", dir_ / "out", "--timeout", "20"};
  for (int r = 0; r < 3; ++r)
    ranks.push_back(std::make_unique<Process>(
        args, dir_ / ("rank" + std::to_string(r) + ".txt"),
        std::vector<std::string>{"RANK=" + std::to_string(r), "WORLD_SIZE=3", "LOCAL_RANK=" + std::to_string(r),
                                 "LOCAL_WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port_}));
  // While they train, none has a child.
  ASSERT_TRUE(eventually([&] { return read_text(dir_ / "out/mnist_train.log").find("Train Epoch: 0 [") != std::string::npos; }, 60s));
  for (const auto& p : ranks) EXPECT_TRUE(test::children_of(p->pid()).empty()) << "a worker forked";
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(exit_code(ranks[r]->wait(180s)), 0) << read_text(dir_ / ("rank" + std::to_string(r) + ".txt"));
  const std::string log = read_text(dir_ / "out/mnist_train.log");
  EXPECT_NE(log.find("Replicas: all 3 ranks hold identical parameters"), std::string::npos) << log;
}

TEST_F(MultiNode, ANodeThatNeverStartsIsATimeoutNamingIt) {
  auto args = node(0, 2, dir_ / "node0");
  args.back() = "4";  // --timeout 4
  const auto start = std::chrono::steady_clock::now();
  Process node0(args, dir_ / "node0.txt");
  const int code = exit_code(node0.wait(60s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s + 10s);
  EXPECT_EQ(code, 1);
  const std::string out = read_text(dir_ / "node0.txt");
  EXPECT_NE(out.find("node 1 of 2 never joined within 4 s: start mnist_ddp there with --nnodes 2 --node-rank"),
            std::string::npos)
      << out;
}

TEST_F(MultiNode, ASettingThatDiffersBetweenNodesIsRefusedByName) {
  Process node1(node(1, 1, dir_ / "node1", {"--batch-size", "64"}), dir_ / "node1.txt");
  Process node0(node(0, 2, dir_ / "node0"), dir_ / "node0.txt");
  EXPECT_EQ(exit_code(node0.wait(60s)), 1);
  EXPECT_EQ(exit_code(node1.wait(60s)), 1);
  for (const std::string& output : {dir_ / "node0.txt", dir_ / "node1.txt"}) {
    const std::string text = read_text(output);
    EXPECT_NE(text.find("--batch-size differs between ranks: rank 0 has '32', rank 2 has '64'"), std::string::npos)
        << output << ": " << text;
  }
}

// Node 1 dies whole (launcher and worker): node 0's workers name the rank
// they lost, and node 0's launcher, with a restart left, waits --timeout
// for node 1 to join the restart round, then ends the job naming it.
TEST_F(MultiNode, ANodeThatDiesStopsTheOthersNamingTheLostRankAndTheNodeThatNeverRejoins) {
  const std::vector<std::string> extra = {"--epochs", "50", "--max-restarts", "1", "--timeout", "4"};
  Process node1(node(1, 1, dir_ / "node1", extra), dir_ / "node1.txt");
  Process node0(node(0, 2, dir_ / "node0", extra), dir_ / "node0.txt");
  ASSERT_TRUE(eventually([&] { return read_text(dir_ / "node0/mnist_train.log").find("Train Epoch: 0 [") != std::string::npos; }, 60s));
  const auto killed = std::chrono::steady_clock::now();
  test::send_signal(node1.pid(), SIGKILL);  // node 1's worker dies with it
  const int code = exit_code(node0.wait(60s));
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 30s);
  EXPECT_NE(code, 0);
  const std::string out = read_text(dir_ / "node0.txt");
  EXPECT_NE(out.find("mnist_ddp: error: node 1 did not join restart 1 within 4 s (after node 0: rank "), std::string::npos)
      << out;
  EXPECT_NE(out.find("lost rank 2"), std::string::npos) << out;
  node1.wait(5s);
}

// Two machines for real: two network namespaces joined by a veth pair, each
// with its own address (test::TwoHosts).
TEST_F(MultiNode, TwoNodesOverAVirtualNetwork) {
  const test::TwoHosts hosts;
  if (!hosts.why_not().empty()) GTEST_SKIP() << hosts.why_not();
  auto in = [&](int host, std::vector<std::string> args) {
    args.insert(args.begin(), MNIST_DDP_BINARY);
    return hosts.in(host, args);
  };
  const std::vector<std::string> addr = {"--master-addr", hosts.address(0)};
  Process node1(in(1, node(1, 1, dir_ / "node1", addr)), dir_ / "node1.txt", {}, /*command=*/true);
  Process node0(in(0, node(0, 2, dir_ / "node0", addr)), dir_ / "node0.txt", {}, /*command=*/true);
  EXPECT_EQ(exit_code(node0.wait(180s)), 0) << read_text(dir_ / "node0.txt");
  EXPECT_EQ(exit_code(node1.wait(30s)), 0) << read_text(dir_ / "node1.txt");
  const std::string log = read_text(dir_ / "node0/mnist_train.log");
  EXPECT_NE(log.find("Replicas: all 3 ranks hold identical parameters"), std::string::npos) << log;
  EXPECT_NE(log.find("master_addr: 10.231.7.1"), std::string::npos) << log;
}

// Over a link shaped to 200 Mbit/s (a token bucket: what crosses queues
// behind what crossed before), every hook: each of a rank's two lanes
// (process_group.hpp) keeps its order, so each run ends with replicas
// bit-identical on every rank.
TEST_F(MultiNode, EveryHookOverAShapedLinkEndsWithIdenticalReplicas) {
  const test::TwoHosts hosts;
  if (!hosts.why_not().empty()) GTEST_SKIP() << hosts.why_not();
  if (!hosts.shape("200mbit")) GTEST_SKIP() << "tc cannot shape the veth here (no tbf)";
  for (const std::string& compression : kCompressions) {
    SCOPED_TRACE(compression);
    auto on = [&](int host, int nproc) {
      auto args = node(host, nproc, dir_ / (compression + std::to_string(host)),
                       {"--master-addr", hosts.address(0), "--compression", compression, "--max-steps", "8",
                        "--checkpoint-every", "0", "--log-interval", "2"});
      args.insert(args.begin(), MNIST_DDP_BINARY);
      return hosts.in(host, args);
    };
    Process node1(on(1, 1), dir_ / (compression + "1.txt"), {}, /*command=*/true);
    Process node0(on(0, 1), dir_ / (compression + "0.txt"), {}, /*command=*/true);
    EXPECT_EQ(exit_code(node0.wait(120s)), 0) << read_text(dir_ / (compression + "0.txt"));
    EXPECT_EQ(exit_code(node1.wait(30s)), 0) << read_text(dir_ / (compression + "1.txt"));
    const std::string log = read_text(dir_ / (compression + "0/mnist_train.log"));
    EXPECT_NE(log.find("Replicas: all 2 ranks hold identical parameters"), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace mnist_ddp
