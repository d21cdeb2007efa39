// The launcher as users meet it: real processes, real signals.
#include <gtest/gtest.h>

#include <sys/prctl.h>

#include <algorithm>
#include <regex>

#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::children_of;
using test::eventually;
using test::Process;
using test::process_exists;
using test::read_text;
using test::TempDir;

// A run long enough to be interrupted: ~60 steps per epoch on 2 workers.
std::vector<std::string> long_run(const TempDir& dir) {
  test::write_synthetic_mnist(dir / "data", 4000, 200);
  return {"--backend", "gloo", "--nproc", "2", "--epochs", "3", "--compression", "none", "--log-interval", "2",
          "--data-dir", dir / "data", "--path", dir / "out", "--timeout", "60"};
}

int rank_of(pid_t pid) {
  const std::string env = read_text("/proc/" + std::to_string(pid) + "/environ");
  std::smatch m;
  std::regex re(std::string("(^|") + '\0' + ")LOCAL_RANK=([0-9]+)");
  if (std::regex_search(env, m, re)) return std::stoi(m[2]);
  return -1;
}

// Starts the launcher and waits until both workers train.
std::vector<pid_t> start_training(Process& launcher, const std::string& output) {
  EXPECT_TRUE(eventually([&] { return read_text(output).find("Train Epoch: 0 [4/") != std::string::npos; }, 60s))
      << read_text(output);
  const auto workers = children_of(launcher.pid());
  EXPECT_EQ(workers.size(), 2u);
  return workers;
}

void expect_all_gone(const std::vector<pid_t>& workers) {
  for (pid_t w : workers) EXPECT_FALSE(process_exists(w)) << "worker " << w << " is still there";
}

TEST(Launcher, CtrlCStopsEveryWorkerAndExits130) {
  TempDir dir;
  const std::string out = dir / "output.txt";
  Process launcher(long_run(dir), out);
  const auto workers = start_training(launcher, out);
  const auto sent = std::chrono::steady_clock::now();
  kill(-launcher.pid(), SIGINT);  // the whole process group, as a terminal's Ctrl-C
  const int status = launcher.wait(30s);
  ASSERT_NE(status, -1) << "launcher still running 30 s after SIGINT";
  // The workers leave on SIGTERM: nobody waits out the 5 s before SIGKILL.
  EXPECT_LT(std::chrono::steady_clock::now() - sent, 4s);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  EXPECT_NE(read_text(out).find("KeyboardInterrupt received. Terminating processes..."), std::string::npos);
  expect_all_gone(workers);
}

TEST(Launcher, SigtermToTheLauncherAloneStopsTheWorkersAndExits143) {
  TempDir dir;
  const std::string out = dir / "output.txt";
  Process launcher(long_run(dir), out);
  const auto workers = start_training(launcher, out);
  kill(launcher.pid(), SIGTERM);
  const int status = launcher.wait(10s);
  ASSERT_NE(status, -1);
  EXPECT_EQ(WEXITSTATUS(status), 143);
  expect_all_gone(workers);
}

TEST(Launcher, AWorkerThatDiesStopsTheRestAndIsNamed) {
  TempDir dir;
  const std::string out = dir / "output.txt";
  Process launcher(long_run(dir), out);
  const auto workers = start_training(launcher, out);
  pid_t victim = -1;
  for (pid_t w : workers)
    if (rank_of(w) == 1) victim = w;
  ASSERT_GT(victim, 0);
  const auto sent = std::chrono::steady_clock::now();
  kill(victim, SIGKILL);
  const int status = launcher.wait(60s);
  ASSERT_NE(status, -1) << "launcher still running 60 s after a worker died";
  // Seen at once (SIGCHLD), the survivor stopped with SIGTERM: well inside
  // the 5 s grace period and the 3 s wait for a cause behind an echo.
  EXPECT_LT(std::chrono::steady_clock::now() - sent, 8s);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 0);
  const std::string text = read_text(out);
  EXPECT_NE(text.find("worker rank 1 (pid " + std::to_string(victim) + ") was killed by signal 9"), std::string::npos)
      << text;
  expect_all_gone(workers);
}

TEST(Launcher, WorkersDieWithTheLauncher) {
  TempDir dir;
  const std::string out = dir / "output.txt";
  Process launcher(long_run(dir), out);
  const auto workers = start_training(launcher, out);
  // Orphans would be reparented to us and reaped here, so none lingers as a zombie.
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  kill(launcher.pid(), SIGKILL);
  launcher.wait(5s);
  EXPECT_TRUE(eventually(
      [&] {
        while (waitpid(-1, nullptr, WNOHANG) > 0) {
        }
        for (pid_t w : workers)
          if (process_exists(w)) return false;
        return true;
      },
      10s));
  prctl(PR_SET_CHILD_SUBREAPER, 0);
}

TEST(Launcher, BadInputIsOneLineAndNoWorkerStarts) {
  TempDir dir;
  const std::string out = dir / "output.txt";
  Process missing({"--backend", "gloo", "--data-dir", dir / "nowhere", "--path", dir / "out"}, out);
  const int status = missing.wait(20s);
  ASSERT_NE(status, -1);
  EXPECT_EQ(WEXITSTATUS(status), 1);
  const std::string text = read_text(out);
  EXPECT_NE(text.find("MNIST data not found"), std::string::npos) << text;
  EXPECT_NE(text.find("scripts/fetch_data.sh mnist"), std::string::npos) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1) << text;

  Process usage({"--batch-size", "0"}, out);
  ASSERT_EQ(WEXITSTATUS(usage.wait(20s)), 2);
  EXPECT_EQ(read_text(out), "mnist_ddp: error: --batch-size: must be a positive integer, got '0'\n");
}

}  // namespace
}  // namespace mnist_ddp
