// Under a real Slurm: a one-node cluster of this machine's own, set up and
// torn down by the test (tests/slurm/cluster.sh), running the project's
// sbatch script as a user would.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <regex>
#include <set>

#include "app/train/checkpoint.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::eventually;
using test::Process;
using test::read_text;
using test::TempDir;

using test::shell;

std::string field(const std::string& text, const std::string& key) {
  std::smatch m;
  return std::regex_search(text, m, std::regex("(^|\\s)" + key + "=(\\S*)")) ? m[2].str() : "";
}

class Slurm : public ::testing::Test {
 protected:
  void SetUp() override {
    cluster_ = std::string(MNIST_DDP_SOURCE_DIR) + "/tests/slurm/cluster.sh";
    int status = 0;
    const std::string up = shell("bash " + cluster_ + " up " + dir_.path() + " 2>" + (dir_ / "cluster.err"), &status);
    if (status == 77) GTEST_SKIP() << "no Slurm here (" << read_text(dir_ / "cluster.err") << "): scripts/install_deps.sh installs it";
    ASSERT_EQ(status, 0) << read_text(dir_ / "cluster.err");
    conf_ = up.substr(up.find('=') + 1, up.find('\n') - up.find('=') - 1);
    started_ = true;
  }
  void TearDown() override {
    if (started_) shell("bash " + cluster_ + " down " + dir_.path());
  }
  // A Slurm command with this cluster's configuration.
  std::string slurm(const std::string& command, int* status = nullptr) {
    return shell("export SLURM_CONF='" + conf_ + "'; " + command + " 2>&1", status);
  }
  // The daemons' last words, for a failure's message.
  std::string daemon_logs() {
    return shell("tail -n 15 '" + (dir_ / "slurmctld.log") + "' '" + (dir_ / "slurmd.log") + "'");
  }
  std::string job_field(const std::string& job, const std::string& key) {
    return field(slurm("scontrol -o show job " + job), key);
  }
  TempDir dir_;
  std::string cluster_, conf_;
  bool started_ = false;
};

