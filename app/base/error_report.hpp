// How a worker tells its launcher why it failed, or that it was preempted:
// one line through a pipe.
//
// Our launcher gives every worker the write end of one pipe
// (WorkerEnv::error_report_fd). A failing worker writes one line there
// instead of printing it, so the user reads the one cause, not one line per
// worker; the launcher prefers a worker's own failure over an echo of it.
#pragma once

#include <optional>
#include <string>

namespace mnist_ddp {

// A worker's fatal error, as it travels to the launcher.
struct WorkerError {
  int local_rank = 0;
  bool echo = false;     // it only follows from another process's failure (PeerLost)
  std::string message;   // "rank 3: ..." or "node 1 local rank 0: ..."
  bool preempted = false;  // not a failure: the job stopped at a checkpointed step on a preemption signal
};

// One line, "<local rank>\t<cause|echo|preempted>\t<message>\n", short
// enough for one atomic pipe write; and back.
std::string error_report_line(const WorkerError& e);
std::optional<WorkerError> parse_error_report(const std::string& line);

// Reports `e` in one write to `fd` when it is a launcher's pipe (>= 0);
// otherwise, or when that write fails, prints "mnist_ddp: error: <message>"
// on stderr (a preemption prints nothing: rank 0's log says it).
void report_worker_error(int fd, const WorkerError& e);

}  // namespace mnist_ddp
