// The launcher as users meet it: real processes, real signals.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <regex>
#include <sstream>

#include "app/base/placement.hpp"
#include "run_util.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using namespace std::chrono_literals;
using test::children_of;
using test::eventually;
using test::Process;
using test::process_exists;
using test::read_text;
using test::send_signal;
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
  send_signal(launcher.pid(), SIGINT, /*group=*/true);  // the whole process group, as a terminal's Ctrl-C
  const int status = launcher.wait(30s);
  ASSERT_NE(status, -1) << "launcher still running 30 s after SIGINT";
  // The workers leave on SIGTERM: nobody waits out the 5 s before SIGKILL.
  EXPECT_LT(std::chrono::steady_clock::now() - sent, 4s);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  EXPECT_NE(read_text(out).find("KeyboardInterrupt received. Terminating processes..."), std::string::npos);
  expect_all_gone(workers);
}

// Issue 55: the checks before the start stuck on a data file (a FIFO here,
// a hung network filesystem alike) still end on Ctrl-C or SIGTERM.
TEST(Launcher, ASignalEndsTheChecksBeforeTheStart) {
  TempDir dir;
  const std::string fifo = dir / "data/MNIST/raw/train-images-idx3-ubyte.gz";
  test::write_synthetic_mnist(dir / "data", 20, 10);
  std::remove(fifo.c_str());
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  for (const int sig : {SIGINT, SIGTERM}) {
    SCOPED_TRACE(strsignal(sig));
    const std::string out = dir / ("output-" + std::to_string(sig) + ".txt");
    Process launcher({"--nproc", "2", "--data-dir", dir / "data", "--path", dir / "out"}, out);
    // Open for writing only once the launcher reads it: then it waits for bytes.
    int writer = -1;
    ASSERT_TRUE(eventually([&] { return (writer = open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC)) >= 0; }, 30s));
    send_signal(launcher.pid(), sig, /*group=*/sig == SIGINT);
    const int status = launcher.wait(5s);
    close(writer);
    ASSERT_NE(status, -1) << "the launcher still checks 5 s after " << strsignal(sig);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + sig) << status;
    EXPECT_NE(read_text(out).find("received during the checks before the start"), std::string::npos) << read_text(out);
  }
}

TEST(Launcher, SigtermToTheLauncherAloneStopsTheWorkersAndExits143) {
  TempDir dir;
  const std::string out = dir / "output.txt";
  Process launcher(long_run(dir), out);
  const auto workers = start_training(launcher, out);
  send_signal(launcher.pid(), SIGTERM);
  const int status = launcher.wait(10s);
  ASSERT_NE(status, -1);
  EXPECT_EQ(WEXITSTATUS(status), 143);
  expect_all_gone(workers);
}

