// The supervisor on its own, with ordinary programs as children: failures
// and their reports, signals, stopping, and no child left behind.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "app/launch/supervisor.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;

// The supervised signals blocked in this thread for the test's length, as
// main() blocks them in the launcher.
class BlockedSignals {
 public:
  BlockedSignals() : original_(block_launcher_signals()) {}
  ~BlockedSignals() {
    // Whatever this test sent itself and left unread is dropped with the mask.
    const timespec none{0, 0};
    sigset_t mask;
    sigemptyset(&mask);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) sigaddset(&mask, sig);
    while (sigtimedwait(&mask, nullptr, &none) > 0) {
    }
    sigprocmask(SIG_SETMASK, &original_, nullptr);
  }
  const sigset_t& original() const { return original_; }

 private:
  sigset_t original_;
};

std::vector<std::string> bash(const std::string& script) { return {"bash", "-c", script}; }

TEST(Supervisor, AFailedChildIsReportedWithItsStatusAndTheOthersAreStopped) {
  BlockedSignals signals;
  Supervisor supervisor(signals.original());
  supervisor.start(0, "/bin/bash", bash("exit 3"), {});
  supervisor.start(1, "/bin/sleep", {"sleep", "30"}, {});
  const auto event = supervisor.wait(10s);
  ASSERT_TRUE(event.failure);
  EXPECT_EQ(event.signal, 0);
  EXPECT_EQ(event.failure->index, 0);
  EXPECT_EQ(exit_code_of(event.failure->status), 3);
  EXPECT_EQ(describe_status(event.failure->status), "exited with status 3");
  EXPECT_FALSE(event.failure->report);
  EXPECT_TRUE(supervisor.any_running());  // the sleep
  const auto start = std::chrono::steady_clock::now();
  supervisor.stop(SIGTERM, 5s);
  EXPECT_FALSE(supervisor.any_running());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "sleep ends at SIGTERM; no SIGKILL was needed";
}

TEST(Supervisor, ChildrenThatSucceedEndTheWaitWithoutAFailure) {
  BlockedSignals signals;
  Supervisor supervisor(signals.original());
  for (int i = 0; i < 3; ++i) supervisor.start(i, "/bin/true", {"true"}, {});
  while (supervisor.any_running()) {
    const auto event = supervisor.wait(10s);
    EXPECT_FALSE(event.failure);
    EXPECT_EQ(event.signal, 0);
  }
}

// A child that only echoes another's failure (it lost its peer) is passed
// over for the cause another child reports a moment later.
TEST(Supervisor, TheCauseAChildReportsIsPreferredToAnEchoOfIt) {
  BlockedSignals signals;
  Supervisor supervisor(signals.original());
  const std::vector<std::string> env = {"FD=" + std::to_string(supervisor.report_fd())};
  supervisor.start(0, "/bin/bash", bash(R"(printf '0\techo\trank 0: lost rank 1\n' >&"$FD"; exit 1)"), env);
  supervisor.start(1, "/bin/bash", bash(R"(sleep 0.3; printf '1\tcause\trank 1: out of memory\n' >&"$FD"; exit 1)"),
                   env);
  const auto event = supervisor.wait(10s);
  ASSERT_TRUE(event.failure);
  EXPECT_EQ(event.failure->index, 1);
  ASSERT_TRUE(event.failure->report);
  EXPECT_FALSE(event.failure->echo());
  EXPECT_EQ(event.failure->report->message, "rank 1: out of memory");
}

TEST(Supervisor, ASignalToTheProcessIsReturnedAndPassedOn) {
  BlockedSignals signals;
  Supervisor supervisor(signals.original());
  supervisor.start(0, "/bin/sleep", {"sleep", "30"}, {});
  EXPECT_EQ(supervisor.wait(100ms).signal, 0) << "nothing happened within 100 ms";
  raise(SIGUSR1);  // blocked in this thread: it waits for the signalfd
  const auto event = supervisor.wait(10s);
  EXPECT_EQ(event.signal, SIGUSR1);
  EXPECT_FALSE(event.failure);
  supervisor.stop(SIGUSR1, 5s);  // sleep's default for SIGUSR1: it ends
  EXPECT_FALSE(supervisor.any_running());
}

TEST(Supervisor, AChildThatIgnoresSigtermIsKilledAfterTheGracePeriod) {
  BlockedSignals signals;
  Supervisor supervisor(signals.original());
  supervisor.start(0, "/bin/bash", bash("trap '' TERM; exec sleep 30"), {});  // ignored across exec
  std::this_thread::sleep_for(200ms);
  const auto start = std::chrono::steady_clock::now();
  supervisor.stop(SIGTERM, 300ms);
  EXPECT_FALSE(supervisor.any_running());
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 5s);
}

TEST(Supervisor, NoChildOutlivesTheSupervisor) {
  BlockedSignals signals;
  std::vector<pid_t> children;
  // Only the supervisor's: an earlier test in this process may have left
  // a zombie here (a launcher's watcher, when this process is a subreaper).
  const std::vector<pid_t> before = test::children_of(getpid());
  {
    Supervisor supervisor(signals.original());
    supervisor.start(0, "/bin/sleep", {"sleep", "30"}, {});
    supervisor.start(1, "/bin/bash", bash("exec sleep 30"), {});
    for (pid_t pid : test::children_of(getpid()))
      if (std::find(before.begin(), before.end(), pid) == before.end()) children.push_back(pid);
  }
  ASSERT_GE(children.size(), 2u);
  for (pid_t pid : children) EXPECT_FALSE(test::process_exists(pid)) << pid << " outlived its supervisor";
}

TEST(Supervisor, AProgramThatCannotStartFailsWithStatus127) {
  BlockedSignals signals;
  Supervisor supervisor(signals.original());
  supervisor.start(0, "/nonexistent/program", {"program"}, {});
  const auto event = supervisor.wait(10s);
  ASSERT_TRUE(event.failure);
  EXPECT_EQ(exit_code_of(event.failure->status), 127);
}

}  // namespace
}  // namespace mnist_ddp
