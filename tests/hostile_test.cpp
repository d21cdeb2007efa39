// A hostile round: a process that reaches the store tries to steer the job,
// and cases that used to end wrong (a restart that succeeded, a preemption
// that reached only the workers, a finished run resumed, another thread
// count, a node count that differs, a partition). Each ends in the one
// line it should, with nothing left running.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <thread>

#include "app/base/files.hpp"
#include "comm/store.hpp"
#include "run_util.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::eventually;
using test::exit_code;
using test::Process;
using test::read_text;

class Hostile : public test::JobsOnThisMachine {
 protected:
  std::vector<std::string> job(const std::string& path, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--backend", "gloo", "--nproc", "2", "--data-dir", dir_ / "data", "--path", path,
                                     "--compression", "none", "--log-interval", "1000", "--timeout", "15"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
};

// A client of the store at `port` that writes what it likes: a neighbour.
// Opened as the job opens its own (a LibTorch without libuv refuses a
// client that asks for it).
c10::intrusive_ptr<c10d::TCPStore> neighbour(int port) {
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::string why;
  EXPECT_TRUE(eventually(
      [&] {
        try {
          store = open_store("127.0.0.1", port, false, 2s);
          return true;
        } catch (const std::exception& e) {
          why = e.what();
          return false;
        }
      },
      60s))
      << why;
  return store;
}

int error_lines(const std::string& output) {
  int n = 0;
  for (size_t at = output.find("mnist_ddp: error"); at != std::string::npos; at = output.find("mnist_ddp: error", at + 1))
    ++n;
  return n;
}

// One node: the keys a neighbour knows from our source (a node's claim,
// its worker count, the shared-memory segment, a restart's cause) are not
// the job's, whose keys live under a prefix the launcher drew. A worker
// killed at step 12 restarts as ever, and the job ends 0 without an error
// line, saying it took one restart.
TEST_F(Hostile, ANeighbourOnTheStoreCannotSteerAJobOnOneNode) {
  const std::string out = dir_ / "out";
  Process p(job(out, {"--master-port", port_, "--epochs", "1", "--max-steps", "30", "--checkpoint-steps", "5",
                      "--max-restarts", "1"}),
            dir_ / "out.txt", {"MNIST_DDP_KILL_AFTER_STEP=0:1:12"});
  auto store = neighbour(std::stoi(port_));
  ASSERT_TRUE(store);
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"round/1/nodes/0/claim", "mnist_ddp launcher pid 1 on vm"},
           {"round/0/nodes/0/size", "1"},
           {"round/1/nodes/0/size", "1"},
           {"round/0/main/shared_memory", "/mnist_ddp.evil"},
           {"round/1/main/shared_memory", "/mnist_ddp.evil"},
           {"restart/1/cause", "node 0: a neighbour wrote this"}})
    store->set(key, bytes_of(value));
  const int code = exit_code(p.wait(180s));
  const std::string output = read_text(dir_ / "out.txt");
  EXPECT_EQ(code, 0) << output;
  EXPECT_EQ(error_lines(output), 0) << output;
  EXPECT_NE(output.find("mnist_ddp: the job finished after 1 restart(s)"), std::string::npos) << output;
  const std::string log = read_text(out + "/mnist_train.log");
  EXPECT_NE(log.find("Replicas: all 2 ranks hold identical parameters"), std::string::npos) << log;
  EXPECT_EQ(log.find("over 1 rank(s)"), std::string::npos) << log;
}

