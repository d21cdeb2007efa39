#include "mnist_ddp/launcher.hpp"
#include "mnist_ddp/checkpoint.hpp"
#include "mnist_ddp/dist.hpp"
#include "mnist_ddp/files.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace mnist_ddp {
namespace {

constexpr auto kGracePeriod = std::chrono::seconds(5);  // SIGTERM, then SIGKILL
// For workers to finish their step and checkpoint it after a preemption
// signal (Slurm's KillWait is 30 s by default, --signal=USR1@60 gives 60).
constexpr auto kPreemptionGrace = std::chrono::seconds(60);
constexpr auto kCauseWait = std::chrono::seconds(3);    // for the cause behind an echoed failure

[[noreturn]] void fail_errno(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
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

// What the launcher reads from its signalfd.
sigset_t launcher_signals() {
  sigset_t mask;
  sigemptyset(&mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGCHLD}) sigaddset(&mask, sig);
  return mask;
}

size_t env_count() {
  size_t n = 0;
  while (environ[n]) ++n;
  return n;
}

struct Worker {
  int rank = 0;  // local rank: its place on this node
  pid_t pid = -1;
  bool running = false;
};

// Starts this binary as a worker with `argv` and `env`; the descriptors in
// `inherit` (-1: none) stay open across exec, and the child gets the signal
// mask `mask` back and SIGKILL when the launcher dies. Everything is built
// before fork: the child only makes async-signal-safe calls.
pid_t start_worker(const std::vector<std::string>& argv, std::vector<std::string> env,
                   std::initializer_list<int> inherit, const sigset_t& mask) {
  std::vector<std::string> args = argv;
  std::vector<char*> envp, argp;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  for (auto& s : args) argp.push_back(s.data());
  argp.push_back(nullptr);
  const std::vector<int> fds(inherit);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) fail_errno("fork");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);  // the launcher died before prctl
    for (int fd : fds)
      if (fd >= 0) fcntl(fd, F_SETFD, 0);
    sigprocmask(SIG_SETMASK, &mask, nullptr);
    execve("/proc/self/exe", argp.data(), envp.data());
    _exit(127);
  }
  return pid;
}

