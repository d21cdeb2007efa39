// Helpers shared by the tests: ranks as threads, IDX files, temporary
// directories, and real processes of the mnist_ddp binary.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <zlib.h>

#include "app/base/files.hpp"
#include "app/base/options.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "comm/group.hpp"
#include "parallel/norm.hpp"
#include "parallel/reducer.hpp"
#include "parallel/wires.hpp"
#include "app/train/report.hpp"

namespace mnist_ddp::test {

// How much longer a process takes under the sanitizers (scripts/sanitize.sh):
// a LibTorch process starts in seconds, not in a fraction of one. Bounds
// on whole programs' times are multiplied by it.
#if defined(__SANITIZE_ADDRESS__)
constexpr double kSlower = 4;
#else
constexpr double kSlower = 1;
#endif

void run_rank_processes(int world, const std::function<void(ProcessGroup&)>& fn, torch::Device device);

// How CPU ranks sum: through their Gloo group, or through shared memory as
// a job on one host does (shared_memory.hpp).
enum class Sums { gloo, shared_memory };

// Runs fn(group) on `world` ranks with Gloo groups, their tensors on
// `device`. On the CPU each rank is a thread, all over one in-memory store;
// the first failure is rethrown. On a GPU, see run_rank_processes.
// One training step of `ddp` on rank `rank`'s own batch number `k` (8 x 4
// inputs, 8 x 2 targets, seeded by both), mean squared error.
template <typename Ddp>
void step(Ddp& ddp, torch::optim::Optimizer& opt, int rank, int k) {
  torch::manual_seed(10 * rank + k);
  const auto x = torch::randn({8, 4}), y = torch::randn({8, 2});
  opt.zero_grad();
  torch::mse_loss(ddp.forward(x), y).backward();
  opt.step();
}

// How run_ranks() makes its ranks' groups.
struct Ranks {
  Sums sums = Sums::gloo;
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  std::optional<Check> check;  // nullopt: the backend's way (collectives.hpp)
  // A barrier after fn, so that no rank tears its group down while another
  // still talks on it; off for a test of what a rank that leaves does.
  bool barrier_after = true;
};

inline void run_ranks(int world, const std::function<void(ProcessGroup&)>& fn, const Ranks& how) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  std::mutex mutex;
  std::exception_ptr failure;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        ProcessGroup group = make_process_group(store, rank, world, "gloo", torch::kCPU, how.timeout,
                                                how.sums == Sums::shared_memory, "127.0.0.1", how.check);
        fn(group);
        if (world > 1 && how.barrier_after) quick_stream(group)->barrier();
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!failure) failure = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
}

inline void run_ranks(int world, const std::function<void(ProcessGroup&)>& fn, torch::Device device = torch::kCPU,
                      Sums sums = Sums::gloo) {
  if (device.is_cuda()) return run_rank_processes(world, fn, device);
  Ranks how;
  how.sums = sums;
  run_ranks(world, fn, how);
}

// The options a command line gives (without the program's name), in an
// empty environment.
inline Options parse(std::vector<std::string> args) {
  args.insert(args.begin(), "mnist_ddp");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return *parse_options(static_cast<int>(argv.size()), argv.data());
}

// The one line a command line is refused with, or "(accepted)".
inline std::string usage_error(const std::vector<std::string>& args) {
  try {
    parse(args);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(accepted)";
}

// A fresh directory under the system's temporary directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = files::join(tmp && *tmp ? tmp : "/tmp", "mnist_ddp_test_XXXXXX");
    if (!mkdtemp(templ.data())) throw std::runtime_error("mkdtemp " + templ + ": " + std::strerror(errno));
    path_ = templ;
  }
  ~TempDir() { files::remove_tree(path_); }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return files::join(path_, name); }

 private:
  std::string path_;
};

// The largest elementwise difference, in float64, on the CPU; 0 for empty tensors.
inline double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.numel() == 0) return 0;
  return (a.cpu().to(torch::kFloat64) - b.cpu().to(torch::kFloat64)).abs().max().item<double>();
}

