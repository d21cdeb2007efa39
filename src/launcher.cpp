#include "mnist_ddp/launcher.hpp"
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
constexpr auto kCauseWait = std::chrono::seconds(3);    // for the cause behind an echoed failure

[[noreturn]] void fail_errno(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

// GPUs a CUDA process would see, counted without initialising CUDA: the
// entries of CUDA_VISIBLE_DEVICES (up to the first invalid one, as CUDA reads
// it) or else the /dev/nvidiaN device files. A worker checks its device
// against CUDA's own count before using it.
int visible_gpu_count() {
  int present = 0;
  for (const std::string& name : files::list_directory("/dev")) {
    if (name.size() > 6 && name.compare(0, 6, "nvidia") == 0 &&
        std::all_of(name.begin() + 6, name.end(), ::isdigit))
      ++present;
  }
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (!visible) return present;
  int listed = 0;
  std::string list = visible;
  for (size_t start = 0; start <= list.size();) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    const std::string item = list.substr(start, end - start);
    if (item.empty() || item[0] == '-') break;
    ++listed;
    start = end + 1;
  }
  return std::min(listed, present);
}

bool built_with_cuda() {
#ifdef MNIST_DDP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int env_int(const char* name, std::optional<int> fallback) {
  const char* value = std::getenv(name);
  if (!value || !*value) {
    if (fallback) return *fallback;
    throw UsageError(std::string("environment variable ") + name + " is not set");
  }
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value, &end, 10);
  if (errno || *end || v < 0 || v > 1 << 30)
    throw UsageError(std::string("environment variable ") + name + "='" + value + "' is not a non-negative integer");
  return static_cast<int>(v);
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

// A worker's reported error; `echo` when it only follows from another's.
struct Report {
  std::string message;
  bool echo = false;
};

struct Worker {
  int rank = 0;  // local rank: its place on this node
  pid_t pid = -1;
  bool running = false;
};

class Launcher {
 public:
  Launcher(const Options& opts, const Placement& placement, const std::vector<std::string>& argv)
      : opts_(opts), placement_(placement), argv_(argv) {}

  ~Launcher() {
    stop_all();
    for (int fd : {signal_fd_, port_fd_, error_fd_, error_write_fd_})
      if (fd >= 0) close(fd);
    sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
  }

  int run() {
    workers_.resize(placement_.local_workers);
    for (int r = 0; r < placement_.local_workers; ++r) workers_[r].rank = r;

    // Signals are taken from a signalfd, so none can arrive between two checks.
    sigset_t mask;
    sigemptyset(&mask);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&mask, sig);
    if (sigprocmask(SIG_BLOCK, &mask, &old_mask_) != 0) fail_errno("sigprocmask");
    signal_fd_ = signalfd(-1, &mask, SFD_CLOEXEC);
    if (signal_fd_ < 0) fail_errno("signalfd");
    int error_pipe[2];
    if (pipe2(error_pipe, O_CLOEXEC | O_NONBLOCK) != 0) fail_errno("pipe");
    error_fd_ = error_pipe[0];
    error_write_fd_ = error_pipe[1];

