// The one place that reads the process's environment. Not installed.
//
// read_environment() turns the variables this process was started with into
// plain values: which launcher started it as a worker and what that launcher
// decided (WorkerEnv), the CUDA and OpenMP variables, when the job was
// launched. No other file calls getenv: a program reads what else it needs
// through Environment::get(). Tests build an Environment from a list of
// variables with environment_from().
//
// It also holds the other direction: the environment our launcher gives
// each worker (worker_environment()), which reads back as the same WorkerEnv.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mnist_ddp {

// The secret the nodes of a job share: MNIST_DDP_SECRET, or the contents of
// the file MNIST_DDP_SECRET_FILE names, read only where a secret is needed.
struct Secret {
  std::string value;  // MNIST_DDP_SECRET
  std::string file;   // MNIST_DDP_SECRET_FILE, where no MNIST_DDP_SECRET is set
  bool given() const { return !value.empty() || !file.empty(); }
  // The secret; "" for none. Throws UsageError, in one line, for a file that
  // is missing, a directory, unreadable or empty; `warning`, where given,
  // is set for a file other users can read.
  std::string read(std::string* warning = nullptr) const;
};

// A worker's place in the job, as the launcher that started it gives it.
//
// Our launcher execs each worker with the environment torchrun would give
// it (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT)
// and its own (MNIST_DDP_*); other launchers give RANK and WORLD_SIZE too.
struct WorkerEnv {
  // Who started it: "mnist_ddp" (ours), "torchrun" (or RANK set by hand),
  // "slurm", "mpirun" (Open MPI), "mpiexec" (MPICH, Intel MPI: hydra),
  // "kubeflow" (a PyTorchJob's pod started without torchrun).
  std::string launcher;
  int rank = -1;         // -1: agreed through the store (src/comm/rendezvous.hpp)
  int world_size = -1;   // likewise
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  int nnodes = 1;
  // The store's address and port. Under mpirun they may be left to the
  // flags: "" and 0 (resolve_store_address()).
  std::string master_addr;
  int master_port = 0;
  // Set by our launcher, which hosts the store on node 0 and counts its
  // starts of the workers from 0 (a restart is a new round): the workers
  // meet under the key prefix "round/<round>", so no start reads another's
  // keys. -1: started by another launcher (rank 0, or torchrun's agent,
  // hosts the store).
  int round = -1;
  // Set by our launcher: the prefix of every key of the job in its store,
  // which a process outside the job cannot guess (store.hpp, "Note on
  // neighbours"); "" where the job has none.
  std::string store_prefix;
  // The secret the job's nodes share (Environment::secret), from which a
  // job under another launcher derives its prefix.
  Secret secret;
  // Which start of the job's workers this is: 0, then one more per restart
  // (our launcher's round, torchrun's TORCHELASTIC_RESTART_COUNT, Slurm's
  // SLURM_RESTART_COUNT for a requeued job).
  int restart = 0;
  // torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True):
  // the workers join it as clients under "/worker/attempt_<restart>", the
  // prefix PyTorch's own workers use there.
  bool agent_store = false;
  // Set by our launcher: where this worker trains, as the launcher planned
  // it (backend "" : another launcher started us, and the worker plans its
  // own placement); device -1 is the CPU.
  std::string backend;
  int device = -1;
  // Set by our launcher: a failing worker writes an error report here
  // (error_report.hpp) instead of printing it.
  int error_report_fd = -1;
  // Set by our launcher: its --timeout, in milliseconds, which a program's
  // process group takes unless its options name another; 0: none given.
  int timeout_ms = 0;
  // Set by our launcher: its job's token (app/launch/containment.hpp),
  // added to the MNIST_DDP_JOB the launcher inherited (a job started inside
  // another carries both), which whatever the worker starts inherits. Only
  // the launcher's watcher looks for it: launched_worker() does not read it.
  std::string job;

  bool ours() const { return round >= 0; }
};

