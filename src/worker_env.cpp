#include "mnist_ddp/worker_env.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <functional>
#include <tuple>
#include <cstdlib>
#include <iostream>
#include <set>

#include "mnist_ddp/options.hpp"

namespace mnist_ddp {
namespace {

int env_int(const char* name, std::optional<int> fallback) {
  const char* value = std::getenv(name);
  if (!value || !*value) {
    if (fallback) return *fallback;
    throw UsageError(std::string("environment variable ") + name + " is not set");
  }
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value, &end, 10);
  if (errno || *end || v < 0 || v > 1 << 30)
    throw UsageError(std::string("environment variable ") + name + "='" + value + "' is not a non-negative integer");
  return static_cast<int>(v);
}

// What any launcher sets, and the variables by which our launcher talks to
// its workers.
const std::set<std::string> kLauncherVariables = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                  "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "MNIST_DDP_NNODES",
                                                  "MNIST_DDP_ROUND", "MNIST_DDP_ERROR_FD"};

// The store's port under Slurm unless MASTER_PORT says: one of 20000-29999
// that follows SLURM_JOB_ID (a requeued job keeps its id, and its port).
int slurm_job_port() { return 20000 + env_int("SLURM_JOB_ID", 0) % 10000; }

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  size_t end = 0;
  for (int depth = 0; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    if (nodelist[end] == ']') --depth;
    if (nodelist[end] == ',' && depth == 0) break;
  }
  const std::string first = nodelist.substr(0, end);
  const size_t open = first.find('[');
  if (open == std::string::npos) return first;
  const size_t close = first.find(']', open);
  const std::string range = first.substr(open + 1, close - open - 1);
  const std::string head = range.substr(0, range.find_first_of(",-"));
  return first.substr(0, open) + head + (close == std::string::npos ? "" : first.substr(close + 1));
}

std::optional<WorkerEnv> worker_env_from_environment() {
  WorkerEnv env;
  auto master_addr = [](const std::string& fallback) {
    const char* addr = std::getenv("MASTER_ADDR");
    return addr && *addr ? std::string(addr) : fallback;
  };
  if (std::getenv("RANK") && std::getenv("WORLD_SIZE")) {  // torchrun, or set by hand
    env.rank = env_int("RANK", std::nullopt);
    env.world_size = env_int("WORLD_SIZE", std::nullopt);
    env.local_rank = env_int("LOCAL_RANK", env.rank);
    env.local_world_size = env_int("LOCAL_WORLD_SIZE", env.world_size);
    env.node_rank = env_int("GROUP_RANK", 0);
    env.master_addr = master_addr("127.0.0.1");
    env.master_port = env_int("MASTER_PORT", std::nullopt);
    const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    env.agent_store = agent && std::string(agent) == "True";
    env.restart = env_int("TORCHELASTIC_RESTART_COUNT", 0);
  } else if (std::getenv("SLURM_PROCID") && std::getenv("SLURM_NTASKS")) {  // srun
    env.rank = env_int("SLURM_PROCID", std::nullopt);
    env.world_size = env_int("SLURM_NTASKS", std::nullopt);
    env.local_rank = env_int("SLURM_LOCALID", 0);
    const char* per_node = std::getenv("SLURM_TASKS_PER_NODE");  // e.g. "4(x2),2"
    env.local_world_size = per_node ? std::max(1, std::atoi(per_node)) : 1;
    env.local_rank = std::min(env.local_rank, env.local_world_size - 1);
    env.node_rank = env_int("SLURM_NODEID", 0);
    const char* nodes = std::getenv("SLURM_JOB_NODELIST");
    if (!nodes) nodes = std::getenv("SLURM_NODELIST");
    env.master_addr = master_addr(nodes ? first_slurm_host(nodes) : "");
    if (env.master_addr.empty())
      throw UsageError("environment: Slurm gives no SLURM_JOB_NODELIST; set MASTER_ADDR to node 0's address");
    // A port of the job's own, so that two jobs on one node do not meet.
    env.master_port = env_int("MASTER_PORT", slurm_job_port());
    env.restart = env_int("SLURM_RESTART_COUNT", 0);  // a requeued job's
  } else if (std::getenv("MNIST_DDP_NNODES")) {  // our launcher
    env.nnodes = env_int("MNIST_DDP_NNODES", std::nullopt);
    env.node_rank = env_int("GROUP_RANK", std::nullopt);
    env.local_rank = env_int("LOCAL_RANK", std::nullopt);
    env.local_world_size = env_int("LOCAL_WORLD_SIZE", std::nullopt);
    env.master_addr = master_addr("127.0.0.1");
    env.master_port = env_int("MASTER_PORT", std::nullopt);
    env.round = env_int("MNIST_DDP_ROUND", std::nullopt);
    env.restart = env.round;
  } else {
    return std::nullopt;
  }
  env.error_report_fd = env_int("MNIST_DDP_ERROR_FD", -1);
  if (env.rank >= 0 && (env.world_size < 1 || env.rank >= env.world_size))
    throw UsageError("environment: RANK=" + std::to_string(env.rank) + " is not below WORLD_SIZE=" +
                     std::to_string(env.world_size));
  if (env.local_rank >= env.local_world_size)
    throw UsageError("environment: LOCAL_RANK=" + std::to_string(env.local_rank) + " is not below LOCAL_WORLD_SIZE=" +
                     std::to_string(env.local_world_size));
  if (env.master_port == 0)
    throw UsageError("environment: MASTER_PORT=0: every rank must know the store's port, so it cannot be picked "
                     "at random; set a fixed one, or unset it (under Slurm it then follows SLURM_JOB_ID)");
  return env;
}