// The project's sbatch script with 2 tasks, preempted twice: by the
// scheduler, for a job of a higher partition (SIGTERM to the tasks), then by
// SIGUSR1 to the batch shell and every task (scancel --full). Each time the tasks checkpoint the step they are
// on, the shell survives and requeues the job, the job goes on from that
// checkpoint, and it ends as the straight run does, bit for bit. The
// output file keeps every run's lines; the store's port follows the job;
// flags that the environment overrides are reported as overridden.
TEST_F(Slurm, APreemptedJobRequeuesResumesAndEndsAsTheStraightRun) {
  test::write_synthetic_mnist(dir_ / "data", 1024, 256);
  const std::vector<std::string> args = {"--backend", "gloo", "--data-dir", dir_ / "data", "--compression",
                                         "powersgd_fp16", "--start-powersgd-iter", "10", "--log-interval", "5",
                                         "--epochs", "1"};
  std::vector<std::string> straight_args = args;
  straight_args.insert(straight_args.end(), {"--nproc", "2", "--path", dir_ / "straight"});
  {
    Process straight(straight_args, dir_ / "straight.txt");
    const int status = straight.wait(300s);
    ASSERT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_text(dir_ / "straight.txt");
  }

  // Rank 0 waits after a random step of each of the first two runs until a
  // preemption signal reaches it (trainer.cpp's test seam): the job is
  // surely mid-run when the scheduler signals it.
  std::mt19937 random(test::test_seed());
  // Steps of the 16 of the epoch; PowerSGD starts at step 10.
  const int first = 2 + static_cast<int>(random() % 6), second = first + 2 + static_cast<int>(random() % 6);
  const std::string pauses = "0:0:" + std::to_string(first) + ",1:0:" + std::to_string(second);
  SCOPED_TRACE("MNIST_DDP_PAUSE_AFTER_STEP=" + pauses);
  const std::string path = dir_ / "slurm";
  std::string submit = "cd '" + std::string(MNIST_DDP_SOURCE_DIR) + "' && MNIST_DDP='" + MNIST_DDP_BINARY +
                       "' MNIST_DDP_PAUSE_AFTER_STEP=" + pauses + " sbatch --parsable --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 " +
                       "--cpus-per-task=1 --time=10 --output='" + (dir_ / "job-%j.out") +
                       "' scripts/slurm_mnist_ddp.sbatch --master-port 1234 --nproc 4 --path '" + path + "'";
  for (const auto& a : args) submit += " '" + a + "'";
  int status = 0;
  std::string job = slurm(submit, &status);
  ASSERT_EQ(status, 0) << job;
  job = job.substr(0, job.find_first_of(";\n"));
  const std::string output = dir_ / ("job-" + job + ".out");

  // A requeued job is held for Slurm's requeue delay (2 minutes): skipped
  // while the test waits, 2 s after the requeue (slurmd refuses to launch
  // a job in the second its previous run was killed: "Job credential
  // revoked", 1 time in 5 when started at once). Slurm 24 also requeues a
  // preempted job itself, besides the script: a preemption may count two
  // restarts there.
  std::string seen_restarts = "0";
  auto requeued_at = std::chrono::steady_clock::now();
  auto unless_held = [&](const std::function<bool()>& done) {
    return [&, done] {
      const std::string text = slurm("scontrol -o show job " + job);
      if (field(text, "Restarts") != seen_restarts) {
        seen_restarts = field(text, "Restarts");
        requeued_at = std::chrono::steady_clock::now();
      }
      if (field(text, "Reason") == "BeginTime" && std::chrono::steady_clock::now() - requeued_at > 2s)
        slurm("scontrol update jobid=" + job + " StartTime=now");
      return done();
    };
  };
  for (const std::string signal : {"TERM", "USR1"}) {
    SCOPED_TRACE("SIG" + signal);
    const int paused = signal == "TERM" ? 0 : 1;
    ASSERT_TRUE(eventually(unless_held([&] {
      return test::count_lines_with(read_text(path + "/mnist_train.log"), "Paused after step") > paused;
    }), 120s)) << read_text(output) << slurm("scontrol -o show job " + job);
    const int restarts = std::stoi("0" + job_field(job, "Restarts"));
    if (signal == "TERM")  // a job of a higher partition preempts it: SIGTERM to its tasks, then a requeue
      slurm("sbatch --partition=urgent --ntasks=2 --cpus-per-task=1 --output=/dev/null --wrap=true");
    else  // to the batch shell and every task, as scancel --full and --signal=B:USR1 send it
      slurm("scancel --full --signal=USR1 " + job);
    ASSERT_TRUE(eventually([&] { return std::stoi("0" + job_field(job, "Restarts")) > restarts; }, 120s))
        << read_text(output) << slurm("scontrol -o show job " + job);
  }
  const std::set<std::string> ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"};
  ASSERT_TRUE(eventually(unless_held([&] { return ended.count(job_field(job, "JobState")) > 0; }), 240s))
      << read_text(output) << slurm("scontrol -o show job " + job);
  ASSERT_EQ(job_field(job, "JobState"), "COMPLETED") << read_text(output) << slurm("scontrol -o show job " + job)
                                                     << daemon_logs();

  const std::string console = read_text(output), log = read_text(path + "/mnist_train.log");
  EXPECT_NE(console.find("preempted (exit 143); requeueing job " + job), std::string::npos) << console;
  EXPECT_NE(console.find("preempted (exit 138); requeueing job " + job), std::string::npos) << console;
  EXPECT_NE(log.find("Preempted by SIGTERM: every rank stopped after step"), std::string::npos) << log;
  EXPECT_NE(log.find("Preempted by SIGUSR1: every rank stopped after step"), std::string::npos) << log;
  const Json summary = test::read_summary(path);
  EXPECT_EQ(summary.at("world").at("ranks").get<double>(), 2);
  EXPECT_GE(summary.at("world").at("restart").get<double>(), 2);  // SLURM_RESTART_COUNT
  // The port follows the job, and what the environment decided is what is reported.
  const std::string port = std::to_string(20000 + std::stoi(job) % 10000);
  EXPECT_EQ(summary.at("arguments").at("master_port").get<std::string>(), port);
  EXPECT_EQ(summary.at("arguments").at("nproc").get<std::string>(), "2");
  EXPECT_NE(log.find("the launcher's environment overrides the command line: --master-port " + port +
                     " (given 1234), --nproc 2 (given 4)"),
            std::string::npos) << log;

  const Checkpoint got = load_checkpoint(path + "/checkpoint"), expected = load_checkpoint(dir_ / "straight/checkpoint");
  EXPECT_EQ(got.step, expected.step);
  EXPECT_EQ(test::max_abs_diff(got.model, expected.model), 0);
  EXPECT_EQ(test::max_abs_diff(got.training, expected.training), 0);
}

}  // namespace
}  // namespace mnist_ddp
