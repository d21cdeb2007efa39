#include "app/base/logging.hpp"


#include <dlfcn.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <c10/util/Logging.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <mutex>
#include <vector>

#include "app/base/files.hpp"

namespace mnist_ddp {
namespace {

// The console of a terminal: log lines scroll above a progress line that is
// redrawn in place.
class TerminalSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  void show(const std::string& progress) {
    std::lock_guard<std::mutex> lock(mutex_);
    erase();
    progress_ = progress;
    draw();
    std::fflush(stderr);
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t line;
    formatter_->format(msg, line);
    erase();
    std::fwrite(line.data(), 1, line.size(), stderr);
    draw();
    std::fflush(stderr);
  }
  void flush_() override { std::fflush(stderr); }

 private:
  void erase() {
    if (!progress_.empty()) std::fputs("\r\033[K", stderr);
  }
  // Cut to the terminal's width: a wrapped line could not be redrawn in place.
  void draw() {
    if (progress_.empty()) return;
    winsize size{};
    const size_t width = ioctl(STDERR_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 1 ? size.ws_col - 1 : 79;
    std::fputs(progress_.substr(0, width).c_str(), stderr);
  }

  std::string progress_;
};

// <path>/mnist_train.log, appended through a descriptor opened in the run's
// directory without following a link (files.hpp): each line is one write.
class RunLogSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit RunLogSink(files::AppendFile file) : file_(std::move(file)) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t line;
    formatter_->format(msg, line);
    file_.write(std::string(line.data(), line.size()));
  }
  void flush_() override {}

 private:
  files::AppendFile file_;
};

spdlog::sink_ptr g_file_sink;
std::shared_ptr<TerminalSink> g_terminal;

}  // namespace

void init_logging(const std::string& dir, int rank, bool dumb_terminal) {
  const std::string pattern = rank == 0 ? "%m/%d %I:%M:%S %p | %v"
                                        : "%m/%d %I:%M:%S %p | [rank " + std::to_string(rank) + "] %v";
  std::vector<spdlog::sink_ptr> sinks;
  if (rank == 0 && isatty(STDERR_FILENO) && !dumb_terminal) {
    g_terminal = std::make_shared<TerminalSink>();
    sinks.push_back(g_terminal);
  } else {
    sinks.push_back(std::make_shared<spdlog::sinks::stderr_sink_mt>());
  }
  if (rank == 0) {
    g_file_sink = std::make_shared<RunLogSink>(files::RunDirectory(dir).append("mnist_train.log"));
    sinks.push_back(g_file_sink);
  }
  auto logger = std::make_shared<spdlog::logger>("mnist_ddp", sinks.begin(), sinks.end());
  logger->set_pattern(pattern);
  logger->set_level(rank == 0 ? spdlog::level::info : spdlog::level::warn);
  logger->flush_on(spdlog::level::info);  // a killed run keeps every line it logged
  spdlog::set_default_logger(logger);
}


bool progress_shown() { return g_terminal != nullptr; }

void show_progress(const std::string& line) {
  if (g_terminal) g_terminal->show(line);
}

void log_error_to_file(const std::string& message) {
  if (!g_file_sink) return;
  spdlog::logger file_only("mnist_ddp", g_file_sink);
  file_only.set_pattern("%m/%d %I:%M:%S %p | %v");
  file_only.error("error: {}", message);
  file_only.flush();
}

void quiet_libtorch_logs(bool user_set_level) {
  if (user_set_level) return;  // GLOG_minloglevel: the user's choice
  FLAGS_caffe2_log_level = 3;                    // c10's own logging (LibTorch built without glog)
  // glog's, where LibTorch logs through it (Debian's); looked up, as other
  // LibTorch builds have no glog.
  if (auto* level = static_cast<int32_t*>(dlsym(RTLD_DEFAULT, "_ZN3fLI17FLAGS_minloglevelE"))) *level = 3;
}

void end_process(int code) {
  spdlog::shutdown();
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(code);
}

}  // namespace mnist_ddp
