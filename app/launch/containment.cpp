#include "app/launch/containment.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

#include "base/environment.hpp"

namespace mnist_ddp {
namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

// This process's cgroup in the cgroup v2 hierarchy, as a directory (its
// mount point from /proc/self/mountinfo, its path from /proc/self/cgroup,
// "0::PATH"); "" where there is no such hierarchy (cgroup v1 alone, a
// chroot without /sys).
std::string own_cgroup_directory() {
  std::ifstream mounts("/proc/self/mountinfo");
  std::string mount_point, root;
  for (std::string line; mount_point.empty() && std::getline(mounts, line);) {
    const size_t dash = line.find(" - ");
    std::string type, id, parent, device;
    if (dash == std::string::npos || !(std::istringstream(line.substr(dash + 3)) >> type) || type != "cgroup2") continue;
    std::istringstream(line.substr(0, dash)) >> id >> parent >> device >> root >> mount_point;
  }
  if (mount_point.empty()) return "";
  std::ifstream groups("/proc/self/cgroup");
  for (std::string line; std::getline(groups, line);) {
    if (line.rfind("0::", 0) != 0) continue;
    std::string path = line.substr(3);
    if (root != "/") {  // the mount shows a part of the hierarchy
      if (path.rfind(root, 0) != 0) return "";
      path = path.substr(root.size());
    }
    return mount_point + (path == "/" ? "" : path);
  }
  return "";
}

// 128 random bits in hex.
std::string random_token() {
  std::random_device device;  // /dev/urandom
  char text[40];
  std::snprintf(text, sizeof text, "%08x%08x%08x%08x", device(), device(), device(), device());
  return text;
}

// --- The watcher: async-signal-safe calls only from here on. ---

// `a` + "/" + `b` into `out`; false when it does not fit.
bool join_path(char* out, size_t size, const char* a, const char* b) {
  const size_t la = std::strlen(a), lb = std::strlen(b);
  if (la + 1 + lb + 1 > size) return false;
  std::memcpy(out, a, la);
  out[la] = '/';
  std::memcpy(out + la + 1, b, lb + 1);
  return true;
}

void pause_ms(long ms) {
  timespec t{ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, nullptr);
}

int64_t now_ms() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
}

// A directory's entries, as getdents64 gives them.
struct DirectoryEntry {
  uint64_t inode;
  int64_t offset;
  unsigned short length;
  unsigned char type;
  char name[1];
};

// Calls `each(name, type)` for every entry of the directory `fd`.
template <typename Each>
void for_each_entry(int fd, Each each) {
  alignas(8) char buffer[8192];
  for (long got; (got = syscall(SYS_getdents64, fd, buffer, sizeof buffer)) > 0;)
    for (long at = 0; at < got;) {
      const auto* entry = reinterpret_cast<const DirectoryEntry*>(buffer + at);
      at += entry->length;
      each(entry->name, entry->type);
    }
}

// The pid a /proc entry names; 0 for anything else.
pid_t pid_named(const char* name) {
  long pid = 0;
  for (const char* c = name; *c; ++c) {
    if (*c < '0' || *c > '9' || pid > 100000000) return 0;
    pid = pid * 10 + (*c - '0');
  }
  return static_cast<pid_t>(pid);
}

// SIGKILL to every process in the cgroup `dir` and below it (cgroup.kill);
// before Linux 5.14, to those in `dir` itself only (a sub-cgroup a job made
// keeps its processes there).
void kill_cgroup(const char* dir) {
  char path[4096];
  if (join_path(path, sizeof path, dir, "cgroup.kill")) {
    const int fd = open(path, O_WRONLY | O_CLOEXEC);
    const bool killed = fd >= 0 && write(fd, "1", 1) == 1;
    if (fd >= 0) close(fd);
    if (killed) return;
  }
  // Before Linux 5.14: its processes one by one, until none is left.
  if (!join_path(path, sizeof path, dir, "cgroup.procs")) return;
  const pid_t self = getpid();
  for (const int64_t until = now_ms() + 10000; now_ms() < until; pause_ms(10)) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char text[4096];
    const ssize_t got = read(fd, text, sizeof text - 1);
    close(fd);
    if (got <= 0) return;
    text[got] = '\0';
    for (char* line = text; *line;) {
      char* end = std::strchr(line, '\n');
      if (end) *end = '\0';
      const pid_t pid = pid_named(line);
      if (pid > 1 && pid != self) kill(pid, SIGKILL);  // still in the job's cgroup: the job's
      if (!end) break;
      line = end + 1;
    }
  }
}

// Removes the cgroup `dir` and the cgroups below it (a job started inside
// this one made its own), once their processes are gone.
bool remove_cgroup(const char* dir, int depth) {
  const int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT;
  for_each_entry(fd, [&](const char* name, unsigned char type) {
    char below[4096];
    if (type == DT_DIR && name[0] != '.' && depth < 16 && join_path(below, sizeof below, dir, name))
      remove_cgroup(below, depth + 1);
  });
  close(fd);
  return rmdir(dir) == 0 || errno == ENOENT;
}

// SIGKILL to every process whose environment carries `token`, through a
// pidfd taken before its environment is read: a pid that ended and was
// reused meanwhile is never signalled. Again, until a pass finds none (what
// they started meanwhile carries it too).
void kill_carriers(const char* token) {
  const pid_t self = getpid();
  for (const int64_t until = now_ms() + 10000; now_ms() < until; pause_ms(10)) {
    const int proc = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (proc < 0) return;
    int ended = 0;
    for_each_entry(proc, [&](const char* name, unsigned char) {
      const pid_t pid = pid_named(name);
      if (pid <= 1 || pid == self) return;
      const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
      if (pidfd < 0 && errno != ENOSYS) return;  // gone already
      if (process_carries_job(pid, token)) {
        if (pidfd >= 0)
          syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0);
        else
          kill(pid, SIGKILL);  // before Linux 5.3
        ++ended;
      }
      if (pidfd >= 0) close(pidfd);
    });
    close(proc);
    if (ended == 0) return;
  }
}