// Two nodes that share a secret: a neighbour's restart cause is not a
// node's word. Then node 1's launcher is preempted: every rank stops after
// one step, and node 0 names node 1, without an error line on either.
TEST_F(Hostile, NodesSharingASecretTakeNoNeighboursWordAndAPreemptedNodeIsNamed) {
  auto node = [&](int rank) {
    return job(dir_ / ("node" + std::to_string(rank)),
               {"--nnodes", "2", "--node-rank", std::to_string(rank), "--nproc", "1", "--master-port", port_,
                "--epochs", "30", "--checkpoint-steps", "3"});
  };
  const std::vector<std::string> env = {"MNIST_DDP_SECRET=our job's own"};
  Process node1(node(1), dir_ / "node1.txt", env);
  Process node0(node(0), dir_ / "node0.txt", env);
  ASSERT_TRUE(eventually([&] { return read_text(dir_ / "node0/mnist_train.log").find("Train Epoch") != std::string::npos; }, 60s))
      << read_text(dir_ / "node0.txt");
  auto store = neighbour(std::stoi(port_));
  ASSERT_TRUE(store);
  store->set("restart/1/cause", bytes_of("node 1: a neighbour wrote this"));
  store->set("preempted/0", bytes_of("node 0: SIGUSR1"));
  std::this_thread::sleep_for(2s);  // the launchers look for a cause every 250 ms
  EXPECT_EQ(waitpid(node0.pid(), nullptr, WNOHANG), 0) << read_text(dir_ / "node0.txt");
  test::send_signal(node1.pid(), SIGTERM);
  const int code0 = exit_code(node0.wait(60s)), code1 = exit_code(node1.wait(60s));
  const std::string out0 = read_text(dir_ / "node0.txt"), out1 = read_text(dir_ / "node1.txt");
  EXPECT_EQ(code0, 143) << out0;
  EXPECT_EQ(code1, 143) << out1;
  EXPECT_NE(out0.find("mnist_ddp: node 1 was preempted (SIGTERM to its launcher)"), std::string::npos) << out0;
  EXPECT_EQ(error_lines(out0) + error_lines(out1), 0) << out0 << out1;
  EXPECT_EQ(out0.find("neighbour"), std::string::npos) << out0;
  EXPECT_EQ(out0.find("MNIST_DDP_SECRET"), std::string::npos) << "a warning though the nodes share a secret:\n" << out0;
}

// SIGTERM to the workers alone, as a scheduler sends it: a preemption,
// never restarted as a failure, exit 143 with the preemption line.
TEST_F(Hostile, SigtermToTheWorkersAloneIsAPreemptionNotAFailure) {
  const std::string out = dir_ / "out";
  Process p(job(out, {"--epochs", "1", "--max-restarts", "1", "--checkpoint-steps", "3"}), dir_ / "out.txt",
            {"MNIST_DDP_PAUSE_AFTER_STEP=0:0:6,0:1:6"});
  ASSERT_TRUE(eventually([&] { return read_text(out + "/mnist_train.log").find("Paused after step 6") != std::string::npos; }, 60s))
      << read_text(dir_ / "out.txt");
  std::vector<pid_t> workers;
  ASSERT_TRUE(eventually([&] { return (workers = test::children_of(p.pid())).size() == 2; }, 10s));
  for (pid_t w : workers) test::send_signal(w, SIGTERM);
  const int code = exit_code(p.wait(90s));
  const std::string output = read_text(dir_ / "out.txt");
  EXPECT_EQ(code, 143) << output;
  EXPECT_NE(output.find("mnist_ddp: the workers were preempted (SIGTERM): every rank stopped after the step they "
                        "agreed on, checkpointed in"),
            std::string::npos)
      << output;
  EXPECT_EQ(error_lines(output), 0) << output;
  EXPECT_EQ(output.find("restart 1 of"), std::string::npos) << output;
}

// A run to its end, resumed: nothing to train, every file as it was. Then
// resumed with another thread count: said in one line, as the run cannot
// end bit-identical to one never stopped.
TEST_F(Hostile, AFinishedRunResumedChangesNoFileAndAnotherThreadCountIsNamed) {
  const std::string out = dir_ / "out";
  const auto args = job(out, {"--epochs", "1", "--max-steps", "8", "--checkpoint-steps", "4"});
  ASSERT_EQ(exit_code(Process(args, dir_ / "a.txt", {"OMP_NUM_THREADS=2"}).wait(120s)), 0) << read_text(dir_ / "a.txt");
  const std::vector<std::string> kept = {"summary.json", "metrics.csv", "mnist_model.pt", "checkpoint/manifest"};
  std::vector<std::string> before;
  for (const auto& f : kept) before.push_back(read_text(out + "/" + f));
  ASSERT_NE(before[0].find("best_test_top1"), std::string::npos) << before[0];

  auto resumed = args;
  resumed.insert(resumed.end(), {"--resume", "auto"});
  ASSERT_EQ(exit_code(Process(resumed, dir_ / "b.txt", {"OMP_NUM_THREADS=2"}).wait(120s)), 0) << read_text(dir_ / "b.txt");
  const std::string b = read_text(dir_ / "b.txt");
  EXPECT_NE(b.find("Nothing to train: the checkpoint in " + out + "/checkpoint has finished its --max-steps 8 steps"),
            std::string::npos)
      << b;
  EXPECT_EQ(b.find("bit-identical"), std::string::npos) << b;
  for (size_t i = 0; i < kept.size(); ++i) EXPECT_EQ(read_text(out + "/" + kept[i]), before[i]) << kept[i] << " changed";

  resumed.insert(resumed.end(), {"--max-steps", "12"});
  ASSERT_EQ(exit_code(Process(resumed, dir_ / "c.txt", {"OMP_NUM_THREADS=1"}).wait(120s)), 0) << read_text(dir_ / "c.txt");
  const std::string c = read_text(dir_ / "c.txt");
  EXPECT_NE(c.find("The checkpoint was written with 2 intra-op thread(s) on rank 0 and this run has 1 (2 rank(s) differ)"),
            std::string::npos)
      << c;
  EXPECT_NE(c.find("will not end bit-identical"), std::string::npos) << c;
}

