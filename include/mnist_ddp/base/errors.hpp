// The errors mnist_ddp throws, and the one line a user reads.
//
// Code throws with context; the top of a program turns what it catches into
// one line (error_line()) and an exit code: the mnist_ddp application exits
// 2 for a UsageError, 1 for anything else. A user never sees a stack trace.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

namespace mnist_ddp {

// Something the user must fix: a command line, a launcher's environment, a
// model or option the library cannot take as given. what() is a single line
// that names the flag, variable or tensor and what is allowed.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A failure that only echoes another process's: the store or a peer went
// away. A launcher prefers a cause reported by another worker.
struct PeerLost : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// An exception's first line, without the backtrace LibTorch appends to its own.
std::string error_line(const std::exception& e);

}  // namespace mnist_ddp