// A hangup (the terminal closed) stops the workers as Ctrl-C does, and
// they checkpoint and name it: SIGHUP, exit 129.
TEST(Launcher, ASighupIsNamedAsOne) {
  TempDir dir;
  const std::string out = dir / "output.txt";
  auto args = long_run(dir);
  args.insert(args.end(), {"--checkpoint-every", "1"});
  Process launcher(args, out);
  const auto workers = start_training(launcher, out);
  send_signal(launcher.pid(), SIGHUP);
  const int status = launcher.wait(30s);
  ASSERT_NE(status, -1);
  EXPECT_EQ(WEXITSTATUS(status), 129) << read_text(out);
  const std::string log = read_text(dir / "out/mnist_train.log");
  EXPECT_NE(log.find("Preempted by SIGHUP: every rank stopped after step "), std::string::npos) << log;
  EXPECT_EQ(log.find("SIGTERM"), std::string::npos) << log;
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
  send_signal(victim, SIGKILL);
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
  send_signal(launcher.pid(), SIGKILL);
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

// The signals blocked in every thread of process `pid` (SigBlk in /proc).
std::vector<uint64_t> blocked_per_thread(pid_t pid) {
  std::vector<uint64_t> out;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  for (const auto& tid : files::list_directory(tasks)) {
    const std::string status = read_text(tasks + "/" + tid + "/status");
    const size_t at = status.find("SigBlk:\t");
    if (at != std::string::npos) out.push_back(std::stoull(status.substr(at + 8, 16), nullptr, 16));
  }
  return out;
}

// A launcher that resumes loads the checkpoint before it starts the
// workers, and LibTorch may start a thread pool to do it: that thread must
// not take the signals the launcher waits for (SIGCHLD lost there left it
// waiting forever for workers that had exited). So every thread blocks
// them; the resumed job ends by itself, on SIGTERM, and on Ctrl-C.
TEST(Launcher, AResumingLauncherEndsAndStillAnswersSignals) {
  TempDir dir;
  const std::string out = dir / "output.txt";
  auto args = long_run(dir);
  {
    auto first = args;
    first.insert(first.end(), {"--max-steps", "4"});
    Process launcher(first, out);
    ASSERT_EQ(WEXITSTATUS(launcher.wait(120s)), 0) << read_text(out);
  }
  args.insert(args.end(), {"--resume", "auto"});
  for (const int sig : {SIGTERM, SIGINT}) {
    SCOPED_TRACE(strsignal(sig));
    const std::string out = dir / ("resumed-" + std::to_string(sig) + ".txt");
    Process launcher(args, out);
    ASSERT_TRUE(eventually([&] { return read_text(out).find("Startup: first step") != std::string::npos; }, 60s))
        << read_text(out);
    const auto workers = children_of(launcher.pid());
    EXPECT_EQ(workers.size(), 2u);
    const auto masks = blocked_per_thread(launcher.pid());
    ASSERT_FALSE(masks.empty());
    for (const uint64_t mask : masks)
      for (const int blocked : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGCHLD})
        EXPECT_TRUE(mask >> (blocked - 1) & 1) << "a thread of the launcher takes " << strsignal(blocked);
    send_signal(launcher.pid(), sig, /*group=*/sig == SIGINT);
    const int status = launcher.wait(90s);
    ASSERT_NE(status, -1) << "the resumed launcher still runs 90 s after " << strsignal(sig);
    EXPECT_EQ(WEXITSTATUS(status), 128 + sig) << read_text(out);
    expect_all_gone(workers);
  }
  auto to_the_end = args;
  to_the_end.insert(to_the_end.end(), {"--max-steps", "40"});
  Process launcher(to_the_end, out);
  const int status = launcher.wait(120s);
  ASSERT_NE(status, -1) << "the resumed launcher still runs 120 s after it started: " << read_text(out);
  EXPECT_EQ(WEXITSTATUS(status), 0) << read_text(out);
  EXPECT_NE(read_text(dir / "out/mnist_train.log").find("Stopping after --max-steps 40 steps"), std::string::npos);
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

  // More workers than the machine holds: one line before any starts.
  test::write_synthetic_mnist(dir / "data", 64, 32);
  Process many({"--backend", "gloo", "--nproc", "5000", "--data-dir", dir / "data", "--path", dir / "out"}, out);
  ASSERT_EQ(WEXITSTATUS(many.wait(20s)), 2) << read_text(out);
  EXPECT_NE(read_text(out).find("mnist_ddp: error: --nproc 5000: this machine has "), std::string::npos) << read_text(out);
  EXPECT_NE(read_text(out).find(" fit\n"), std::string::npos) << read_text(out);
}

// Whether `pid` is a running `sleep` (not a zombie, not a reused pid).
bool a_sleeper(pid_t pid) {
  const std::string proc = "/proc/" + std::to_string(pid);
  const std::string stat = read_text(proc + "/stat"), cmdline = read_text(proc + "/cmdline");
  const size_t after = stat.rfind(')');
  return after != std::string::npos && stat.size() > after + 2 && stat[after + 2] != 'Z' &&
         cmdline.rfind("sleep", 0) == 0;
}

// The process group and the session of process `pid` (from /proc); -1s when it is gone.
std::pair<long, long> group_and_session(pid_t pid) {
  const std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
  const size_t after = stat.rfind(')');
  long ppid = -1, group = -1, session = -1;
  char state = 0;
  if (after == std::string::npos ||
      std::sscanf(stat.c_str() + after + 1, " %c %ld %ld %ld", &state, &ppid, &group, &session) != 4)
    return {-1, -1};
  return {group, session};
}

