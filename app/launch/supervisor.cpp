#include "app/launch/supervisor.hpp"

#include <fcntl.h>
#include <poll.h>
#include <dirent.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace mnist_ddp {
namespace {

[[noreturn]] void fail_errno(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

// What a supervisor reads from its signalfd.
sigset_t supervised_signals() {
  sigset_t mask;
  sigemptyset(&mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGCHLD}) sigaddset(&mask, sig);
  return mask;
}

// How long one poll lasts at most: SIGCHLD only hurries reaping along, so
// a child whose SIGCHLD another thread took is still reaped.
constexpr auto kLongestPoll = std::chrono::milliseconds(250);

}  // namespace

sigset_t block_launcher_signals() {
  const sigset_t mask = supervised_signals();
  sigset_t original;
  if (sigprocmask(SIG_BLOCK, &mask, &original) != 0) fail_errno("sigprocmask");
  return original;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "stopped with wait status " + std::to_string(status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

Supervisor::Supervisor(const sigset_t& child_mask) : child_mask_(child_mask) {
  const sigset_t mask = supervised_signals();
  signal_fd_ = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (signal_fd_ < 0) fail_errno("signalfd");
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(signal_fd_);
    fail_errno("pipe");
  }
  report_fd_ = pipe_fds[0];
  report_write_fd_ = pipe_fds[1];
}

Supervisor::~Supervisor() {
  stop(SIGTERM, std::chrono::seconds(5));
  for (int fd : {signal_fd_, report_fd_, report_write_fd_})
    if (fd >= 0) close(fd);
}

void Supervisor::start(int index, const std::string& program, const std::vector<std::string>& argv,
                       const std::vector<std::string>& env) {
  // Everything is built before fork: the child only makes async-signal-safe calls.
  std::vector<std::string> args = argv, vars = env;
  std::vector<char*> argp, envp;
  for (auto& s : args) argp.push_back(s.data());
  argp.push_back(nullptr);
  for (auto& s : vars) envp.push_back(s.data());
  envp.push_back(nullptr);
  const int inherit = report_write_fd_, cgroup = cgroup_procs_fd_;
  const sigset_t mask = child_mask_;
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) fail_errno("fork");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);  // the supervisor died before prctl
    if (cgroup >= 0 && write(cgroup, "0", 1) != 1) {
      // Outside the job's cgroup: the job's token in its environment still marks it (containment.hpp).
    }
    fcntl(inherit, F_SETFD, 0);
    sigprocmask(SIG_SETMASK, &mask, nullptr);
    execve(program.c_str(), argp.data(), envp.data());
    _exit(127);
  }
  children_.push_back({index, pid, true});
}

bool Supervisor::any_running() const {
  return std::any_of(children_.begin(), children_.end(), [](const Child& c) { return c.running; });
}

void Supervisor::read_reports() {
  char buf[4096];
  ssize_t got;
  while ((got = read(report_fd_, buf, sizeof buf)) > 0) report_text_.append(buf, static_cast<size_t>(got));
  size_t nl;
  while ((nl = report_text_.find('\n')) != std::string::npos) {
    const auto e = parse_error_report(report_text_.substr(0, nl));
    report_text_.erase(0, nl + 1);
    const bool known = e && std::any_of(reports_.begin(), reports_.end(),
                                         [&](const WorkerError& r) { return r.local_rank == e->local_rank; });
    if (e && !known) reports_.push_back(*e);  // each child's first
  }
}