struct Environment {
  // Every variable, "KEY=VALUE", in the order the process got them: what a
  // launcher's workers inherit.
  std::vector<std::string> variables;
  std::string master_addr;  // $MASTER_ADDR; "" when unset
  std::string master_port;  // $MASTER_PORT as given (options.cpp validates it); "" when unset
  std::optional<std::string> cuda_visible_devices;  // $CUDA_VISIBLE_DEVICES, when set
  int omp_num_threads = 0;  // $OMP_NUM_THREADS when a positive integer, else 0
  // When the job was launched, in seconds since the Unix epoch: our
  // launcher's MNIST_DDP_LAUNCH_TIME, else when this process started.
  double launch_time = 0;
  // The secret the nodes of a job share (see Secret), not yet read.
  Secret secret;
  int parent_pid = 0;               // this process's parent: an MPI job's proxy, one per node
  bool dumb_terminal = false;       // TERM=dumb: no progress line
  bool libtorch_log_level = false;  // GLOG_minloglevel is set: LibTorch's logs are the user's to tune

  // The value of `name`, nullopt when it is unset.
  std::optional<std::string> get(const std::string& name) const;
};

// This process's environment.
Environment read_environment();
// The environment `variables` ("KEY=VALUE") describe, for a process that
// started at `process_start` (seconds since the Unix epoch). Reads no file.
Environment environment_from(const std::vector<std::string>& variables, double process_start = 0);

// The worker this process is when a launcher started it as one:
// - torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//   GROUP_RANK or NODE_RANK, TORCHELASTIC_USE_AGENT_STORE,
//   TORCHELASTIC_RESTART_COUNT); RANK and WORLD_SIZE set by hand without
//   LOCAL_RANK mean one host;
// - a Kubeflow PyTorchJob pod started without torchrun (RANK, WORLD_SIZE,
//   PET_*, no LOCAL_RANK), one process per pod: local rank 0;
// - Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; node 0 is the
//   first host of SLURM_JOB_NODELIST unless MASTER_ADDR says);
// - Open MPI's mpirun (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK,
//   _LOCAL_SIZE) and MPICH's or Intel MPI's mpiexec (PMI_RANK, PMI_SIZE,
//   MPI_LOCALRANKID, MPI_LOCALNRANKS): the store at MASTER_ADDR (127.0.0.1
//   on one node) and MASTER_PORT, else one that follows the MPI job (Open
//   MPI's job id; on one node, hydra's proxy), else the flags';
// - or our launcher's, which leaves RANK and WORLD_SIZE to be agreed
//   through the store.
// nullopt when this process should be a launcher of ours. Throws
// UsageError for a malformed environment.
std::optional<WorkerEnv> launched_worker(const Environment& env);

// For a process that is to be our launcher (launched_worker() said
// nullopt): what the environment decides for this node in place of flags,
// as (argument name, value). Kubeflow's Trainer (PET_NNODES, PET_NODE_RANK,
// PET_NPROC_PER_NODE, PET_MASTER_ADDR, PET_MASTER_PORT), and a PyTorchJob
// pod of several processes started without torchrun, make it this node's
// launcher. Throws UsageError, naming the variables, when the environment
// says this process is one of several that a launcher mnist_ddp does not
// read started: each would train a job of its own.
std::vector<std::pair<std::string, std::string>> node_decisions(const Environment& env);

// The store's address and port of a worker whose launcher left them to the
// flags (mpirun without MASTER_ADDR or MASTER_PORT): --master-addr when
// given, 127.0.0.1 when the job is on one host; --master-port when given,
// else 29500. Throws UsageError for a job across hosts with no address.
void resolve_store_address(WorkerEnv& env, const std::string& master_addr, bool addr_given, int master_port,
                           bool port_given);

// The environment our launcher gives the worker `env` describes: `parent`
// ("KEY=VALUE" entries) without any launcher's variables, then ours, which
// launched_worker() reads back as `env`, and `launch_time`. Unless `parent`
// sets OMP_NUM_THREADS, it also gives each of the node's workers its share
// of the `cores`. Pure.
std::vector<std::string> worker_environment(const WorkerEnv& env, const std::vector<std::string>& parent, int cores,
                                            double launch_time = 0);

// Whether process `pid` was started with `token` among the comma-separated
// values of its MNIST_DDP_JOB (/proc/PID/environ: the environment it was
// given, as it still holds it). False where that cannot be read (the
// process has ended, or is another user's). Makes only async-signal-safe
// calls: the launcher's watcher runs it in a forked process.
bool process_carries_job(int pid, const char* token);

// The first host of a Slurm node list: "gpu[003-005,010],cpu7" -> "gpu003".
std::string first_slurm_host(const std::string& nodelist);

// Seconds since the Unix epoch, now.
double unix_seconds();

}  // namespace mnist_ddp