// Each of the two programs under `mnist_ddp run` starts a background
// process (`&`: it stays in the program's process group, since a shell
// that is not interactive does no job control) and one under setsid (a
// session and process group of its own), then ends as the case says:
// every such descendant ends with the launcher, whichever way it ends
// (README: no process outlives the launcher).
TEST(Launcher, NoDescendantOutlivesTheLauncher) {
  // $0 is the folder; each rank writes its own pid, its descendants' (bg.<rank>, sid.<rank>), then ready.<rank>,
  // and ends as the case says once the test has looked at them (go).
  const std::string program = R"sh(d=$0; mode=$1
echo $$ > "$d/worker.$LOCAL_RANK"
sh -c 'echo $$ > "$0/bg.$1"; exec sleep 300' "$d" "$LOCAL_RANK" &
setsid sh -c 'echo $$ > "$0/sid.$1"; exec sleep 300' "$d" "$LOCAL_RANK" &
while [ ! -s "$d/bg.$LOCAL_RANK" ] || [ ! -s "$d/sid.$LOCAL_RANK" ]; do sleep 0.05; done
touch "$d/ready.$LOCAL_RANK"
while [ ! -e "$d/go" ]; do sleep 0.05; done
case "$mode$LOCAL_RANK" in ok*) exit 0;; fail0) exit 3;; esac
exec sleep 300)sh";
  struct Case {
    std::string name;
    int signal;  // sent once both programs are ready; 0 for none
    int code;
  };
  for (const Case& c : {Case{"ok", 0, 0}, Case{"fail", 0, 3}, Case{"ctrl-c", SIGINT, 130}, Case{"sigterm", SIGTERM, 143}}) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    const std::string out = dir / "output.txt";
    Process launcher({"run", "--nproc", "2", "--", "/bin/sh", "-c", program, dir.path(), c.name}, out);
    ASSERT_TRUE(eventually([&] { return files::exists(dir / "ready.0") && files::exists(dir / "ready.1"); }, 30s))
        << read_text(out);
    std::vector<pid_t> descendants;
    for (const std::string rank : {"0", "1"}) {
      const pid_t worker = std::atoi(read_text(dir / ("worker." + rank)).c_str());
      const pid_t background = std::atoi(read_text(dir / ("bg." + rank)).c_str());
      const pid_t setsid = std::atoi(read_text(dir / ("sid." + rank)).c_str());
      ASSERT_GT(worker, 1);
      ASSERT_GT(background, 1);
      ASSERT_GT(setsid, 1);
      descendants.insert(descendants.end(), {background, setsid});
      // What the comment above says: `&` stays in the worker's process group, setsid leaves it.
      EXPECT_EQ(group_and_session(background).first, group_and_session(worker).first);
      EXPECT_EQ(group_and_session(setsid), std::make_pair(long{setsid}, long{setsid}));
    }
    test::write_file(dir / "go", "", false);
    if (c.signal) send_signal(launcher.pid(), c.signal, /*group=*/c.signal == SIGINT);
    const int status = launcher.wait(30s);
    ASSERT_NE(status, -1) << read_text(out);
    EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), c.code) << read_text(out);
    EXPECT_TRUE(eventually([&] { return std::none_of(descendants.begin(), descendants.end(), a_sleeper); }, 3s))
        << "a descendant outlived the launcher";
    for (pid_t pid : descendants)
      if (a_sleeper(pid)) kill(pid, SIGKILL);  // ours: the pid is a sleep this case started
  }
}

// What a worker leaves running, five of each kind: in the background
// (`&`), under nohup, under setsid, after a double fork (its parent has
// exited), and as a daemon (daemon(3)). Each appends the pid of its
// `sleep` to <dir>/pids. And five more under setsid with an environment
// of their own (`env -i`), which only the cgroup can end: in <dir>/bare.
std::string leave_descendants(const std::string& dir) {
  return "d='" + dir + "'\nfor i in 1 2 3 4 5; do\n"
         "  sh -c 'echo $$ >> \"$0/pids\"; exec sleep 300' \"$d\" &\n"
         "  nohup sh -c 'echo $$ >> \"$0/pids\"; exec sleep 300' \"$d\" >/dev/null 2>&1 &\n"
         "  setsid sh -c 'echo $$ >> \"$0/pids\"; exec sleep 300' \"$d\" &\n"
         "  ( sh -c 'echo $$ >> \"$0/pids\"; exec sleep 300' \"$d\" & )\n"
         "  " MNIST_DDP_TEST_DAEMON " \"$d/pids\" sleep 300\n"
         "  setsid env -i PATH=/usr/bin:/bin sh -c 'echo $$ >> \"$0/bare\"; exec sleep 300' \"$d\" &\n"
         "done\n";
}

