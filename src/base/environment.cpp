#include "base/environment.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>  // environ

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <sstream>

#include "mnist_ddp/base/errors.hpp"

namespace mnist_ddp {
namespace {

// When this process started: at static initialisation, before main().
const double g_process_start = unix_seconds();

// What any launcher sets, and the variables by which our launcher talks to
// its workers: never passed on from a launcher to its workers.
const std::set<std::string> kLauncherVariables = {
    "RANK",          "LOCAL_RANK",     "WORLD_SIZE",         "LOCAL_WORLD_SIZE",      "GROUP_RANK",
    "MASTER_ADDR",   "MASTER_PORT",    "MNIST_DDP_NNODES",   "MNIST_DDP_ROUND",       "MNIST_DDP_ERROR_FD",
    "MNIST_DDP_LAUNCH_TIME", "MNIST_DDP_BACKEND", "MNIST_DDP_DEVICE", "NODE_RANK", "MNIST_DDP_STORE_PREFIX",
    "MNIST_DDP_TIMEOUT_MS"};

// The job tokens of the launchers a process was started under (containment.hpp).
constexpr char kJobVariable[] = "MNIST_DDP_JOB";

// Whether `entry` ("KEY=VALUE") is MNIST_DDP_JOB with `token` among its
// comma-separated values. Async-signal-safe.
bool job_entry_holds(const char* entry, const char* token) {
  const size_t name = sizeof kJobVariable - 1, length = std::strlen(token);
  if (length == 0 || std::strncmp(entry, kJobVariable, name) != 0 || entry[name] != '=') return false;
  for (const char* value = entry + name + 1;;) {
    const char* end = std::strchr(value, ',');
    const size_t size = end ? static_cast<size_t>(end - value) : std::strlen(value);
    if (size == length && std::strncmp(value, token, length) == 0) return true;
    if (!end) return false;
    value = end + 1;
  }
}

// Reads integers out of an Environment, naming the variable when one is malformed.
class Reader {
 public:
  explicit Reader(const Environment& env) : env_(env) {}

  bool has(const char* name) const { return env_.get(name).has_value(); }

  std::string text(const char* name, const std::string& fallback = "") const {
    const auto v = env_.get(name);
    return v && !v->empty() ? *v : fallback;
  }

  // A non-negative integer; `fallback` when unset or empty, else required.
  int integer(const char* name, std::optional<int> fallback) const {
    const auto value = env_.get(name);
    if (!value || value->empty()) {
      if (fallback) return *fallback;
      throw UsageError(std::string("environment variable ") + name + " is not set");
    }
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(value->c_str(), &end, 10);
    if (errno || *end || v < 0 || v > 1 << 30)
      throw UsageError(std::string("environment variable ") + name + "='" + *value +
                       "' is not a non-negative integer");
    return static_cast<int>(v);
  }

