// A node's child processes, from fork to reaping: the part of the launcher
// that owns processes and signals.
//
// Signals come from a signalfd, so none can arrive between two checks: the
// caller must have blocked SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGCHLD in
// every thread (block_launcher_signals(), first thing in main()). Children
// report why they failed through one pipe (error_report.hpp), whose write
// end each child inherits. A child only makes async-signal-safe calls
// between fork and exec, gets the original signal mask back, and dies with
// the supervisor (PR_SET_PDEATHSIG). The destructor stops and reaps every
// child still running.
//
// Runs on one thread; nothing here is thread-safe.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "app/base/error_report.hpp"

namespace mnist_ddp {

// Blocks, in the calling thread, the signals a supervisor reads (SIGINT,
// SIGTERM, SIGHUP, SIGUSR1, SIGCHLD), and returns the mask it had. Called
// first thing in main(): every thread started later (the OpenMP pool a
// checkpoint's tensors are copied on, the store's) inherits the block, so
// none of them can take a signal and drop it.
sigset_t block_launcher_signals();

// "exited with status 3", "was killed by signal 9 (Killed)".
std::string describe_status(int status);
// The exit code a wait status stands for: the status, or 128 + the signal.
int exit_code_of(int status);

// Makes this process the subreaper of what it starts (PR_SET_CHILD_SUBREAPER):
// a descendant whose parent ends (a worker's background process, one under
// setsid or daemon()) becomes this process's child, not init's. The
// launcher's, once, before it starts workers.
void become_subreaper();
// Ends what a subreaper inherited: every child of this process once its
// Supervisor's children are reaped gets SIGTERM, SIGKILL after `grace`,
// and is reaped; again, until no child is left (the orphans' own children
// come next). Only for a process whose every child is a Supervisor's or
// inherited (the launcher). Returns how many it ended.
int end_orphans(std::chrono::milliseconds grace);

class Supervisor {
 public:
  // A child that ended unsuccessfully.
  struct Failure {
    int index = 0;  // as given to start()
    pid_t pid = -1;
    int status = 0;  // as waitpid() returns it
    std::optional<WorkerError> report;  // what the child said before it exited, if anything
    bool echo() const { return report && report->echo; }
  };
  // What wait() saw: a signal to this process, a failed child, or neither
  // (the timeout passed, or every child has exited).
  struct Event {
    int signal = 0;
    std::optional<Failure> failure;
  };

  // Children start with `child_mask` as their signal mask (the mask before
  // block_launcher_signals()). Throws std::runtime_error when the signalfd
  // or the pipe cannot be made.
  explicit Supervisor(const sigset_t& child_mask);
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // The write end of the error pipe, for the children's environment.
  int report_fd() const { return report_write_fd_; }
  // Children started from now on join the cgroup whose cgroup.procs `fd`
  // is open for writing (containment.hpp) before exec; -1: none. One that
  // cannot starts all the same.
  void set_cgroup(int procs_fd) { cgroup_procs_fd_ = procs_fd; }

  // Starts `program` with `argv` (argv[0] included) and `env`, as child
  // `index`. Throws std::runtime_error when fork fails.
  void start(int index, const std::string& program, const std::vector<std::string>& argv,
             const std::vector<std::string>& env);
  bool any_running() const;

  // Waits up to `timeout` (negative: without limit) for a signal to this
  // process or a child's failure, reaping children as they exit. A failure
  // that only echoes another's (WorkerError::echo) waits up to
  // `cause_wait` for the cause from another child. A child that said
  // nothing to us (mnist_ddp run's program that exited with a failing code,
  // any child killed by a signal) gives the others up to a second to end
  // on their own: ranks that fail together (a collective the library names
  // on every rank, the same mistake on each) or outlive a killed one each
  // print their own line before they are stopped.
  Event wait(std::chrono::milliseconds timeout,
             std::chrono::milliseconds cause_wait = std::chrono::seconds(3));

  // Sends `sig` to every running child, SIGKILL to what is left after
  // `grace`, and reaps them all.
  void stop(int sig, std::chrono::steady_clock::duration grace);

 private:
  struct Child {
    int index = 0;
    pid_t pid = -1;
    bool running = false;
  };
  void read_reports();
  std::optional<Failure> reap();

  sigset_t child_mask_;
  int signal_fd_ = -1;
  int report_fd_ = -1, report_write_fd_ = -1;
  int cgroup_procs_fd_ = -1;
  std::vector<Child> children_;
  std::string report_text_;                 // read from the pipe, not yet a whole line
  std::vector<WorkerError> reports_;        // each child's first report, by index (local rank)
};

}  // namespace mnist_ddp