// The pids <dir>/pids holds.
std::vector<pid_t> pids_in(const std::string& file) {
  std::vector<pid_t> out;
  std::istringstream pids(read_text(file));
  for (long pid; pids >> pid;)
    if (pid > 1) out.push_back(static_cast<pid_t>(pid));
  return out;
}

// Where the job's processes are kept: the cgroup of `pid` when it is a
// job's (mnist_ddp-*), else "" (the watcher's token alone).
std::string job_cgroup_of(pid_t pid) {
  std::istringstream lines(read_text("/proc/" + std::to_string(pid) + "/cgroup"));
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("0::", 0) == 0 && line.find("/mnist_ddp-") != std::string::npos) return line.substr(3);
  return "";
}

// At the end of a scope, SIGKILL to the sleeps <dir>/pids names that
// still run (this test's own, whatever it asserted), and their reaping:
// orphans come to this test, a subreaper meanwhile.
class EndsWhatItStarted {
 public:
  explicit EndsWhatItStarted(std::string dir) : dir_(std::move(dir)) { prctl(PR_SET_CHILD_SUBREAPER, 1); }
  ~EndsWhatItStarted() {
    for (const char* file : {"/pids", "/bare"})
      for (pid_t pid : pids_in(dir_ + file))
        if (a_sleeper(pid)) kill(pid, SIGKILL);
    test::no_children_left(10s);
    prctl(PR_SET_CHILD_SUBREAPER, 0);
  }

 private:
  std::string dir_;
};

// SIGKILL to a launcher, which it cannot catch: its workers and the 60
// processes they left (ten of each kind) end all the same within 5 s
// (containment.hpp): in the job's cgroup where one can be made, and by the
// watcher's token alone (as where none can) all but the ten that cleared
// their environment, which escape it as docs/clusters.md says.
TEST(Launcher, NoDescendantOutlivesAKilledLauncher) {
  for (const bool cgroup : {true, false}) {
    SCOPED_TRACE(cgroup ? "a cgroup where one can be made" : "MNIST_DDP_WITHOUT_CGROUP=1");
    TempDir dir;
    const EndsWhatItStarted cleanup(dir.path());
    const std::string program = leave_descendants(dir.path()) + "touch \"$d/ready.$LOCAL_RANK\"\nexec sleep 300\n";
    auto launcher = std::make_unique<Process>(std::vector<std::string>{"run", "--nproc", "2", "--", "/bin/sh", "-c", program},
                                              dir / "output.txt",
                                              cgroup ? std::vector<std::string>{} : std::vector<std::string>{"MNIST_DDP_WITHOUT_CGROUP=1"});
    ASSERT_TRUE(eventually(
        [&] {
          return pids_in(dir / "pids").size() == 50 && pids_in(dir / "bare").size() == 10 &&
                 files::exists(dir / "ready.0") && files::exists(dir / "ready.1");
        },
        120s))
        << pids_in(dir / "pids").size() << " descendants\n" << read_text(dir / "output.txt");
    std::vector<pid_t> left = pids_in(dir / "pids"), workers = children_of(launcher->pid());
    const std::vector<pid_t> bare = pids_in(dir / "bare");
    ASSERT_GE(workers.size(), 2u);  // the workers, and the orphans the launcher inherited
    const std::string contained = job_cgroup_of(left.front());
    if (!contained.empty()) left.insert(left.end(), bare.begin(), bare.end());
    if (cgroup)
      std::cout << "contained " << (contained.empty() ? "by the watcher's token alone: no cgroup could be made here"
                                                      : "in the cgroup " + contained) << std::endl;
    else
      EXPECT_EQ(contained, "");
    const auto sent = std::chrono::steady_clock::now();
    send_signal(launcher->pid(), SIGKILL);
    ASSERT_NE(launcher->wait(5s), -1);
    const bool gone = eventually(
        [&] {
          while (waitpid(-1, nullptr, WNOHANG) > 0) {
          }
          return std::none_of(left.begin(), left.end(), a_sleeper) &&
                 std::none_of(workers.begin(), workers.end(), process_exists);
        },
        5s);
    EXPECT_TRUE(gone) << std::count_if(left.begin(), left.end(), a_sleeper) << " of " << left.size()
                      << " descendants outlived the launcher 5 s after its SIGKILL";
    if (contained.empty()) {
      std::cout << std::count_if(bare.begin(), bare.end(), a_sleeper)
                << " of the 10 that cleared their environment escaped, as where no cgroup can be made" << std::endl;
      for (pid_t pid : bare)
        if (a_sleeper(pid)) kill(pid, SIGKILL);  // ours: a sleep this case started
    }
    if (gone)
      std::cout << "every descendant ended "
                << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - sent).count()
                << " ms after the launcher's SIGKILL" << std::endl;
    EXPECT_TRUE(test::no_children_left(10s)) << "the watcher, or an orphan, is still running";
    for (const std::string mount : {"/sys/fs/cgroup/unified", "/sys/fs/cgroup"})
      EXPECT_TRUE(contained.empty() || !files::exists(mount + contained)) << "the job's cgroup is left: " << mount + contained;
  }
}