// Two launchers that disagree on --nnodes: the disagreement, named at once,
// not a node that "never joined"; the other node (whose store went with
// node 0) ends too.
TEST_F(Hostile, NodesStartedWithOtherNodeCountsAreNamed) {
  auto node = [&](int rank, int nnodes) {
    return job(dir_ / ("node" + std::to_string(rank)),
               {"--nnodes", std::to_string(nnodes), "--node-rank", std::to_string(rank), "--nproc", "1",
                "--master-port", port_, "--epochs", "1"});
  };
  Process node1(node(1, 3), dir_ / "node1.txt");
  Process node0(node(0, 2), dir_ / "node0.txt");
  const int code0 = exit_code(node0.wait(60s)), code1 = exit_code(node1.wait(60s));
  const std::string out0 = read_text(dir_ / "node0.txt"), out1 = read_text(dir_ / "node1.txt");
  EXPECT_EQ(code0, 2) << out0;
  EXPECT_NE(code1, 0) << out1;
  EXPECT_NE(out0.find("the nodes disagree on the job's size: node 0 was started with --nnodes 2, node 1 with --nnodes 3"),
            std::string::npos)
      << out0;
  EXPECT_EQ(out1.find("never joined"), std::string::npos) << out1;
}

// The link between two nodes goes down for longer than --timeout: each
// names what it lost and the timeout that ran out.
TEST_F(Hostile, APartitionedNodeNamesWhatItLostAndTheTimeout) {
  const test::TwoHosts hosts;
  if (!hosts.why_not().empty()) GTEST_SKIP() << hosts.why_not();
  auto on = [&](int host) {
    auto args = job(dir_ / ("node" + std::to_string(host)),
                    {"--nnodes", "2", "--node-rank", std::to_string(host), "--nproc", "1", "--master-addr",
                     hosts.address(0), "--master-port", port_, "--epochs", "20", "--timeout", "4"});
    args.insert(args.begin(), MNIST_DDP_BINARY);
    return hosts.in(host, args);
  };
  Process node1(on(1), dir_ / "node1.txt", {}, /*command=*/true);
  Process node0(on(0), dir_ / "node0.txt", {}, /*command=*/true);
  ASSERT_TRUE(eventually([&] { return read_text(dir_ / "node0/mnist_train.log").find("Train Epoch: 0 [") != std::string::npos; }, 60s))
      << read_text(dir_ / "node0.txt");
  ASSERT_TRUE(hosts.set_link(false));
  const int code0 = exit_code(node0.wait(60s)), code1 = exit_code(node1.wait(60s));
  hosts.set_link(true);
  const std::string out0 = read_text(dir_ / "node0.txt"), out1 = read_text(dir_ / "node1.txt");
  EXPECT_EQ(code0, 1) << out0;
  EXPECT_EQ(code1, 1) << out1;
  EXPECT_NE(out0.find("lost rank 1 (node 1): no word within --timeout 4 s"), std::string::npos) << out0;
  EXPECT_NE(out1.find("lost node 0 (rank 0 and the store it hosts): no word within --timeout 4 s"), std::string::npos)
      << out1;
}

}  // namespace
}  // namespace mnist_ddp