// Closes every descriptor from 3 up but `keep_a` and `keep_b`.
void close_all_but(int keep_a, int keep_b) {
  const int low = keep_a < keep_b ? keep_a : keep_b, high = keep_a < keep_b ? keep_b : keep_a;
  const unsigned ranges[3][2] = {{3, static_cast<unsigned>(low - 1)},
                                 {static_cast<unsigned>(low + 1), static_cast<unsigned>(high - 1)},
                                 {static_cast<unsigned>(high + 1), ~0U}};
  for (const auto& range : ranges) {
    if (range[0] > range[1]) continue;
    if (syscall(SYS_close_range, range[0], range[1], 0) == 0) continue;
    rlimit limit{};  // before Linux 5.9
    getrlimit(RLIMIT_NOFILE, &limit);
    for (unsigned fd = range[0]; fd <= range[1] && fd < limit.rlim_cur; ++fd) close(static_cast<int>(fd));
  }
}

// The watcher's life: out of the launcher's session (a signal to its
// process group or terminal does not reach it; the launcher's blocked
// signals stay blocked), holding nothing of the launcher's but its two
// pipes, it waits for the launcher to end, then ends the job.
[[noreturn]] void watch(int watch_fd, int done_fd, const char* cgroup, const char* token) {
  setsid();
  prctl(PR_SET_NAME, "mnist_ddp-watch");
  watch_fd = fcntl(watch_fd, F_DUPFD, 3);  // above 0-2, which /dev/null takes
  done_fd = fcntl(done_fd, F_DUPFD, 3);
  const int null = open("/dev/null", O_RDWR);
  for (int fd = 0; fd < 3; ++fd) null >= 0 ? dup2(null, fd) : close(fd);
  close_all_but(watch_fd, done_fd);
  char byte;
  for (ssize_t got; (got = read(watch_fd, &byte, 1)) != 0;)
    if (got < 0 && errno != EINTR) break;
  if (*cgroup) kill_cgroup(cgroup);
  kill_carriers(token);
  if (*cgroup)
    for (const int64_t until = now_ms() + 10000; !remove_cgroup(cgroup, 0) && now_ms() < until;) pause_ms(10);
  _exit(0);
}

}  // namespace

JobContainment::JobContainment(bool cgroup) : token_(random_token()) {
  if (cgroup) make_cgroup();
  try {
    start_watcher();
  } catch (const std::exception&) {
    if (procs_fd_ >= 0) close(procs_fd_);
    if (!cgroup_.empty()) rmdir(cgroup_.c_str());
    throw;
  }
}

bool JobContainment::make_cgroup() {
  const std::string parent = own_cgroup_directory();
  if (parent.empty()) return false;
  const std::string dir = parent + "/mnist_ddp-" + std::to_string(getpid()) + "-" + token_.substr(0, 8);
  if (mkdir(dir.c_str(), 0755) != 0) return false;  // not ours to divide (EACCES, EROFS)
  // Whether a child may join it: one that does, and exits.
  const int fd = open((dir + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC);
  bool joins = false;
  if (fd >= 0) {
    const pid_t probe = fork();
    if (probe == 0) _exit(write(fd, "0", 1) == 1 ? 0 : 1);
    int status = 0;
    joins = probe > 0 && waitpid(probe, &status, 0) == probe && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!joins) {
    if (fd >= 0) close(fd);
    rmdir(dir.c_str());
    return false;
  }
  cgroup_ = dir;
  procs_fd_ = fd;
  return true;
}

void JobContainment::start_watcher() {
  int watch_pipe[2], done_pipe[2];
  if (pipe2(watch_pipe, O_CLOEXEC) != 0) throw_errno("pipe");
  if (pipe2(done_pipe, O_CLOEXEC) != 0) {
    close(watch_pipe[0]);
    close(watch_pipe[1]);
    throw_errno("pipe");
  }
  const char* const cgroup = cgroup_.c_str();
  const char* const token = token_.c_str();
  // Started by a child that exits at once, so that the watcher is no child
  // of the launcher's (which ends its children) and outlives it.
  const pid_t middle = fork();
  if (middle < 0) {
    for (int fd : {watch_pipe[0], watch_pipe[1], done_pipe[0], done_pipe[1]}) close(fd);
    throw_errno("fork");
  }
  if (middle == 0) {
    const pid_t watcher = fork();
    if (watcher == 0) watch(watch_pipe[0], done_pipe[1], cgroup, token);
    _exit(watcher > 0 ? 0 : 1);
  }
  int status = 0;
  waitpid(middle, &status, 0);
  close(watch_pipe[0]);
  close(done_pipe[1]);
  watch_fd_ = watch_pipe[1];
  done_fd_ = done_pipe[0];
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) throw std::runtime_error("fork: could not start the job's watcher");
}

JobContainment::~JobContainment() {
  close(watch_fd_);
  pollfd done = {done_fd_, POLLIN, 0};
  char byte;
  for (const int64_t until = now_ms() + 30000; now_ms() < until;) {
    if (poll(&done, 1, 100) < 0 && errno != EINTR) break;
    if (done.revents && read(done_fd_, &byte, 1) <= 0) break;  // EOF: the watcher has finished
  }
  close(done_fd_);
  if (procs_fd_ >= 0) close(procs_fd_);
}

}  // namespace mnist_ddp