std::optional<Supervisor::Failure> Supervisor::reap() {
  std::optional<Failure> found;
  for (Child& c : children_) {
    int status = 0;
    if (!c.running || waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
    c.running = false;
    if (status == 0) continue;
    read_reports();  // a child reports before it exits
    Failure failure{c.index, c.pid, status, std::nullopt};
    for (const WorkerError& r : reports_)
      if (r.local_rank == c.index && WIFEXITED(status)) failure.report = r;
    // The first failure, preferring one that is not only an echo of another.
    if (!found || (found->echo() && !failure.echo())) found = failure;
  }
  return found;
}

Supervisor::Event Supervisor::wait(std::chrono::milliseconds timeout, std::chrono::milliseconds cause_wait) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (timeout.count() < 0 || left > kLongestPoll) left = kLongestPoll;
    pollfd fd = {signal_fd_, POLLIN, 0};
    if (poll(&fd, 1, static_cast<int>(std::max<int64_t>(0, left.count()))) < 0 && errno != EINTR) fail_errno("poll");
    signalfd_siginfo info;
    while (read(signal_fd_, &info, sizeof info) == static_cast<ssize_t>(sizeof info))
      if (info.ssi_signo != SIGCHLD) return {static_cast<int>(info.ssi_signo), std::nullopt};
    if (std::optional<Failure> failure = reap()) {
      // A child that lost its peer or the store: give the others a moment
      // to exit with the cause. A program's failure, or a child killed by a
      // signal (which reports nothing): a moment to say theirs.
      const bool program = !failure->report;
      const auto until = std::chrono::steady_clock::now() +
                         (program ? std::min<std::chrono::milliseconds>(cause_wait, std::chrono::seconds(1)) : cause_wait);
      while ((failure->echo() || program) && any_running() && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (auto other = reap(); other && failure->echo() && !other->echo()) failure = other;
      }
      return {0, failure};
    }
    if (!any_running() || (timeout.count() >= 0 && std::chrono::steady_clock::now() >= deadline)) return {};
  }
}

void become_subreaper() {
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) fail_errno("prctl(PR_SET_CHILD_SUBREAPER)");
}

namespace {

// This process's children now, from /proc (an orphan a subreaper inherits
// is its child there at once).
std::vector<pid_t> children_of_this_process() {
  std::vector<pid_t> out;
  const pid_t self = getpid();
  DIR* proc = opendir("/proc");
  if (!proc) return out;
  while (const dirent* entry = readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(entry->d_name, &end, 10);
    if (*end != '\0' || pid <= 1 || pid == self) continue;
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE* f = std::fopen(path, "r");
    if (!f) continue;
    char line[512];
    const bool read = std::fgets(line, sizeof line, f) != nullptr;
    std::fclose(f);
    if (!read) continue;
    const char* after = std::strrchr(line, ')');  // the command may hold spaces and parentheses
    long ppid = -1;
    char state = 0;
    if (after && std::sscanf(after + 1, " %c %ld", &state, &ppid) == 2 && ppid == self) out.push_back(static_cast<pid_t>(pid));
  }
  closedir(proc);
  return out;
}

}  // namespace

int end_orphans(std::chrono::milliseconds grace) {
  int ended = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (std::vector<pid_t> found = children_of_this_process(); !found.empty() && std::chrono::steady_clock::now() < give_up;
       found = children_of_this_process()) {
    for (pid_t pid : found) kill(pid, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + grace;
    std::vector<pid_t> left = found;
    while (!left.empty()) {
      left.erase(std::remove_if(left.begin(), left.end(), [&](pid_t pid) { return waitpid(pid, nullptr, WNOHANG) == pid; }),
                 left.end());
      if (left.empty()) break;
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t pid : left) kill(pid, SIGKILL);
        for (pid_t pid : left) waitpid(pid, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ended += static_cast<int>(found.size());
  }
  return ended;
}

void Supervisor::stop(int sig, std::chrono::steady_clock::duration grace) {
  for (const Child& c : children_)
    if (c.running && c.pid > 0) kill(c.pid, sig);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  bool killed = false;
  for (;;) {
    for (Child& c : children_)
      if (c.running && waitpid(c.pid, nullptr, WNOHANG) == c.pid) c.running = false;
    if (!any_running()) break;
    if (!killed && std::chrono::steady_clock::now() > deadline) {
      for (const Child& c : children_)
        if (c.running && c.pid > 0) kill(c.pid, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  read_reports();  // whatever the stopped children wrote: none of it is for the next ones
  children_.clear();
  reports_.clear();
  report_text_.clear();
}

}  // namespace mnist_ddp