std::string apply_launcher_environment(Options& opts, const WorkerEnv& env) {
  if (env.round >= 0) return "";  // our launcher's worker: the flags are the launcher's
  const int nnodes = env.world_size % env.local_world_size == 0 ? env.world_size / env.local_world_size : opts.nnodes;
  const std::vector<std::tuple<std::string, std::string, std::function<void()>>> decided = {
      {"master_addr", env.master_addr, [&] { opts.master_addr = env.master_addr; }},
      {"master_port", std::to_string(env.master_port), [&] { opts.master_port = env.master_port; }},
      {"nproc", std::to_string(env.local_world_size), [&] { opts.nproc = env.local_world_size; }},
      {"nnodes", std::to_string(nnodes), [&] { opts.nnodes = nnodes; }},
      {"node_rank", std::to_string(env.node_rank), [&] { opts.node_rank = env.node_rank; }},
  };
  std::string overridden;
  for (const auto& [name, value, set] : decided) {
    set();
    for (auto& [arg, old] : opts.arguments) {
      if (arg != name || old == value) continue;
      if (std::find(opts.given.begin(), opts.given.end(), name) != opts.given.end()) {
        std::string flag = "--" + name;
        std::replace(flag.begin(), flag.end(), '_', '-');
        overridden += (overridden.empty() ? "" : ", ") + flag + " " + value + " (given " + old + ")";
      }
      old = value;
    }
  }
  return overridden.empty() ? "" : "the launcher's environment overrides the command line: " + overridden;
}

std::vector<std::string> worker_environment(const WorkerEnv& env, const std::vector<std::string>& parent, int cores) {
  std::vector<std::string> out;
  bool threads = false;
  for (const std::string& kv : parent) {
    const std::string key = kv.substr(0, kv.find('='));
    if (kLauncherVariables.count(key)) continue;
    threads |= key == "OMP_NUM_THREADS";
    out.push_back(kv);
  }
  // No RANK or WORLD_SIZE: the workers of all nodes agree on them through
  // the store, so no node needs to know how many workers the others run.
  out.push_back("LOCAL_RANK=" + std::to_string(env.local_rank));
  out.push_back("LOCAL_WORLD_SIZE=" + std::to_string(env.local_world_size));
  out.push_back("GROUP_RANK=" + std::to_string(env.node_rank));
  out.push_back("MNIST_DDP_NNODES=" + std::to_string(env.nnodes));
  out.push_back("MASTER_ADDR=" + env.master_addr);
  out.push_back("MASTER_PORT=" + std::to_string(env.master_port));
  out.push_back("MNIST_DDP_ROUND=" + std::to_string(env.round));
  if (env.error_report_fd >= 0) out.push_back("MNIST_DDP_ERROR_FD=" + std::to_string(env.error_report_fd));
  // Each worker's share of the cores, for every OpenMP pool it starts
  // (ATen's and OpenBLAS's, on any thread), unless the user set one.
  if (!threads) out.push_back("OMP_NUM_THREADS=" + std::to_string(std::max(1, cores / std::max(1, env.local_world_size))));
  return out;
}

std::string error_report_line(const WorkerError& e) {
  return std::to_string(e.local_rank) + (e.echo ? "\techo\t" : "\tcause\t") + e.message.substr(0, 3000) + "\n";
}

std::optional<WorkerError> parse_error_report(const std::string& line) {
  const size_t tab = line.find('\t'), tab2 = line.find('\t', tab + 1);
  if (tab == std::string::npos || tab2 == std::string::npos) return std::nullopt;
  WorkerError e;
  e.local_rank = std::atoi(line.substr(0, tab).c_str());
  e.echo = line.compare(tab + 1, tab2 - tab - 1, "echo") == 0;
  e.message = line.substr(tab2 + 1);
  if (!e.message.empty() && e.message.back() == '\n') e.message.pop_back();
  return e;
}

void report_worker_error(const WorkerEnv& env, int rank, const std::string& message, bool echo) {
  const std::string who = rank >= 0 ? "rank " + std::to_string(rank)
                                    : "node " + std::to_string(env.node_rank) + " local rank " +
                                          std::to_string(env.local_rank);
  if (env.error_report_fd >= 0) {
    // One write below PIPE_BUF: never interleaved with another worker's.
    const std::string line = error_report_line({env.local_rank, echo, who + ": " + message});
    if (write(env.error_report_fd, line.data(), line.size()) == static_cast<ssize_t>(line.size())) return;
  }
  std::cerr << "mnist_ddp: error: " << who << ": " << message << std::endl;
}

}  // namespace mnist_ddp