TEST(Launcher, RanksThatOutliveAKilledRankHaveASecondToSayWhy) {
  const std::string program = R"sh(d=$0
if [ "$LOCAL_RANK" = 1 ]; then
  while [ ! -e "$d/ready.0" ]; do sleep 0.02; done
  echo $$ > "$d/pid.tmp" && mv "$d/pid.tmp" "$d/pid.1"
  kill -9 $$
fi
touch "$d/ready.0"
while [ ! -s "$d/pid.1" ]; do sleep 0.02; done
while kill -0 "$(cat "$d/pid.1")" 2>/dev/null; do sleep 0.02; done
echo "rank 0: lost rank 1, which ended without a word"
exit 1)sh";
  TempDir dir;
  const std::string out = dir / "output.txt";
  Process launcher({"run", "--nproc", "2", "--", "/bin/sh", "-c", program, dir.path()}, out);
  const int status = launcher.wait(60s);
  ASSERT_NE(status, -1) << read_text(out);
  const std::string text = read_text(out);
  EXPECT_EQ(test::exit_code(status), 137) << text;
  EXPECT_NE(text.find("rank 0: lost rank 1, which ended without a word"), std::string::npos) << text;
  const std::string killed = std::to_string(std::atoi(read_text(dir / "pid.1").c_str()));
  EXPECT_NE(text.find("mnist_ddp: error: worker rank 1 (pid " + killed + ") was killed by signal 9"), std::string::npos)
      << text;
}

TEST(Launcher, WorkersAreBoundedByTheMachinesCoresAndMemory) {
  const Options opts = test::parse({"--backend", "gloo", "--nproc", "500"});
  const Placement p = plan_placement(opts, false, 0);
  constexpr int64_t MiB = 1 << 20, GiB = int64_t{1} << 30;
  try {
    check_workers_fit(opts, p, 280 * MiB, 2, 24 * GiB);
    ADD_FAILURE() << "500 workers fit 2 cores";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "--nproc 500: this machine has 2 cores and 24.0 GiB of memory available; 500 workers would need "
              "136.7 GiB (280 MiB each, for the data set and the model); at most 32 fit");
  }
  const Placement four = plan_placement(test::parse({"--backend", "gloo", "--nproc", "4"}), false, 0);
  EXPECT_NO_THROW(check_workers_fit(opts, four, 280 * MiB, 2, 24 * GiB));
  EXPECT_THROW(check_workers_fit(opts, four, 280 * MiB, 64, GiB), UsageError) << "4 x 280 MiB in 1 GiB";
  EXPECT_GT(available_memory(), 0);
}

}  // namespace
}  // namespace mnist_ddp
