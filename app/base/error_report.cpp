#include "app/base/error_report.hpp"

#include <unistd.h>

#include <cstdlib>
#include <iostream>

namespace mnist_ddp {

std::string error_report_line(const WorkerError& e) {
  const char* kind = e.preempted ? "\tpreempted\t" : e.echo ? "\techo\t" : "\tcause\t";
  return std::to_string(e.local_rank) + kind + e.message.substr(0, 3000) + "\n";
}

std::optional<WorkerError> parse_error_report(const std::string& line) {
  const size_t tab = line.find('\t'), tab2 = line.find('\t', tab + 1);
  if (tab == std::string::npos || tab2 == std::string::npos) return std::nullopt;
  WorkerError e;
  e.local_rank = std::atoi(line.substr(0, tab).c_str());
  e.echo = line.compare(tab + 1, tab2 - tab - 1, "echo") == 0;
  e.preempted = line.compare(tab + 1, tab2 - tab - 1, "preempted") == 0;
  e.message = line.substr(tab2 + 1);
  if (!e.message.empty() && e.message.back() == '\n') e.message.pop_back();
  return e;
}

void report_worker_error(int fd, const WorkerError& e) {
  if (fd >= 0) {
    // One write below PIPE_BUF: never interleaved with another worker's.
    const std::string line = error_report_line(e);
    if (write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size())) return;
  }
  if (e.preempted) return;
  std::cerr << "mnist_ddp: error: " << e.message << std::endl;
}

}  // namespace mnist_ddp