    int port = opts_.master_port;
    if (port == 0) {
      // Rank 0 binds a free port and tells us which, before the others start:
      // no port is ever guessed, so concurrent jobs cannot collide.
      int fds[2];
      if (pipe2(fds, O_CLOEXEC) != 0) fail_errno("pipe");
      port_fd_ = fds[0];
      spawn(workers_[0], 0, fds[1]);
      close(fds[1]);
      if (const int code = wait_for_port(port); code >= 0) return code;
      for (size_t r = 1; r < workers_.size(); ++r) spawn(workers_[r], port, -1);
    } else {
      for (auto& w : workers_) spawn(w, port, -1);
    }
    return supervise();
  }

 private:
  // Builds everything the child needs before fork: after fork only
  // async-signal-safe calls are made.
  void spawn(Worker& w, int port, int report_fd) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string kv = *e;
      const std::string key = kv.substr(0, kv.find('='));
      static const std::set<std::string> ours = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                 "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "MNIST_DDP_NNODES",
                                                 "MNIST_DDP_PORT_FD", "MNIST_DDP_ERROR_FD"};
      if (!ours.count(key)) env.push_back(kv);
    }
    const int n = static_cast<int>(workers_.size());
    // No RANK or WORLD_SIZE: the workers of all nodes agree on them through
    // the store, so no node needs to know how many workers the others run.
    env.push_back("LOCAL_RANK=" + std::to_string(w.rank));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(n));
    env.push_back("GROUP_RANK=" + std::to_string(opts_.node_rank));
    env.push_back("MNIST_DDP_NNODES=" + std::to_string(opts_.nnodes));
    env.push_back("MASTER_ADDR=" + opts_.master_addr);
    env.push_back("MASTER_PORT=" + std::to_string(port));
    if (report_fd >= 0) env.push_back("MNIST_DDP_PORT_FD=" + std::to_string(report_fd));
    env.push_back("MNIST_DDP_ERROR_FD=" + std::to_string(error_write_fd_));
    // LibTorch's own log lines (glog) would repeat, less clearly, what the
    // worker reports as its error line.
    if (!std::getenv("GLOG_minloglevel")) env.push_back("GLOG_minloglevel=3");
    // Each worker's share of the cores, for every OpenMP pool it starts
    // (ATen's and OpenBLAS's, on any thread), unless the user set one.
    if (!std::getenv("OMP_NUM_THREADS")) {
      const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      env.push_back("OMP_NUM_THREADS=" + std::to_string(std::max(1, cores / n)));
    }

    std::vector<char*> envp, args;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv = argv_;
    for (auto& s : argv) args.push_back(s.data());
    args.push_back(nullptr);

    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) fail_errno("fork");
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);  // the launcher died before prctl
      if (report_fd >= 0) fcntl(report_fd, F_SETFD, 0);
      fcntl(error_write_fd_, F_SETFD, 0);
      sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
      execve("/proc/self/exe", args.data(), envp.data());
      _exit(127);
    }
    w.pid = pid;
    w.running = true;
  }

  // Returns -1 once the port is known, else the launcher's exit code.
  int wait_for_port(int& port) {
    std::string text;
    for (;;) {
      pollfd fds[2] = {{signal_fd_, POLLIN, 0}, {port_fd_, POLLIN, 0}};
      if (poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        fail_errno("poll");
      }
      if (fds[0].revents) {
        if (const int code = handle_signal(); code >= 0) return code;
      }
      if (fds[1].revents) {
        char buf[32];
        const ssize_t got = read(port_fd_, buf, sizeof buf);
        if (got > 0) {
          text.append(buf, got);
          continue;
        }
        close(port_fd_);
        port_fd_ = -1;
        port = std::atoi(text.c_str());
        if (port > 0) return -1;
        // Rank 0 ended without reporting a port: its exit status says why.
        if (const int code = supervise(); code != 0) return code;
        std::cerr << "mnist_ddp: rank 0 exited without starting the rendezvous store\n";
        return 1;
      }
    }
  }

  int supervise() {
    while (std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; })) {
      pollfd fd = {signal_fd_, POLLIN, 0};
      if (poll(&fd, 1, -1) < 0) {
        if (errno == EINTR) continue;
        fail_errno("poll");
      }
      if (const int code = handle_signal(); code >= 0) return code;
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
      const std::string line = error_text_.substr(0, nl);
      error_text_.erase(0, nl + 1);
      const size_t tab = line.find('\t'), tab2 = line.find('\t', tab + 1);
      if (tab2 == std::string::npos) continue;
      const bool echo = line.compare(tab + 1, tab2 - tab - 1, "echo") == 0;
      errors_.emplace(std::atoi(line.substr(0, tab).c_str()), Report{line.substr(tab2 + 1), echo});
    }
  }

  struct Failure {
    int rank = 0;
    pid_t pid = -1;
    int status = 0;
    const Report* report = nullptr;  // what the worker said, if it said anything
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
      if (isatty(STDERR_FILENO)) std::cerr << "\r\033[K";  // rank 0's progress line
      std::cout << "KeyboardInterrupt received. Terminating processes..." << std::endl;
      stop_all();
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
    if (failure->report) {
      std::cerr << "mnist_ddp: error: " << failure->report->message << std::endl;
    } else {
      std::cerr << "mnist_ddp: worker " << (opts_.nnodes > 1 ? "local rank " : "rank ") << failure->rank
                << " (pid " << failure->pid << ") " << describe_status(failure->status)
                << "; stopping the other workers" << std::endl;
    }
    stop_all();
    return exit_code_of(failure->status);
  }

  // SIGTERM every running worker, SIGKILL what is left after the grace
  // period, and reap them all.
  void stop_all() {
    for (const auto& w : workers_)
      if (w.running) kill(w.pid, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + kGracePeriod;
    bool killed = false;
    for (;;) {
      for (auto& w : workers_) {
        if (w.running && waitpid(w.pid, nullptr, WNOHANG) == w.pid) w.running = false;
      }
      if (std::none_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; })) return;
      if (!killed && std::chrono::steady_clock::now() > deadline) {
        for (const auto& w : workers_)
          if (w.running) kill(w.pid, SIGKILL);
        killed = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  const Options& opts_;
  const Placement placement_;
  std::vector<std::string> argv_;
  std::vector<Worker> workers_;
  sigset_t old_mask_{};
  int signal_fd_ = -1;
  int port_fd_ = -1;
  int error_fd_ = -1, error_write_fd_ = -1;
  std::string error_text_;
  std::map<int, Report> errors_;  // local rank -> its first reported error
};

}  // namespace