// The same over every entry of `a`, each compared with `b`'s of that name.
// Infinite where the two hold different keys: an entry missing from either counts.
inline double max_abs_diff(const c10::Dict<std::string, torch::Tensor>& a, const c10::Dict<std::string, torch::Tensor>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (const auto& item : a) {
    if (!b.contains(item.key())) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, max_abs_diff(item.value(), b.at(item.key())));
  }
  return worst;
}

// Per-rank slices of a tensor whose first dimension is world * n.
inline torch::Tensor shard(const torch::Tensor& t, int rank, int world) {
  const int64_t n = t.size(0) / world;
  return t.slice(0, rank * n, (rank + 1) * n);
}

// Models built serially, from one seed each: ranks as threads share LibTorch's
// default generator. Every rank starts elsewhere (seed + rank): DDP must
// broadcast rank 0's state.
template <typename Model>
std::vector<std::shared_ptr<Model>> replicas(uint64_t seed, int world) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<std::shared_ptr<Model>> out;
  for (int r = 0; r <= world; ++r) {  // the last one is the oracle, built as rank 0's
    torch::manual_seed(r < world ? seed + r : seed);
    out.push_back(std::make_shared<Model>());
  }
  return out;
}

// Every parameter's gradient (undefined ones as an empty tensor) and value, cloned.
struct Snapshot {
  std::vector<torch::Tensor> grads, values;
};
inline Snapshot snapshot(torch::nn::Module& m) {
  Snapshot s;
  for (const auto& p : m.parameters()) {
    s.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    s.values.push_back(p.detach().clone());
  }
  return s;
}

// Each rank's snapshot equals the oracle's within `tolerance`, and rank 0's bit for bit.
inline void expect_oracle(const std::vector<Snapshot>& ranks, const Snapshot& oracle, double tolerance = 1e-5) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    ASSERT_EQ(ranks[r].grads.size(), oracle.grads.size());
    for (size_t i = 0; i < oracle.grads.size(); ++i) {
      EXPECT_EQ(ranks[r].grads[i].defined(), oracle.grads[i].defined()) << "rank " << r << " parameter " << i;
      if (oracle.grads[i].defined() && ranks[r].grads[i].defined()) {
        EXPECT_LE(max_abs_diff(ranks[r].grads[i], oracle.grads[i]), tolerance) << "rank " << r << " parameter " << i;
      }
      EXPECT_LE(max_abs_diff(ranks[r].values[i], oracle.values[i]), tolerance) << "rank " << r << " parameter " << i;
      EXPECT_TRUE(torch::equal(ranks[r].values[i], ranks[0].values[i])) << "replica " << r << " parameter " << i;
    }
  }
}

// True for a regular file (or a link to one).
inline bool is_regular_file(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// The size of a file in bytes, -1 if it cannot be read.
inline int64_t file_size(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

inline void resize_file(const std::string& path, int64_t size) {
  if (truncate(path.c_str(), size) != 0) throw std::runtime_error("cannot resize " + path);
}

// Where the symbolic link `path` points, "" if it is not one.
inline std::string read_symlink(const std::string& path) {
  char target[4096];
  const ssize_t n = readlink(path.c_str(), target, sizeof target);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string();
}

// Every path below `dir`, depth first; links to directories are not followed.
inline std::vector<std::string> walk(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& name : files::list_directory(dir)) {
    const std::string path = files::join(dir, name);
    out.push_back(path);
    struct stat st;
    if (lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      for (const auto& below : walk(path)) out.push_back(below);
  }
  return out;
}

// Copies the regular files of `from` into `to` (created), keeping the layout.
inline void copy_tree(const std::string& from, const std::string& to) {
  files::make_directories(to);
  for (const auto& name : files::list_directory(from)) {
    const std::string src = files::join(from, name), dst = files::join(to, name);
    if (files::is_directory(src)) {
      copy_tree(src, dst);
    } else {
      std::ifstream in(src, std::ios::binary);
      std::ofstream(dst, std::ios::binary) << in.rdbuf();
    }
  }
}

inline std::string idx_bytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data,
                             uint32_t magic = 0) {
  std::string out;
  auto put = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<char>((v >> s) & 0xFF));
  };
  put(magic ? magic : 0x0800u | static_cast<uint32_t>(dims.size()));
  for (uint32_t d : dims) put(d);
  out.append(data.begin(), data.end());
  return out;
}

