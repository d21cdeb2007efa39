// Logging in the reference's format, "MM/DD HH:MM:SS AM | message".
//
// After init_logging() the spdlog default logger is set up for this process:
// rank 0 writes everything to the console (stderr, as Python's StreamHandler
// does) and to <dir>/mnist_train.log; other ranks write only warnings and
// errors, to the console, prefixed with "[rank N]". Code logs with
// spdlog::info/warn/error and never asks which rank it is on.
//
// When rank 0's console is a terminal, a progress line stays under the log
// lines (show_progress); elsewhere it is never drawn.
#pragma once

#include <string>

namespace mnist_ddp {

// Throws std::runtime_error naming the file when the log file cannot be
// opened. `dumb_terminal` (TERM=dumb): no progress line, even on a terminal.
void init_logging(const std::string& dir, int rank, bool dumb_terminal);

// Whether show_progress() draws anything in this process.
bool progress_shown();

// Replaces the progress line under the log; "" removes it.
void show_progress(const std::string& line);

// Silences LibTorch's own log lines (c10's and glog's warnings), which would
// repeat, less clearly, what our one error line says, unless the user set
// their level (GLOG_minloglevel). Called first thing in every process.
void quiet_libtorch_logs(bool user_set_level);

// Logs an error line to the log file only (rank 0), for errors whose
// console line someone else prints.
void log_error_to_file(const std::string& message);

// Flushes every log and stream, then ends the process with `code` without
// the static destructors: once a process's own objects are gone, all that
// is left are LibTorch's, which deregister each of its operators, 0.3 s of
// every exit on this project's CPU machine (docs/performance.md). main()
// of mnist_ddp and of the test binary end with it.
[[noreturn]] void end_process(int code);

}  // namespace mnist_ddp