 private:
  const Environment& env_;
};

}  // namespace

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::optional<std::string> Environment::get(const std::string& name) const {
  for (const std::string& kv : variables)
    if (kv.size() > name.size() && kv[name.size()] == '=' && kv.compare(0, name.size(), name) == 0)
      return kv.substr(name.size() + 1);
  return std::nullopt;
}

Environment read_environment() {
  std::vector<std::string> variables;
  for (char** e = environ; *e; ++e) variables.emplace_back(*e);
  Environment env = environment_from(variables, g_process_start);
  env.parent_pid = static_cast<int>(getppid());
  return env;
}

Environment environment_from(const std::vector<std::string>& variables, double process_start) {
  Environment env;
  env.variables = variables;
  const Reader read(env);
  env.master_addr = read.text("MASTER_ADDR");
  env.master_port = read.text("MASTER_PORT");
  env.cuda_visible_devices = env.get("CUDA_VISIBLE_DEVICES");
  const int threads = std::atoi(read.text("OMP_NUM_THREADS", "0").c_str());
  env.omp_num_threads = std::max(0, threads);
  const std::string launched = read.text("MNIST_DDP_LAUNCH_TIME");
  env.launch_time = launched.empty() ? process_start : std::atof(launched.c_str());
  env.dumb_terminal = read.text("TERM") == "dumb";
  env.secret.value = read.text("MNIST_DDP_SECRET");
  env.secret.file = env.secret.value.empty() ? read.text("MNIST_DDP_SECRET_FILE") : "";
  env.libtorch_log_level = read.has("GLOG_minloglevel");
  return env;
}

std::string Secret::read(std::string* warning) const {
  if (file.empty()) return value;
  const std::string name = "MNIST_DDP_SECRET_FILE=" + file;
  const std::string advice = ": give every node of the job the same file, readable by you alone, holding the "
                             "job's secret";
  struct stat st;
  if (stat(file.c_str(), &st) != 0)
    throw UsageError(name + ": " + std::strerror(errno) + advice);
  if (S_ISDIR(st.st_mode)) throw UsageError(name + " is a directory, not a file" + advice);
  std::ifstream in(file, std::ios::binary);
  if (!in) throw UsageError(name + " cannot be read (" + std::strerror(errno) + ")" + advice);
  std::string secret((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
  if (in.bad()) throw UsageError(name + " cannot be read" + advice);
  if (secret.empty()) throw UsageError(name + " is empty" + advice);
  if (warning && (st.st_mode & 077)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    *warning = name + " can be read by other users (mode " + mode + "): keep it readable by you alone (chmod 600)";
  }
  return secret;
}

bool process_carries_job(int pid, const char* token) {
  if (pid <= 0) return false;
  char path[32] = "/proc/", digits[16];
  int n = 0;
  for (int v = pid; v > 0 && n < 15; v /= 10) digits[n++] = static_cast<char>('0' + v % 10);
  size_t at = std::strlen(path);
  while (n > 0) path[at++] = digits[--n];
  std::memcpy(path + at, "/environ", sizeof "/environ");
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  // Entry by entry ('\0'-separated), each kept up to the length a job list
  // can have; a longer one is not ours.
  char buffer[4096], entry[1024];
  size_t length = 0;
  bool too_long = false, found = false;
  ssize_t got;
  while (!found && (got = read(fd, buffer, sizeof buffer)) > 0) {
    for (ssize_t i = 0; i < got && !found; ++i) {
      if (buffer[i] != '\0') {
        if (length + 1 < sizeof entry) entry[length++] = buffer[i];
        else too_long = true;
        continue;
      }
      entry[length] = '\0';
      found = !too_long && job_entry_holds(entry, token);
      length = 0;
      too_long = false;
    }
  }
  close(fd);
  if (!found && length > 0 && !too_long) {
    entry[length] = '\0';
    found = job_entry_holds(entry, token);
  }
  return found;
}

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

namespace {

// Each launcher's convention, as a WorkerEnv. The store's host is the
// first host of the job unless MASTER_ADDR says.

WorkerEnv ours(const Reader& env) {
  WorkerEnv w;
  w.launcher = "mnist_ddp";
  w.nnodes = env.integer("MNIST_DDP_NNODES", std::nullopt);
  w.node_rank = env.integer("GROUP_RANK", std::nullopt);
  w.local_rank = env.integer("LOCAL_RANK", std::nullopt);
  w.local_world_size = env.integer("LOCAL_WORLD_SIZE", std::nullopt);
  w.master_addr = env.text("MASTER_ADDR", "127.0.0.1");
  w.master_port = env.integer("MASTER_PORT", std::nullopt);
  w.round = env.integer("MNIST_DDP_ROUND", std::nullopt);
  w.store_prefix = env.text("MNIST_DDP_STORE_PREFIX");
  w.restart = w.round;
  w.backend = env.text("MNIST_DDP_BACKEND", "gloo");
  w.device = env.has("MNIST_DDP_DEVICE") ? env.integer("MNIST_DDP_DEVICE", std::nullopt) : -1;
  w.timeout_ms = env.integer("MNIST_DDP_TIMEOUT_MS", 0);
  return w;
}

// torchrun, a Kubeflow PyTorchJob pod started without it, or RANK and
// WORLD_SIZE set by hand.
WorkerEnv torchrun(const Reader& env) {
  WorkerEnv w;
  w.rank = env.integer("RANK", std::nullopt);
  w.world_size = env.integer("WORLD_SIZE", std::nullopt);
  w.node_rank = env.integer("GROUP_RANK", env.integer("NODE_RANK", 0));
  if (!env.has("LOCAL_RANK") && env.has("PET_NNODES")) {
    // Kubeflow's training-operator sets no LOCAL_RANK: RANK is the pod's
    // index, and a pod that runs mnist_ddp directly is one process.
    w.launcher = "kubeflow";
    w.local_rank = 0;
    w.local_world_size = 1;
    w.node_rank = env.integer("PET_NODE_RANK", w.rank);
    w.nnodes = env.integer("PET_NNODES", std::nullopt);
  } else {
    w.launcher = "torchrun";
    w.local_rank = env.integer("LOCAL_RANK", w.rank);
    w.local_world_size = env.integer("LOCAL_WORLD_SIZE", w.world_size);
  }
  w.master_addr = env.text("MASTER_ADDR", "127.0.0.1");
  w.master_port = env.integer("MASTER_PORT", std::nullopt);
  w.agent_store = env.text("TORCHELASTIC_USE_AGENT_STORE") == "True";
  w.restart = env.integer("TORCHELASTIC_RESTART_COUNT", 0);
  return w;
}

WorkerEnv slurm(const Reader& env) {
  WorkerEnv w;
  w.launcher = "slurm";
  w.rank = env.integer("SLURM_PROCID", std::nullopt);
  w.world_size = env.integer("SLURM_NTASKS", std::nullopt);
  w.local_rank = env.integer("SLURM_LOCALID", 0);
  const std::string per_node = env.text("SLURM_TASKS_PER_NODE");  // e.g. "4(x2),2"
  w.local_world_size = per_node.empty() ? 1 : std::max(1, std::atoi(per_node.c_str()));
  w.local_rank = std::min(w.local_rank, w.local_world_size - 1);
  w.node_rank = env.integer("SLURM_NODEID", 0);
  const std::string nodes = env.text("SLURM_JOB_NODELIST", env.text("SLURM_NODELIST"));
  w.master_addr = env.text("MASTER_ADDR", nodes.empty() ? "" : first_slurm_host(nodes));
  if (w.master_addr.empty())
    throw UsageError("environment: Slurm gives no SLURM_JOB_NODELIST; set MASTER_ADDR to node 0's address");
  // A port of the job's own, so that two jobs on one node do not meet:
  // one of 20000-29999 that follows SLURM_JOB_ID (a requeued job keeps
  // its id, and its port).
  w.master_port = env.integer("MASTER_PORT", 20000 + env.integer("SLURM_JOB_ID", 0) % 10000);
  w.restart = env.integer("SLURM_RESTART_COUNT", 0);  // a requeued job's
  return w;
}

// A launcher's job id as a positive number that follows it (0: none).
int job_number(const std::string& id) {
  if (id.empty()) return 0;
  return static_cast<int>(std::hash<std::string>{}(id) % 1000000) + 1;
}

// mpirun (Open MPI) or mpiexec (hydra): the variables of its rank, world
// size, local rank and local size, and a number that follows the job (0:
// none), from which the store's port follows unless MASTER_PORT says.
WorkerEnv mpi(const Reader& env, const std::string& launcher, const std::array<const char*, 4>& names, int job) {
  WorkerEnv w;
  w.launcher = launcher;
  w.rank = env.integer(names[0], std::nullopt);
  w.world_size = env.integer(names[1], std::nullopt);
  w.local_rank = env.integer(names[2], 0);
  w.local_world_size = std::max(1, env.integer(names[3], 1));
  // Ranks fill a node before the next (mpirun's default mapping by slot).
  w.node_rank = (w.rank - std::min(w.rank, w.local_rank)) / w.local_world_size;
  const bool one_host = w.world_size == w.local_world_size;
  w.master_addr = env.text("MASTER_ADDR", one_host ? "127.0.0.1" : "");
  w.master_port = env.integer("MASTER_PORT", job > 0 ? 20000 + job % 10000 : 0);
  if (w.master_port == 0 && env.has("MASTER_PORT")) w.master_port = -1;  // given as 0: refused below
  return w;
}

}  // namespace

std::optional<WorkerEnv> launched_worker(const Environment& environment) {
  const Reader env(environment);
  WorkerEnv w;
  if (env.has("MNIST_DDP_NNODES")) {
    w = ours(env);
  } else if (env.has("RANK") && env.has("WORLD_SIZE")) {
    // A PyTorchJob pod of several processes, started without torchrun:
    // this process launches them (node_decisions()).
    const std::string per_pod = env.text("PET_NPROC_PER_NODE", "1");
    if (!env.has("LOCAL_RANK") && env.has("PET_NNODES") && per_pod != "1") return std::nullopt;
    w = torchrun(env);
  } else if (env.has("SLURM_PROCID") && env.has("SLURM_NTASKS")) {  // srun
    w = slurm(env);
  } else if (env.has("OMPI_COMM_WORLD_RANK") && env.has("OMPI_COMM_WORLD_SIZE")) {
    w = mpi(env, "mpirun",
            {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
            job_number(env.text("OMPI_MCA_ess_base_jobid")));
  } else if (env.has("PMI_RANK") && env.has("PMI_SIZE")) {
    const bool one_host = env.integer("MPI_LOCALNRANKS", 1) == env.integer("PMI_SIZE", std::nullopt);
    // Hydra names no job; on one host its proxy, every rank's parent, does.
    w = mpi(env, "mpiexec", {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
            one_host ? environment.parent_pid : 0);
  } else {
    return std::nullopt;
  }
  w.error_report_fd = env.integer("MNIST_DDP_ERROR_FD", -1);
  w.secret = environment.secret;
  if (w.rank >= 0 && (w.world_size < 1 || w.rank >= w.world_size))
    throw UsageError("environment: RANK=" + std::to_string(w.rank) + " is not below WORLD_SIZE=" +
                     std::to_string(w.world_size));
  if (w.local_rank >= w.local_world_size)
    throw UsageError("environment: LOCAL_RANK=" + std::to_string(w.local_rank) + " is not below LOCAL_WORLD_SIZE=" +
                     std::to_string(w.local_world_size));
  if (w.master_port == 0 && w.launcher != "mpirun" && w.launcher != "mpiexec")
    throw UsageError("environment: MASTER_PORT=0: every rank must know the store's port, so it cannot be picked "
                     "at random; set a fixed one, or unset it (under Slurm it then follows SLURM_JOB_ID)");
  if (w.master_port < 0)
    throw UsageError("environment: MASTER_PORT=0: every rank must know the store's port, so it cannot be picked "
                     "at random; set a fixed one, or unset it (under mpirun it then follows the job)");
  return w;
}

void resolve_store_address(WorkerEnv& w, const std::string& master_addr, bool addr_given, int master_port,
                           bool port_given) {
  if (w.master_addr.empty()) {
    if (!addr_given)
      throw UsageError("environment: the " + w.launcher + " job spans several hosts, so every rank must know node "
                       "0's address: pass MASTER_ADDR to every rank (mpirun -x MASTER_ADDR=<node 0>) or give "
                       "--master-addr <node 0>");
    w.master_addr = master_addr;
  }
  if (w.master_port == 0) w.master_port = port_given && master_port > 0 ? master_port : 29500;
}

std::vector<std::pair<std::string, std::string>> node_decisions(const Environment& environment) {
  const Reader env(environment);
  std::vector<std::pair<std::string, std::string>> decided;
  if (env.has("PET_NNODES")) {  // Kubeflow: Trainer v2, or a PyTorchJob pod launching its processes
    decided.emplace_back("nnodes", std::to_string(env.integer("PET_NNODES", std::nullopt)));
    decided.emplace_back("node_rank", std::to_string(env.integer("PET_NODE_RANK", env.integer("RANK", 0))));
    const std::string nproc = env.text("PET_NPROC_PER_NODE");  // a number, or torchrun's auto, gpu, cpu
    if (!nproc.empty() && std::all_of(nproc.begin(), nproc.end(), ::isdigit))
      decided.emplace_back("nproc", std::to_string(env.integer("PET_NPROC_PER_NODE", std::nullopt)));
    const std::string addr = env.text("PET_MASTER_ADDR", env.text("MASTER_ADDR"));
    if (!addr.empty()) decided.emplace_back("master_addr", addr);
    const char* port = env.has("PET_MASTER_PORT") ? "PET_MASTER_PORT" : "MASTER_PORT";
    if (env.has(port)) decided.emplace_back("master_port", std::to_string(env.integer(port, std::nullopt)));
    return decided;
  }
  // Any other sign of being one of several processes: a rank or a size
  // above 1 that nothing here reads. Each process would train alone.
  std::string signs;
  for (const std::string& kv : environment.variables) {
    const std::string key = kv.substr(0, kv.find('='));
    const size_t at = key.rfind("RANK");
    if (at == std::string::npos || at + 4 != key.size()) continue;
    const std::string prefix = key.substr(0, at);
    for (const char* size : {"SIZE", "WORLD_SIZE", "NTASKS", "NPROCS", "NUM_PROCS", "NRANKS"}) {
      const auto value = environment.get(prefix + size);
      if (value && std::atoi(value->c_str()) > 1)
        signs += (signs.empty() ? "" : ", ") + kv + ", " + prefix + size + "=" + *value;
    }
  }
  // RANK or WORLD_SIZE without the other (both: launched_worker()).
  if (env.has("RANK") != env.has("WORLD_SIZE") &&
      (std::atoi(env.text("RANK", "0").c_str()) > 0 || std::atoi(env.text("WORLD_SIZE", "0").c_str()) > 1))
    signs += (signs.empty() ? "" : ", ") + (env.has("RANK") ? "RANK=" + env.text("RANK") : "WORLD_SIZE=" + env.text("WORLD_SIZE"));
  if (!signs.empty())
    throw UsageError("environment: " + signs + " say this process is one of several that a launcher started, "
                     "but mnist_ddp does not know that launcher, and each process would train a job of its own; "
                     "start one mnist_ddp per machine (it launches its own workers: --nnodes, --node-rank), or "
                     "use torchrun, srun, mpirun or mpiexec");
  return decided;
}

std::vector<std::string> worker_environment(const WorkerEnv& env, const std::vector<std::string>& parent, int cores,
                                            double launch_time) {
  std::vector<std::string> out;
  bool threads = false;
  std::string jobs;  // the MNIST_DDP_JOB of the jobs this launcher runs inside
  for (const std::string& kv : parent) {
    const std::string key = kv.substr(0, kv.find('='));
    if (kLauncherVariables.count(key)) continue;
    if (key == kJobVariable) {
      jobs = kv.substr(key.size() + 1);
      continue;
    }
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
  if (!env.store_prefix.empty()) out.push_back("MNIST_DDP_STORE_PREFIX=" + env.store_prefix);
  if (!env.backend.empty()) out.push_back("MNIST_DDP_BACKEND=" + env.backend);
  if (env.device >= 0) out.push_back("MNIST_DDP_DEVICE=" + std::to_string(env.device));
  if (env.error_report_fd >= 0) out.push_back("MNIST_DDP_ERROR_FD=" + std::to_string(env.error_report_fd));
  if (env.timeout_ms > 0) out.push_back("MNIST_DDP_TIMEOUT_MS=" + std::to_string(env.timeout_ms));
  if (!jobs.empty() || !env.job.empty())
    out.push_back(std::string(kJobVariable) + "=" + jobs + (jobs.empty() || env.job.empty() ? "" : ",") + env.job);
  if (launch_time > 0) {
    std::ostringstream time;
    time.precision(17);
    time << launch_time;
    out.push_back("MNIST_DDP_LAUNCH_TIME=" + time.str());
  }
  // Each worker's share of the cores, for every OpenMP pool it starts
  // (ATen's and OpenBLAS's, on any thread), unless the user set one.
  if (!threads) out.push_back("OMP_NUM_THREADS=" + std::to_string(std::max(1, cores / std::max(1, env.local_world_size))));
  return out;
}

}  // namespace mnist_ddp