inline void write_file(const std::string& path, const std::string& bytes, bool gzip) {
  files::make_directories(path.substr(0, path.find_last_of('/')));
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream(path, std::ios::binary) << bytes;
  }
}

// A small learnable MNIST-format dataset under <dir>/MNIST/raw: each image
// holds a bright bar whose row encodes its label.
inline void write_synthetic_mnist(const std::string& data_dir, int train, int test) {
  const std::string raw = data_dir + "/MNIST/raw/";
  for (auto [name, n] : {std::pair<std::string, int>{"train", train}, {"t10k", test}}) {
    std::vector<uint8_t> pixels(static_cast<size_t>(n) * 28 * 28, 0), labels(n);
    for (int i = 0; i < n; ++i) {
      labels[i] = static_cast<uint8_t>(i % 10);
      const int row = 2 + 2 * labels[i] + (i / 10) % 2;
      for (int c = 4; c < 24; ++c) pixels[static_cast<size_t>(i) * 784 + row * 28 + c] = 255;
    }
    write_file(raw + name + "-images-idx3-ubyte.gz", idx_bytes({uint32_t(n), 28, 28}, pixels), true);
    write_file(raw + name + "-labels-idx1-ubyte.gz", idx_bytes({uint32_t(n)}, labels), true);
  }
}