Placement plan_placement(const Options& opts) {
  return plan_placement(opts, built_with_cuda(), built_with_cuda() ? visible_gpu_count() : 0);
}

Placement plan_placement(const Options& opts, bool cuda_build, int visible) {
  Placement p;
  std::set<int> distinct(opts.gpus.begin(), opts.gpus.end());
  const bool shared = distinct.size() < opts.gpus.size();
  p.backend = opts.backend == "auto" ? (visible > 0 && !shared ? "nccl" : "gloo") : opts.backend;
  if (p.backend == "nccl" && !cuda_build)
    throw UsageError("--backend nccl: this mnist_ddp was built against a CPU-only LibTorch; use --backend gloo");
  if (p.backend == "nccl" && visible == 0)
    throw UsageError("--backend nccl: no CUDA device is visible; use --backend gloo");
  if (p.backend == "gloo" && opts.gpus.empty()) {
    p.local_workers = opts.nproc;
    return p;
  }
  if (opts.gpus.empty()) {
    for (int d = 0; d < visible; ++d) p.devices.push_back(d);
  } else {
    p.devices = opts.gpus;
  }
  std::set<int> seen;
  for (int d : p.devices) {
    if (d >= visible)
      throw UsageError("--gpus: device " + std::to_string(d) + " does not exist (" +
                       (visible == 0 ? std::string("no CUDA device is visible to this build")
                                     : std::to_string(visible) + " visible, ids 0.." + std::to_string(visible - 1)) +
                       ")");
    if (!seen.insert(d).second && p.backend == "nccl")
      throw UsageError("--gpus: device " + std::to_string(d) +
                       " is listed twice, but --backend nccl needs a GPU of its own per worker; use --backend gloo "
                       "to let workers share a GPU");
  }
  p.local_workers = static_cast<int>(p.devices.size());
  return p;
}

std::string first_slurm_host(const std::string& nodelist) {
  size_t end = 0;
  for (int depth = 0; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    if (nodelist[end] == ']') --depth;
    if (nodelist[end] == ',' && depth == 0) break;
  }
  const std::string first = nodelist.substr(0, end);
  const size_t open = first.find('[');
  if (open == std::string::npos) return first;
  const size_t close = first.find(']', open);
  const std::string range = first.substr(open + 1, close - open - 1);
  const std::string head = range.substr(0, range.find_first_of(",-"));
  return first.substr(0, open) + head + (close == std::string::npos ? "" : first.substr(close + 1));
}

