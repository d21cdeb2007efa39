// What keeps every process of a job from outliving its launcher, even a
// launcher killed with SIGKILL, which it cannot catch.
//
// While the launcher runs, it ends what its workers leave behind itself
// (end_orphans(), supervisor.hpp). For the moment it cannot, it starts a
// watcher first: a small process of its own session, outside the job,
// that waits on a pipe from the launcher and, when the pipe closes (the
// launcher ended, however it ended), ends every process of the job with
// SIGKILL:
// - the job's cgroup (cgroup v2), where this process may make one: each
//   worker joins it before exec, and nothing a worker starts can leave it
//   (setsid, nohup, `&`, a double fork, daemon()); the watcher writes its
//   cgroup.kill (cgroup.procs, one by one, before Linux 5.14) and removes it;
// - every process whose environment carries the job's token (MNIST_DDP_JOB,
//   which each worker gets and what it starts inherits), found in /proc and
//   signalled through a pidfd, so that a pid reused meanwhile is never
//   signalled: where no cgroup can be made, and for what left the cgroup.
// A process that left the cgroup and also dropped or overwrote its
// environment (env -i, setproctitle()) escapes; docs/clusters.md says so.
//
// The watcher makes only async-signal-safe calls (the launcher may have
// threads when it forks), signals no pid below 2 and never its own.
#pragma once

#include <sys/types.h>

#include <string>

namespace mnist_ddp {

class JobContainment {
 public:
  // Draws the job's token, makes the job's cgroup unless `cgroup` is false
  // (the token alone, as where none can be made), and starts the watcher.
  // Before become_subreaper(): the watcher is not this process's child.
  // Throws std::runtime_error when the pipes or forks fail.
  explicit JobContainment(bool cgroup);
  // Closes the pipe and waits (up to 30 s) until the watcher has ended
  // whatever of the job is left and removed the cgroup.
  ~JobContainment();
  JobContainment(const JobContainment&) = delete;
  JobContainment& operator=(const JobContainment&) = delete;

  // The token every worker's environment carries (WorkerEnv::job).
  const std::string& token() const { return token_; }
  // The cgroup's directory, "" where there is none.
  const std::string& cgroup() const { return cgroup_; }
  // Its cgroup.procs, open for writing (a child joins by writing "0"); -1
  // where there is none.
  int cgroup_procs_fd() const { return procs_fd_; }

 private:
  bool make_cgroup();
  void start_watcher();

  std::string token_;
  std::string cgroup_;
  int procs_fd_ = -1;
  int watch_fd_ = -1;  // the watcher reads this pipe's other end until EOF
  int done_fd_ = -1;   // EOF here once the watcher has finished
};

}  // namespace mnist_ddp
