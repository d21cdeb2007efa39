#include "mnist_ddp/logging.hpp"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <memory>
#include <vector>

namespace mnist_ddp {
namespace {
bool g_ready = false;
spdlog::sink_ptr g_file_sink;
}

void init_logging(const std::string& dir, int rank) {
  const std::string pattern = rank == 0 ? "%m/%d %I:%M:%S %p | %v"
                                        : "%m/%d %I:%M:%S %p | [rank " + std::to_string(rank) + "] %v";
  std::vector<spdlog::sink_ptr> sinks{std::make_shared<spdlog::sinks::stderr_sink_mt>()};
  if (rank == 0) {
    const std::string file = (std::filesystem::path(dir) / "mnist_train.log").string();
    try {
      g_file_sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(file);
      sinks.push_back(g_file_sink);
    } catch (const spdlog::spdlog_ex& e) {
      throw std::runtime_error("cannot open log file " + file + ": " + e.what());
    }
  }
  auto logger = std::make_shared<spdlog::logger>("mnist_ddp", sinks.begin(), sinks.end());
  logger->set_pattern(pattern);
  logger->set_level(rank == 0 ? spdlog::level::info : spdlog::level::warn);
  logger->flush_on(spdlog::level::info);  // a killed run keeps every line it logged
  spdlog::set_default_logger(logger);
  g_ready = true;
}

bool logging_ready() { return g_ready; }

void log_error_to_file(const std::string& message) {
  if (!g_file_sink) return;
  spdlog::logger file_only("mnist_ddp", g_file_sink);
  file_only.set_pattern("%m/%d %I:%M:%S %p | %v");
  file_only.error("error: {}", message);
  file_only.flush();
}

}  // namespace mnist_ddp