std::optional<WorkerEnv> worker_env_from_environment() {
  WorkerEnv env;
  auto master_addr = [](const std::string& fallback) {
    const char* addr = std::getenv("MASTER_ADDR");
    return addr && *addr ? std::string(addr) : fallback;
  };
  if (std::getenv("RANK") && std::getenv("WORLD_SIZE")) {  // torchrun, or set by hand
    env.rank = env_int("RANK", std::nullopt);
    env.world_size = env_int("WORLD_SIZE", std::nullopt);
    env.local_rank = env_int("LOCAL_RANK", env.rank);
    env.local_world_size = env_int("LOCAL_WORLD_SIZE", env.world_size);
    env.node_rank = env_int("GROUP_RANK", 0);
    env.master_addr = master_addr("127.0.0.1");
    env.master_port = env_int("MASTER_PORT", std::nullopt);
  } else if (std::getenv("SLURM_PROCID") && std::getenv("SLURM_NTASKS")) {  // srun
    env.rank = env_int("SLURM_PROCID", std::nullopt);
    env.world_size = env_int("SLURM_NTASKS", std::nullopt);
    env.local_rank = env_int("SLURM_LOCALID", 0);
    const char* per_node = std::getenv("SLURM_TASKS_PER_NODE");  // e.g. "4(x2),2"
    env.local_world_size = per_node ? std::max(1, std::atoi(per_node)) : 1;
    env.local_rank = std::min(env.local_rank, env.local_world_size - 1);
    env.node_rank = env_int("SLURM_NODEID", 0);
    const char* nodes = std::getenv("SLURM_JOB_NODELIST");
    if (!nodes) nodes = std::getenv("SLURM_NODELIST");
    env.master_addr = master_addr(nodes ? first_slurm_host(nodes) : "");
    if (env.master_addr.empty())
      throw UsageError("environment: Slurm gives no SLURM_JOB_NODELIST; set MASTER_ADDR to node 0's address");
    env.master_port = env_int("MASTER_PORT", 29500);
  } else if (std::getenv("MNIST_DDP_NNODES")) {  // our launcher
    env.nnodes = env_int("MNIST_DDP_NNODES", std::nullopt);
    env.node_rank = env_int("GROUP_RANK", std::nullopt);
    env.local_rank = env_int("LOCAL_RANK", std::nullopt);
    env.local_world_size = env_int("LOCAL_WORLD_SIZE", std::nullopt);
    env.master_addr = master_addr("127.0.0.1");
    env.master_port = env_int("MASTER_PORT", std::nullopt);
  } else {
    return std::nullopt;
  }
  env.port_report_fd = env_int("MNIST_DDP_PORT_FD", -1);
  env.error_report_fd = env_int("MNIST_DDP_ERROR_FD", -1);
  if (env.rank >= 0 && (env.world_size < 1 || env.rank >= env.world_size))
    throw UsageError("environment: RANK=" + std::to_string(env.rank) + " is not below WORLD_SIZE=" +
                     std::to_string(env.world_size));
  if (env.local_rank >= env.local_world_size)
    throw UsageError("environment: LOCAL_RANK=" + std::to_string(env.local_rank) + " is not below LOCAL_WORLD_SIZE=" +
                     std::to_string(env.local_world_size));
  if (env.master_port == 0 && env.port_report_fd < 0)
    throw UsageError("environment: MASTER_PORT must name the rank-0 store's port");
  return env;
}

void report_worker_error(const WorkerEnv& env, int rank, const std::string& message, bool echo) {
  const std::string who = rank >= 0 ? "rank " + std::to_string(rank)
                                    : "node " + std::to_string(env.node_rank) + " local rank " +
                                          std::to_string(env.local_rank);
  if (env.error_report_fd >= 0) {
    // One write below PIPE_BUF: never interleaved with another worker's.
    std::string line = std::to_string(env.local_rank) + (echo ? "\techo\t" : "\tcause\t") + who + ": " +
                       message.substr(0, 3000) + "\n";
    if (write(env.error_report_fd, line.data(), line.size()) == static_cast<ssize_t>(line.size())) return;
  }
  std::cerr << "mnist_ddp: error: " << who << ": " << message << std::endl;
}

int run_launcher(const Options& opts, const Placement& placement, const std::vector<std::string>& argv) {
  Launcher launcher(opts, placement, argv);
  return launcher.run();
}

}  // namespace mnist_ddp
