// The errors mnist_ddp throws, and the one line a user reads.
//
// Every exception that reaches a program from the library derives from
// mnist_ddp::Error, and its what() is one line that says what happened in
// the library's words; where a backend (Gloo, NCCL, c10) failed below, its
// own text follows ours. A program catches mnist_ddp::Error, prints what()
// and exits non-zero (the mnist_ddp application exits 2 for a UsageError, 1
// for anything else). A user never sees a stack trace.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

namespace mnist_ddp {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Something the user must fix: a command line, a launcher's environment, a
// model, hook or option the library cannot take as given, or a call made
// out of turn. Names the flag, variable, tensor or call and what is allowed.
struct UsageError : Error {
  using Error::Error;
};

// The ranks issued collectives that do not match: a different model, hook
// or option on one rank, a SyncBatchNorm forward on some ranks only, a rank
// whose data ran out. Says what each rank was doing, and what to do.
struct CollectiveMismatch : Error {
  using Error::Error;
};

// A peer, or the store, went away: this rank's failure only echoes another
// process's. A launcher prefers a cause that another process reports.
struct PeerLost : Error {
  using Error::Error;
};

// Something the job waited for did not come within its timeout
// (ProcessGroupOptions::timeout): a rank that never arrived, a store that
// stopped answering.
struct Timeout : Error {
  using Error::Error;
};

// An exception's first line, without the backtrace LibTorch appends to its own.
std::string error_line(const std::exception& e);

}  // namespace mnist_ddp
