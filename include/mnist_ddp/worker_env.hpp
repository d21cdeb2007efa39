// A worker's place in the job, as its environment gives it, and the one
// way a worker tells its launcher why it failed.
//
// A worker is this same binary, exec'ed with the environment torchrun would
// give it (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT, and RANK and WORLD_SIZE from torchrun or Slurm). Our launcher
// builds that environment with worker_environment(); every launcher's
// worker reads it with worker_env_from_environment().
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace mnist_ddp {

struct Options;

struct WorkerEnv {
  int rank = -1;        // -1: agreed through the store (see dist.hpp)
  int world_size = -1;  // likewise
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  int nnodes = 1;
  std::string master_addr;
  int master_port = 0;
  // Set by our launcher, which hosts the store on node 0 and counts its
  // starts of the workers from 0 (a restart is a new round): the workers
  // meet under the key prefix "round/<round>", so no start reads another's
  // keys. -1: started by torchrun or Slurm (rank 0, or torchrun's agent,
  // hosts the store).
  int round = -1;
  // Which start of the job's workers this is: 0, then one more per restart
  // (our launcher's round, torchrun's TORCHELASTIC_RESTART_COUNT, Slurm's
  // SLURM_RESTART_COUNT for a requeued job).
  int restart = 0;
  // torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True):
  // the workers join it as clients under "/worker/attempt_<restart>", the
  // prefix PyTorch's own workers use there.
  bool agent_store = false;
  // Set by our launcher: a failing worker writes an error_report_line() here
  // instead of printing it, so the user reads one line, not one per worker.
  int error_report_fd = -1;
};

// The worker identity when this process was started as a worker: torchrun's
// variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RESTART_COUNT),
// Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; node 0 is the first
// host of SLURM_JOB_NODELIST unless MASTER_ADDR says), or our launcher's,
// which leaves RANK and WORLD_SIZE to be agreed through the store. nullopt
// when it should be the launcher. Throws UsageError for a malformed
// environment.
std::optional<WorkerEnv> worker_env_from_environment();

// For a worker started by another launcher (torchrun, Slurm: env.round <
// 0), whose environment decides the store's address and port, the node's
// worker count, the node count and this node's rank: puts those into
// `opts` (fields and arguments), so that the log and summary.json report
// what is used. Returns one line naming the flags given on the command line
// that the environment overrode ("" when none).
std::string apply_launcher_environment(Options& opts, const WorkerEnv& env);

// The environment our launcher gives the worker `env` describes: `parent`
// ("KEY=VALUE" entries) without any launcher's variables, then ours, which
// worker_env_from_environment() reads back as `env`. Unless `parent` sets
// OMP_NUM_THREADS, it also gives each of the node's workers its share of
// the cores. Pure: reads nothing else.
std::vector<std::string> worker_environment(const WorkerEnv& env, const std::vector<std::string>& parent, int cores);

// The first host of a Slurm node list: "gpu[003-005,010],cpu7" -> "gpu003".
std::string first_slurm_host(const std::string& nodelist);

// A worker's fatal error, as it travels to the launcher.
struct WorkerError {
  int local_rank = 0;
  bool echo = false;     // it only follows from another process's failure (PeerLost)
  std::string message;   // "rank 3: ..." or "node 1 local rank 0: ..."
};
// One line, "<local rank>\t<cause|echo>\t<message>\n", short enough for one
// atomic pipe write; and back.
std::string error_report_line(const WorkerError& e);
std::optional<WorkerError> parse_error_report(const std::string& line);

// Reports a worker's fatal error, naming it by `rank` when the job has
// agreed on ranks (-1 before): to the launcher when it listens, else on stderr.
void report_worker_error(const WorkerEnv& env, int rank, const std::string& message, bool echo);

}  // namespace mnist_ddp