// Sends `sig` to every running worker, SIGKILL to what is left after
// `grace`, and reaps them all.
void stop_workers(std::vector<Worker>& workers, int sig = SIGTERM,
                  std::chrono::steady_clock::duration grace = kGracePeriod) {
  for (const auto& w : workers)
    if (w.running && w.pid > 0) kill(w.pid, sig);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  bool killed = false;
  for (;;) {
    for (auto& w : workers) {
      if (w.running && waitpid(w.pid, nullptr, WNOHANG) == w.pid) w.running = false;
    }
    if (std::none_of(workers.begin(), workers.end(), [](const Worker& w) { return w.running; })) return;
    if (!killed && std::chrono::steady_clock::now() > deadline) {
      for (const auto& w : workers)
        if (w.running && w.pid > 0) kill(w.pid, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

class Launcher {
 public:
  Launcher(const Options& opts, const Placement& placement, const std::vector<std::string>& argv,
           const sigset_t& original_mask)
      : opts_(opts), placement_(placement), argv_(argv), old_mask_(original_mask) {}

  ~Launcher() {
    stop_all();
    for (int fd : {signal_fd_, error_fd_, error_write_fd_})
      if (fd >= 0) close(fd);
    sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
  }

  int run() {
    workers_.resize(placement_.local_workers);
    for (int r = 0; r < placement_.local_workers; ++r) workers_[r].rank = r;

    // Signals are taken from a signalfd, so none can arrive between two
    // checks; main() blocked them before any thread existed.
    const sigset_t mask = launcher_signals();
    signal_fd_ = signalfd(-1, &mask, SFD_CLOEXEC);
    if (signal_fd_ < 0) fail_errno("signalfd");
    int error_pipe[2];
    if (pipe2(error_pipe, O_CLOEXEC | O_NONBLOCK) != 0) fail_errno("pipe");
    error_fd_ = error_pipe[0];
    error_write_fd_ = error_pipe[1];
    if (const int code = open_job_store(); code >= 0) return code;

    std::vector<std::string> argv = argv_;
    bool resuming = false;  // argv ends in --resume auto
    for (round_ = 0;; ++round_) {
      const int code = start_and_supervise(argv);
      const bool again = code != 0 && !interrupted_ && code != 2 && round_ < opts_.max_restarts;
      if (!again || !join_restart()) {
        if (!failure_.empty())
          std::cerr << "mnist_ddp: error: " << failure_
                    << (round_ == 0                     ? std::string()
                        : round_ == opts_.max_restarts ? " (restarted " + std::to_string(round_) + " times; no restart left)"
                                                       : " (restarted " + std::to_string(round_) + " times)")
                    << std::endl;
        if (code != 0) refuse_restart();
        return code;
      }
      // Every node again, from the newest complete checkpoint (rank 0's, on node 0).
      const std::string dir = files::join(opts_.path, "checkpoint");
      const std::optional<Checkpoint> at = opts_.node_rank == 0 ? read_manifest(dir) : std::nullopt;
      std::cout << "mnist_ddp: " << failure_ << "; restart " << round_ + 1 << " of " << opts_.max_restarts
                << (opts_.node_rank > 0 ? std::string(" from node 0's newest checkpoint")
                    : at ? " from the checkpoint of step " + std::to_string(at->step) + " in " + dir
                         : std::string(" from the start: no checkpoint yet"))
                << std::endl;
      // --resume auto starts from the beginning where node 0 has no checkpoint yet.
      if (!resuming) argv.insert(argv.end(), {"--resume", "auto"});  // the last --resume wins
      resuming = true;
      // The restarted workers time their start-up from now.
      setenv("MNIST_DDP_LAUNCH_TIME",
             std::to_string(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()).c_str(), 1);
      failure_.clear();
      errors_.clear();
      error_text_.clear();
    }
  }

 private:
  // The store outlives the workers, so the nodes can agree on a restart
  // through it. Node 0 hosts it; another node waits for it up to --timeout,
  // answering signals meanwhile. Returns -1 once it is open, else the exit code.
  int open_job_store() {
    if (opts_.node_rank == 0) {
      store_ = open_store(opts_.master_addr, opts_.master_port, true, timeout());
      return -1;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    for (;;) {
      try {
        store_ = open_store(opts_.master_addr, opts_.master_port, false, std::chrono::seconds(1));
        return -1;
      } catch (const std::runtime_error&) {
        if (std::chrono::steady_clock::now() >= deadline)
          throw std::runtime_error("could not reach node 0's store at " + opts_.master_addr + ":" +
                                   std::to_string(opts_.master_port) + " within " +
                                   std::to_string(static_cast<int64_t>(opts_.timeout)) +
                                   " s: start mnist_ddp there with --node-rank 0");
      }
      pollfd fd = {signal_fd_, POLLIN, 0};
      if (poll(&fd, 1, 0) > 0) {
        if (const int code = handle_signal(); code >= 0) return code;
      }
    }
  }

  // Starts the node's workers and supervises them until they have all exited.
  int start_and_supervise(const std::vector<std::string>& argv) {
    for (auto& w : workers_) spawn(w, argv);
    return supervise();
  }

  void spawn(Worker& w, const std::vector<std::string>& argv) {
    WorkerEnv we;
    we.local_rank = w.rank;
    we.local_world_size = static_cast<int>(workers_.size());
    we.node_rank = opts_.node_rank;
    we.nnodes = opts_.nnodes;
    we.master_addr = opts_.master_addr;
    we.master_port = static_cast<int>(store_->getPort());
    we.round = round_;
    we.error_report_fd = error_write_fd_;
    const auto env = worker_environment(we, std::vector<std::string>(environ, environ + env_count()),
                                        static_cast<int>(std::thread::hardware_concurrency()));
    w.pid = start_worker(argv, env, {error_write_fd_}, old_mask_);
    w.running = true;
  }

  std::chrono::milliseconds timeout() const {  // --timeout
    return std::chrono::milliseconds(static_cast<int64_t>(opts_.timeout * 1000));
  }

  // ---- Restart rounds, agreed through the store by every node's launcher:
  // "restart/<round>/cause" (set by the first to ask), "restart/<round>/node/<k>"
  // (node k is ready to start its workers again) and "restart/<round>/refused"
  // (a node that will not restart, and why).

  std::string restart_key(const std::string& what, int round) const {
    return "restart/" + std::to_string(round) + "/" + what;
  }

  // Another node's request for the next round, if any (only asked with
  // several nodes). A store that is gone asks nothing: node 0 may be done.
  std::optional<std::string> restart_requested() {
    if (opts_.nnodes == 1 || store_lost_) return std::nullopt;
    try {
      const std::string key = restart_key("cause", round_ + 1);
      if (store_->check({key})) return text_of(store_->get(key));
    } catch (const std::exception&) {
      store_lost_ = true;
    }
    return std::nullopt;
  }

  // Takes this node into the next round; false (with failure_ saying why)
  // when the round cannot happen: another node refuses, or does not come
  // within --timeout.
  bool join_restart() {
    if (opts_.nnodes == 1) return true;
    const int next = round_ + 1;
    const std::string node = "node " + std::to_string(opts_.node_rank);
    try {
      const auto mine = bytes_of(node + ": " + failure_);
      failure_ = text_of(store_->compareSet(restart_key("cause", next), {}, mine));
      store_->set(restart_key("node/" + std::to_string(opts_.node_rank), next), bytes_of("ready"));
      const auto deadline = std::chrono::steady_clock::now() + timeout();
      for (;;) {
        if (store_->check({restart_key("refused", next)})) {
          failure_ = text_of(store_->get(restart_key("refused", next)));
          return false;
        }
        std::string missing;
        for (int k = 0; k < opts_.nnodes; ++k)
          if (!store_->check({restart_key("node/" + std::to_string(k), next)}))
            missing += (missing.empty() ? "" : ", ") + std::to_string(k);
        if (missing.empty()) return true;
        if (std::chrono::steady_clock::now() > deadline) {
          failure_ = "node " + missing + " did not join restart " + std::to_string(next) + " within " +
                     std::to_string(static_cast<int64_t>(opts_.timeout)) + " s (after " + failure_ + ")";
          return false;
        }
        pollfd fd = {signal_fd_, POLLIN, 0};
        if (poll(&fd, 1, 100) > 0 && handle_signal() >= 0) {
          failure_.clear();
          return false;
        }
      }
    } catch (const std::exception&) {
      failure_ = "lost the rendezvous store on node 0 (its launcher stopped) while restarting after " + failure_;
      return false;
    }
  }

  // Tells the other nodes that this one will not take part in another round.
  void refuse_restart() {
    if (opts_.nnodes == 1 || store_lost_) return;
    const std::string why = "node " + std::to_string(opts_.node_rank) + " stopped" +
                            (failure_.empty() ? std::string(" (interrupted)") : ": " + failure_);
    try {
      store_->compareSet(restart_key("refused", round_ + 1), {}, bytes_of(why));
    } catch (const std::exception&) {
    }
  }

  int supervise() {
    while (std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; })) {
      pollfd fd = {signal_fd_, POLLIN, 0};
      const int ready = poll(&fd, 1, opts_.nnodes > 1 ? 250 : -1);
      if (ready < 0) {
        if (errno == EINTR) continue;
        fail_errno("poll");
      }
      if (ready > 0) {
        if (const int code = handle_signal(); code >= 0) return code;
      } else if (auto cause = restart_requested()) {
        // Another node lost a worker: this node's workers wait on it in
        // vain, and start again with it.
        failure_ = *cause;
        stop_workers(workers_, SIGKILL, std::chrono::seconds(0));
        return 1;
      }
    }
    return 0;
  }

  // Collects what the workers reported, keeping each one's first message.
  void read_errors() {
    char buf[4096];
    ssize_t got;
    while ((got = read(error_fd_, buf, sizeof buf)) > 0) error_text_.append(buf, got);
    size_t nl;
    while ((nl = error_text_.find('\n')) != std::string::npos) {
      const auto e = parse_error_report(error_text_.substr(0, nl));
      error_text_.erase(0, nl + 1);
      if (e) errors_.emplace(e->local_rank, *e);
    }
  }

  struct Failure {
    int rank = 0;
    pid_t pid = -1;
    int status = 0;
    const WorkerError* report = nullptr;  // what the worker said, if it said anything
    bool echo() const { return report && report->echo; }
  };

  // Reaps the workers that have exited; returns the first failure, preferring
  // one that is not only an echo of another.
  std::optional<Failure> reap() {
    std::optional<Failure> found;
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      for (auto& w : workers_) {
        if (w.pid != pid || !w.running) continue;
        w.running = false;
        if (status == 0) continue;
        read_errors();  // a worker reports before it exits
        const auto it = errors_.find(w.rank);
        const Failure failure{w.rank, pid, status, it != errors_.end() && WIFEXITED(status) ? &it->second : nullptr};
        if (!found || (found->echo() && !failure.echo())) found = failure;
      }
    }
    return found;
  }

  // Returns -1 to keep going, else the launcher's exit code.
  int handle_signal() {
    signalfd_siginfo info;
    if (read(signal_fd_, &info, sizeof info) != sizeof info) return -1;
    const int sig = static_cast<int>(info.ssi_signo);
    if (sig != SIGCHLD) {
      interrupted_ = true;
      if (isatty(STDERR_FILENO)) std::cerr << "\r\033[K";  // rank 0's progress line
      if (sig == SIGTERM || sig == SIGUSR1) {  // preemption: keep the step the workers are on
        std::cout << "mnist_ddp: " << (sig == SIGTERM ? "SIGTERM" : "SIGUSR1")
                  << " received: the workers checkpoint the step they are on, then stop" << std::endl;
        stop_workers(workers_, sig, kPreemptionGrace);
      } else {
        std::cout << "KeyboardInterrupt received. Terminating processes..." << std::endl;
        stop_all();
      }
      return 128 + sig;
    }
    std::optional<Failure> failure = reap();
    if (!failure) return -1;
    // A worker that lost its peer or the store: give the others a moment to
    // exit with the cause.
    const auto deadline = std::chrono::steady_clock::now() + kCauseWait;
    while (failure->echo() && std::chrono::steady_clock::now() < deadline &&
           std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; })) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (auto other = reap(); other && !other->echo()) failure = other;
    }
    failure_ = failure->report ? failure->report->message
                               : "worker " + std::string(opts_.nnodes > 1 ? "local rank " : "rank ") +
                                     std::to_string(failure->rank) + " (pid " + std::to_string(failure->pid) + ") " +
                                     describe_status(failure->status) + "; stopping the other workers";
    // A restart follows unless the restarts are spent: the others' state is
    // not needed (the restart resumes from the checkpoint), nor their
    // seconds of finding out who is gone.
    if (round_ < opts_.max_restarts)
      stop_workers(workers_, SIGKILL, std::chrono::seconds(0));
    else
      stop_all();
    return exit_code_of(failure->status);
  }

  void stop_all() { stop_workers(workers_); }

  const Options& opts_;
  const Placement placement_;
  std::vector<std::string> argv_;
  std::vector<Worker> workers_;
  sigset_t old_mask_;  // the mask before block_launcher_signals(): the workers start with it
  int signal_fd_ = -1;
  int error_fd_ = -1, error_write_fd_ = -1;
  std::string error_text_;
  std::map<int, WorkerError> errors_;  // local rank -> its first reported error
  std::string failure_;       // why the workers last failed, for the user
  bool interrupted_ = false;  // by a signal to the launcher: no restart
  c10::intrusive_ptr<c10d::TCPStore> store_;
  bool store_lost_ = false;
  int round_ = 0;             // this start of the workers: 0, then one more per restart
};

}  // namespace

sigset_t block_launcher_signals() {
  const sigset_t mask = launcher_signals();
  sigset_t original;
  if (sigprocmask(SIG_BLOCK, &mask, &original) != 0) fail_errno("sigprocmask");
  return original;
}

int run_launcher(const Options& opts, const Placement& placement, const std::vector<std::string>& argv,
                 const sigset_t& original_mask) {
  Launcher launcher(opts, placement, argv, original_mask);
  return launcher.run();
}

}  // namespace mnist_ddp
