// Every launcher a cluster uses, for real where this machine has it: Open
// MPI's mpirun, MPICH's mpiexec, torchrun's c10d rendezvous across two
// agents, and Kubeflow's two generations as their operators set the pods'
// environment. Each trains one job; no environment starts N jobs unseen.
#include <gtest/gtest.h>

#include <sys/prctl.h>

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

// The first of `programs` on PATH, "" when none is.
std::string program(const std::vector<std::string>& programs) {
  for (const auto& p : programs)
    if (std::system(("command -v " + p + " >/dev/null 2>&1").c_str()) == 0) return p;
  return "";
}

class Launchers : public test::JobsOnThisMachine {
 protected:
  // A worker's command line, the binary first: 1024 images, 16 steps on 2 ranks.
  std::vector<std::string> worker(const std::string& path, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {MNIST_DDP_BINARY, "--backend", "gloo", "--compression", "none", "--epochs", "1",
                                     "--log-interval", "4", "--data-dir", dir_ / "data", "--path", path,
                                     "--timeout", "30"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
  // `command` before `args`.
  static std::vector<std::string> under(std::vector<std::string> command, const std::vector<std::string>& args) {
    command.insert(command.end(), args.begin(), args.end());
    return command;
  }
  // Waits for `p`; returns its exit code, failing with its output on a timeout.
  int finish(Process& p, const std::string& output, std::chrono::seconds limit = 180s) {
    const int code = exit_code(p.wait(limit));
    EXPECT_NE(code, -1) << "still running after " << limit.count() << " s:\n" << read_text(output);
    return code;
  }
  // That `path` holds one job's run over `ranks` ranks, replicas identical.
  void expect_one_job(const std::string& path, int ranks) {
    const std::string log = read_text(path + "/mnist_train.log");
    EXPECT_NE(log.find("Replicas: all " + std::to_string(ranks) + " ranks hold identical parameters"),
              std::string::npos) << log;
    EXPECT_EQ(test::read_summary(path).at("world").at("ranks").get<double>(), ranks);
  }
};

// mpirun -np 2: each process one worker of one job (not two launchers of
// two jobs); then rank 1 killed mid-run ends the job with its cause.
TEST_F(Launchers, OpenMpisMpirunTrainsOneJobAndAKilledRankEndsIt) {
  const std::string mpirun = program({"mpirun.openmpi", "orterun"});
  if (mpirun.empty()) GTEST_SKIP() << "no Open MPI: install openmpi-bin (scripts/install_deps.sh test does)";
  const std::vector<std::string> np2 = {mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2"};
  Process job(under(np2, worker(dir_ / "mpi")), dir_ / "mpi.txt", {}, /*command=*/true);
  ASSERT_EQ(finish(job, dir_ / "mpi.txt"), 0) << read_text(dir_ / "mpi.txt");
  expect_one_job(dir_ / "mpi", 2);
  EXPECT_NE(read_text(dir_ / "mpi/mnist_train.log").find("nnodes: 1"), std::string::npos);

  auto killed = np2;
  killed.insert(killed.end(), {"-x", "MNIST_DDP_KILL_AFTER_STEP=0:1:6"});
  Process dies(under(killed, worker(dir_ / "killed")), dir_ / "killed.txt", {}, /*command=*/true);
  const int code = finish(dies, dir_ / "killed.txt");
  const std::string out = read_text(dir_ / "killed.txt");
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(out.find("rank 1"), std::string::npos) << "the output names the rank that died:\n" << out;
  EXPECT_TRUE(test::processes_mentioning(dir_ / "killed").empty()) << out;
}

TEST_F(Launchers, MpichsMpiexecTrainsOneJob) {
  const std::string mpiexec = program({"mpiexec.hydra", "mpiexec.mpich"});
  if (mpiexec.empty()) GTEST_SKIP() << "no MPICH: install mpich (scripts/install_deps.sh test does)";
  Process job(under({mpiexec, "-n", "2"}, worker(dir_ / "mpich")), dir_ / "mpich.txt", {}, /*command=*/true);
  ASSERT_EQ(finish(job, dir_ / "mpich.txt"), 0) << read_text(dir_ / "mpich.txt");
  expect_one_job(dir_ / "mpich", 2);
}

// Kubeflow's training-operator (v1) runs the container's command in each
// pod with this environment, one process per pod: no LOCAL_RANK, RANK the
// pod's index. Two pods train one job.
TEST_F(Launchers, KubeflowPyTorchJobPodsStartedWithoutTorchrunTrainOneJob) {
  std::vector<std::unique_ptr<Process>> pods;
  for (int pod = 0; pod < 2; ++pod)
    pods.push_back(std::make_unique<Process>(
        worker(dir_ / ("pod" + std::to_string(pod))), dir_ / ("pod" + std::to_string(pod) + ".txt"),
        std::vector<std::string>{"MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port_, "WORLD_SIZE=2",
                                 "RANK=" + std::to_string(pod), "PET_NNODES=2", "PET_NPROC_PER_NODE=1",
                                 "PET_NODE_RANK=" + std::to_string(pod), "PET_MASTER_ADDR=127.0.0.1",
                                 "PET_MASTER_PORT=" + port_},
        /*command=*/true));
  for (int pod = 0; pod < 2; ++pod) {
    const std::string output = dir_ / ("pod" + std::to_string(pod) + ".txt");
    EXPECT_EQ(finish(*pods[pod], output), 0) << read_text(output);
  }
  expect_one_job(dir_ / "pod0", 2);
}

// Kubeflow's Trainer (v2) sets only PET_*: each pod's process is that
// node's launcher, with the node count, rank, worker count and store the
// variables give. Over two network namespaces where this machine allows
// them, else over loopback.
TEST_F(Launchers, KubeflowTrainerPodsLaunchOneJobAsItsNodes) {
  const test::TwoHosts hosts;
  const bool apart = hosts.why_not().empty();
  if (!apart) std::cout << "[   NOTE   ] over loopback: " << hosts.why_not() << std::endl;
  const std::string addr = apart ? hosts.address(0) : "127.0.0.1";
  std::vector<std::unique_ptr<Process>> pods;
  for (int pod = 0; pod < 2; ++pod) {
    auto args = worker(dir_ / ("pod" + std::to_string(pod)), {"--nproc", "5"});  // PET_NPROC_PER_NODE decides
    pods.push_back(std::make_unique<Process>(
        apart ? hosts.in(pod, args) : args, dir_ / ("pod" + std::to_string(pod) + ".txt"),
        std::vector<std::string>{"PET_NNODES=2", "PET_NPROC_PER_NODE=1", "PET_NODE_RANK=" + std::to_string(pod),
                                 "PET_MASTER_ADDR=" + addr, "PET_MASTER_PORT=" + port_},
        /*command=*/true));
  }
  for (int pod = 0; pod < 2; ++pod) {
    const std::string output = dir_ / ("pod" + std::to_string(pod) + ".txt");
    EXPECT_EQ(finish(*pods[pod], output), 0) << read_text(output);
  }
  expect_one_job(dir_ / "pod0", 2);
  const std::string out = read_text(dir_ / "pod0.txt");
  EXPECT_NE(out.find("the launcher's environment overrides the command line: --nproc 1 (given 5)"),
            std::string::npos) << out;
  EXPECT_NE(read_text(dir_ / "pod0/mnist_train.log").find("master_addr: " + addr), std::string::npos);
}

// torchrun across machines: two agents meet at a c10d rendezvous, one
// worker each, and train one job; a worker killed under --max_restarts 1
// is restarted with the other, and the job ends as the straight run does.
TEST_F(Launchers, TorchrunsC10dRendezvousTrainsOneJobAcrossTwoAgentsAndRestarts) {
  const std::string python = test::python_with_torchrun();
  if (python.empty()) GTEST_SKIP() << "no torchrun: install python3-torch (scripts/install_deps.sh test does)";
  const std::string straight = dir_ / "straight";
  ASSERT_EQ(test::run(test::job(dir_ / "data", straight, "powersgd_fp16", {"--epochs", "1"}), dir_ / "straight.txt", 300s,
                      {test::kOneThread}),
            0)
      << read_text(dir_ / "straight.txt");
  const int kill_step = test::draw_kill_step();
  const std::string kills = "MNIST_DDP_KILL_AFTER_STEP=0:1:" + std::to_string(kill_step);
  SCOPED_TRACE(kills);
  std::vector<std::unique_ptr<Process>> agents;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> args = {python, std::string(MNIST_DDP_SOURCE_DIR) + "/tests/torchrun.py",
                                     "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                                     "--rdzv_endpoint", "127.0.0.1:" + port_, "--rdzv_id", "launchers",
                                     "--max_restarts", "1", "--redirects", "1", "--tee", "1", "--no_python"};
    auto worker_args = test::job(dir_ / "data", dir_ / ("node" + std::to_string(node)), "powersgd_fp16",
                                 {"--epochs", "1", "--checkpoint-steps", "4", "--resume", "auto"});
    const auto nproc = std::find(worker_args.begin(), worker_args.end(), "--nproc");
    worker_args.erase(nproc, nproc + 2);  // torchrun starts the workers
    args.push_back(MNIST_DDP_BINARY);
    args.insert(args.end(), worker_args.begin(), worker_args.end());
    // One thread a worker, as the straight run's (run_util.hpp).
    agents.push_back(std::make_unique<Process>(args, dir_ / ("agent" + std::to_string(node) + ".txt"),
                                               std::vector<std::string>{kills, test::kOneThread}, /*command=*/true));
  }
  for (int node = 0; node < 2; ++node) {
    const std::string output = dir_ / ("agent" + std::to_string(node) + ".txt");
    EXPECT_EQ(finish(*agents[node], output, 300s), 0) << read_text(output);
  }
  // Which agent's worker became rank 0 is the rendezvous's choice.
  const std::string rank0 = test::is_regular_file(dir_ / "node0/summary.json") ? dir_ / "node0" : dir_ / "node1";
  const Json summary = test::read_summary(rank0);
  EXPECT_EQ(summary.at("world").at("ranks").get<double>(), 2);
  EXPECT_EQ(summary.at("world").at("restart").get<double>(), 1);
  EXPECT_EQ(summary.at("resumed_from").at("step").get<double>(), kill_step / 4 * 4);
  test::expect_same_end(rank0, straight);
}

// Variables of a launcher mnist_ddp does not read (MVAPICH's here) say
// this process is one of several: it stops, rather than train alone.
TEST_F(Launchers, AnUnknownLaunchersRanksAreRefusedInOneLine) {
  for (const auto& vars : std::vector<std::vector<std::string>>{
           {"MV2_COMM_WORLD_RANK=1", "MV2_COMM_WORLD_SIZE=2"}, {"LOCAL_RANK=0", "LOCAL_WORLD_SIZE=4"}, {"RANK=3"}}) {
    Process p(worker(dir_ / "unknown"), dir_ / "unknown.txt", vars, /*command=*/true);
    EXPECT_EQ(finish(p, dir_ / "unknown.txt", 30s), 2);
    const std::string out = read_text(dir_ / "unknown.txt");
    EXPECT_EQ(test::count_lines_with(out, "mnist_ddp: error: environment: " + vars[0]), 1) << out;
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << "one line:\n" << out;
    EXPECT_FALSE(test::is_regular_file(dir_ / "unknown/mnist_train.log"));
  }
}

// A second job on a --path in use stops at once, naming the first, which
// goes on unharmed; once the first has ended, the path is free again.
TEST_F(Launchers, ASecondJobOnABusyPathIsRefusedAndTheFirstIsUnharmed) {
  const std::string path = dir_ / "busy";
  Process first(worker(path, {"--nproc", "2", "--epochs", "2"}), dir_ / "first.txt", {}, /*command=*/true);
  ASSERT_TRUE(eventually([&] { return read_text(path + "/mnist_train.log").find("Train Epoch: 0 [") != std::string::npos; },
                         60s)) << read_text(dir_ / "first.txt");
  Process second(worker(path, {"--nproc", "2"}), dir_ / "second.txt", {}, /*command=*/true);
  EXPECT_EQ(finish(second, dir_ / "second.txt", 30s), 1);
  const std::string out = read_text(dir_ / "second.txt");
  EXPECT_EQ(test::count_lines_with(out, "mnist_ddp: error: --path " + path + " is in use by another job "
                                        "(mnist_ddp launcher of node 0, pid " + std::to_string(first.pid()) + ")"),
            1) << out;
  EXPECT_EQ(finish(first, dir_ / "first.txt"), 0) << read_text(dir_ / "first.txt");
  expect_one_job(path, 2);
  Process third(worker(path, {"--nproc", "2", "--max-steps", "2"}), dir_ / "third.txt", {}, /*command=*/true);
  EXPECT_EQ(finish(third, dir_ / "third.txt"), 0) << read_text(dir_ / "third.txt");
}

}  // namespace
}  // namespace mnist_ddp