// The first `train` and `test` images of the MNIST in `from_dir` (what
// scripts/fetch_data.sh fetched), written as a dataset of their own under
// <to_dir>/MNIST/raw: real digits, small enough for a test to train on.
inline void write_mnist_subset(const std::string& from_dir, const std::string& to_dir, int train, int test) {
  for (auto [name, n] : {std::pair<std::string, int>{"train", train}, {"t10k", test}}) {
    for (auto [kind, header, record] : {std::tuple<std::string, size_t, size_t>{"images-idx3", 16, 784}, {"labels-idx1", 8, 1}}) {
      const std::string file = "/MNIST/raw/" + name + "-" + kind + "-ubyte.gz";
      gzFile f = gzopen((from_dir + file).c_str(), "rb");
      ASSERT_NE(f, nullptr) << from_dir + file << ": run bash scripts/fetch_data.sh mnist";
      std::string bytes(header + static_cast<size_t>(n) * record, '\0');
      const int got = gzread(f, bytes.data(), static_cast<unsigned>(bytes.size()));
      gzclose(f);
      ASSERT_EQ(got, static_cast<int>(bytes.size())) << from_dir + file << " holds fewer than " << n << " images";
      for (int i = 0; i < 4; ++i) bytes[4 + i] = static_cast<char>((static_cast<uint32_t>(n) >> (24 - 8 * i)) & 0xFF);
      write_file(to_dir + file, bytes, true);
    }
  }
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A run's <path>/summary.json.
inline Json read_summary(const std::string& path) { return Json::parse(read_text(path + "/summary.json")); }

// kill() for the tests: only a process (pid > 0), or with `group` the
// process group of one (pgid > 1), that the test started. As root, a pid of
// 0 or -1 would signal the test's own group or every process on the
// machine: that is refused, failing the test.
inline void send_signal(pid_t pid, int sig, bool group = false) {
  if (pid <= (group ? 1 : 0)) {
    ADD_FAILURE() << "refused to signal " << (group ? "process group " : "pid ") << pid;
    return;
  }
  kill(group ? -pid : pid, sig);
}

// A child process running the mnist_ddp binary (or, with `command`, any
// program found on PATH), its output going to a file.
class Process {
 public:
  Process(const std::vector<std::string>& args, const std::string& output_file,
          const std::vector<std::string>& extra_env = {}, bool command = false) {
    std::vector<std::string> argv;
    if (!command) argv.push_back(MNIST_DDP_BINARY);
    argv.insert(argv.end(), args.begin(), args.end());
    // Emptied before the fork: whatever the test reads there next is this process's.
    const int fd = open(output_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) throw std::runtime_error(output_file + ": " + std::strerror(errno));
    pid_ = fork();
    if (pid_ < 0) {
      close(fd);
      throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    }
    if (pid_ == 0) {
      setpgid(0, 0);  // a group of its own: the test can signal it alone
      dup2(fd, 1);
      dup2(fd, 2);
      for (const auto& kv : extra_env) putenv(const_cast<char*>(kv.c_str()));
      std::vector<char*> cargv;
      for (auto& a : argv) cargv.push_back(a.data());
      cargv.push_back(nullptr);
      execvp(cargv[0], cargv.data());
      _exit(127);
    }
    setpgid(pid_, pid_);  // as the child does: no signal to the group can come before it exists
    close(fd);
  }
  ~Process() {
    if (pid_ > 0 && !reaped_) {
      send_signal(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }

  // Waits up to `limit`; returns the wait status, or -1 on timeout.
  int wait(std::chrono::milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        reaped_ = true;
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
};

// What a shell command printed on stdout; its exit status in *status (-1
// when it did not exit normally).
inline std::string shell(const std::string& command, int* status = nullptr) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) {
    if (status) *status = -1;
    return out;
  }
  char buf[4096];
  for (size_t got; (got = fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, got);
  const int code = pclose(pipe);
  if (status) *status = WIFEXITED(code) ? WEXITSTATUS(code) : -1;
  return out;
}

// A file of /proc/PID/, "" where the process has gone meanwhile (a read of
// an ended process's file fails with ESRCH, which newer libstdc++ streams
// throw on).
inline std::string read_proc(const std::string& pid, const char* file) {
  const int fd = open(("/proc/" + pid + "/" + file).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string out;
  char buf[4096];
  for (ssize_t got; (got = read(fd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(got));
  close(fd);
  return out;
}

// The direct children of `pid`.
inline std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  for (const auto& name : files::list_directory("/proc")) {
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string line = read_proc(name, "stat");
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == pid) out.push_back(std::stoi(name));
  }
  return out;
}

// The number of lines of `text` holding `piece`.
inline int count_lines_with(const std::string& text, const std::string& piece) {
  int n = 0;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) n += line.find(piece) != std::string::npos;
  return n;
}

// Processes other than this one whose command line holds `piece`.
inline std::vector<pid_t> processes_mentioning(const std::string& piece) {
  std::vector<pid_t> out;
  for (const auto& name : files::list_directory("/proc")) {
    if (name.find_first_not_of("0123456789") != std::string::npos || std::stoi(name) == getpid()) continue;
    std::string cmdline = read_proc(name, "cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (cmdline.find(piece) != std::string::npos) out.push_back(std::stoi(name));
  }
  return out;
}

inline bool process_exists(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH); }

// The seed of a test's random choices: $MNIST_DDP_TEST_SEED, else a fresh
// one. Printed, so that any failure can be replayed with that variable.
inline unsigned test_seed() {
  const char* given = std::getenv("MNIST_DDP_TEST_SEED");
  const unsigned seed = given && *given ? static_cast<unsigned>(std::strtoul(given, nullptr, 10)) : std::random_device{}();
  std::cout << "[   SEED   ] MNIST_DDP_TEST_SEED=" << seed << " replays this test's random choices" << std::endl;
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

// A TCP port that was free a moment ago.
inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// A connection to 127.0.0.1:`port`; -1 when refused.
inline int connect_to_port(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_port = htons(static_cast<uint16_t>(port));
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&at), sizeof at) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Two processes that keep a core each busy while they live: a test that
// must pass on a loaded machine runs beside them.
class BusyLoops {
 public:
  BusyLoops() {
    for (int i = 0; i < 2; ++i)
      loops_.push_back(std::make_unique<Process>(std::vector<std::string>{"sh", "-c", "while :; do :; done"},
                                                 "/dev/null", std::vector<std::string>{}, /*command=*/true));
  }

 private:
  std::vector<std::unique_ptr<Process>> loops_;  // each ended (SIGKILL) and reaped by its destructor
};

// `line` and a newline on stderr in one write: the lines of a program's
// two ranks never interleave.
inline void write_line(const std::string& line) {
  const std::string text = line + "\n";
  if (::write(2, text.data(), text.size()) < 0) std::abort();
}

// How a program of this test binary ended under our launcher.
struct Ran {
  int code = -1;  // its exit code, 128 + a signal, or -1 where it did not end in time
  double seconds = 0;
  std::string output;
};

// This test binary's `program` (a gtest filter: "MistakeProgram.Run")
// under `mnist_ddp run --nproc 2 --timeout T`, with `env` added; it must
// end within `limit`. Checks that no process of it outlived the launcher.
inline Ran run_program(const std::string& program, const std::vector<std::string>& env, int timeout_s,
                       std::chrono::seconds limit = std::chrono::seconds(120),
                       const std::function<void(Process&, const std::string& output_file)>& meanwhile = nullptr,
                       int nproc = 2) {
  TempDir dir;
  const std::string self = read_symlink("/proc/self/exe");
  const auto start = std::chrono::steady_clock::now();
  Process p({"run", "--nproc", std::to_string(nproc), "--timeout", std::to_string(timeout_s), "--", self, "--gtest_filter=" + program,
             dir.path()},
            dir / "out.txt", env);
  if (meanwhile) meanwhile(p, dir / "out.txt");
  const int status = p.wait(limit);
  Ran ran;
  ran.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ran.output = read_text(dir / "out.txt");
  ran.code = status == -1 ? -1 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  EXPECT_TRUE(processes_mentioning(dir.path()).empty()) << program << ": a process outlived the launcher";
  return ran;
}

// How many times `piece` occurs in `text`.
inline size_t count_of(const std::string& text, const std::string& piece) {
  size_t n = 0;
  for (size_t at = text.find(piece); at != std::string::npos; at = text.find(piece, at + 1)) ++n;
  return n;
}

// Polls `done` every 20 ms until it holds or `limit` passes.
inline bool eventually(const std::function<bool()>& done, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

// For a test that made itself a child subreaper: reaps what has exited and
// waits until no child is left.
inline bool no_children_left(std::chrono::milliseconds limit) {
  return eventually(
      [] {
        while (waitpid(-1, nullptr, WNOHANG) > 0) {
        }
        return children_of(getpid()).empty();
      },
      limit);
}

// Ranks on a GPU cannot be threads of one process: LibTorch runs every
// process's CUDA backward on one thread per device, so one rank blocked in a
// collective inside backward would block the others' backward too. On a
// GPU, run_ranks() starts `world` fresh processes of this test binary (a
// fork would inherit an initialised CUDA), each running only the current
// test, as one rank over a FileStore; the parent fails when a rank does. So
// a CUDA test must assert inside `fn`: what the ranks write to variables
// stays in their processes.
inline void run_rank_processes(int world, const std::function<void(ProcessGroup&)>& fn, torch::Device device) {
  if (const char* rank = std::getenv("MNIST_DDP_TEST_RANK")) {  // this process is one of the ranks
    auto store = c10::make_intrusive<c10d::FileStore>(std::getenv("MNIST_DDP_TEST_STORE"), world);
    ProcessGroup group = make_process_group(store, std::atoi(rank), world, "gloo", device, std::chrono::seconds(60));
    fn(group);
    if (world > 1) quick_stream(group)->barrier();
    return;
  }
  TempDir dir;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter = std::string("--gtest_filter=") + info->test_suite_name() + "." + info->name();
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof self - 1), 0);
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < world; ++r)
    ranks.push_back(std::make_unique<Process>(
        std::vector<std::string>{self, filter}, dir / ("rank" + std::to_string(r) + ".txt"),
        std::vector<std::string>{"MNIST_DDP_TEST_RANK=" + std::to_string(r), "MNIST_DDP_TEST_STORE=" + (dir / "store")},
        /*command=*/true));
  for (int r = 0; r < world; ++r) {
    const int status = ranks[r]->wait(std::chrono::seconds(300));
    EXPECT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << r << " failed:\n" << read_text(dir / ("rank" + std::to_string(r) + ".txt"));
  }
}

}  // namespace mnist_ddp::test
