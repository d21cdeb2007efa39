// Command-line options of mnist_ddp: one struct, every field with its default.
//
// The first block keeps the Python reference's flags and defaults, so that its
// users' command lines work unchanged. parse_options() validates every value;
// a bad one is a UsageError (one line naming the flag, exit code 2).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mnist_ddp/base/errors.hpp"
#include "mnist_ddp/parallel/comm_hooks.hpp"

namespace mnist_ddp {

struct Environment;
struct WorkerEnv;

// Options as (name, value) pairs, names spelled as the reference's argparse
// attributes (batch_size, log_interval, ...).
using Arguments = std::vector<std::pair<std::string, std::string>>;

// The reference's five hooks.
inline const std::vector<std::string> kCompressions = {
    "none", "fp16", "powersgd", "powersgd_fp16", "batched_powersgd_fp16"};
// Every --compression: the reference's, and bfloat16 where they send float16.
inline const std::vector<std::string> kAllCompressions = {
    "none", "fp16", "powersgd", "powersgd_fp16", "batched_powersgd_fp16", "bf16", "powersgd_bf16",
    "batched_powersgd_bf16"};

struct Options {
  // --- The reference's flags. ---
  int batch_size = 32;        // training images per process and step
  int test_batch_size = 256;  // evaluation images per process and batch
  int epochs = 20;            // passes over the training set
  double lr = 0.01;           // initial learning rate, cosine-annealed to 0 over `epochs`
  double momentum = 0.9;      // SGD momentum
  double weight_decay = 5e-4; // SGD L2 penalty
  int workers = 4;            // ignored: the reference's loader processes; batches come from memory
  std::string compression = "powersgd_fp16";  // one of kAllCompressions
  int log_interval = 10;      // batches between two "Train Epoch" lines
  std::string path = "./logging/";  // log file, best model and checkpoints

  // --- Placement and rendezvous. ---
  std::vector<int> gpus;      // CUDA device ids, one worker each; empty: all visible; repeats share a GPU (Gloo)
  std::string backend = "auto";   // auto | nccl | gloo
  int nproc = 2;              // worker processes when training on CPU
  int nnodes = 1;             // machines in the job, each running one launcher
  int node_rank = 0;          // this machine's place among them; node 0 hosts the store
  std::string master_addr = "127.0.0.1";  // node 0's address (or $MASTER_ADDR)
  int master_port = 0;        // node 0's store port (or $MASTER_PORT); 0: a free one, single node
                              // only; 29500 when several nodes and none is given
  double timeout = 300;       // seconds a rendezvous or collective may wait

  // --- Data and run length. ---
  std::string data_dir = "./data";  // holds MNIST/raw or FashionMNIST/raw
  std::string dataset = "mnist";    // mnist | fashion-mnist
  std::uint64_t seed = 0;     // model init, data order and dropout
  std::int64_t max_steps = 0; // stop after this many training steps in total; 0: no limit

  // --- Checkpoints. ---
  int checkpoint_every = 1;   // epochs between checkpoints into <path>/checkpoint; 0: none
  std::int64_t checkpoint_steps = 0;  // also every this many steps; 0: by epoch only
  int max_restarts = 0;       // restarts of the whole node after a worker fails (torchrun's --max-restarts)
  std::string resume;         // a checkpoint directory, "auto" (<path>/checkpoint if any), or "" (none; "never" on the command line)

  // --- Precision and accumulation (not the reference's: recorded in
  // arguments only when not their default, so a default run's logs and
  // files are as before). ---
  std::string amp = "none";   // none | bf16 | fp16: forward and loss under autocast to that type
  int accumulate = 1;         // micro-batches of batch_size summed into each optimizer step

  // --- DistributedDataParallel and its communication hook. ---
  double bucket_cap_mb = 25;  // a gradient bucket closes once it holds this many MB (the first at 1 MB, or this if less)
  // Check every collective against every rank's (off: to measure what the
  // check costs; ProcessGroupOptions::check_collectives).
  bool check_collectives = true;
  // For the powersgd* choices of `compression`: PyTorch's defaults but
  // the reference's rank 2.
  hooks::PowerSgdOptions powersgd = hooks::PowerSgdOptions().matrix_approximation_rank(2);

  // Every option as parsed, in --help order.
  Arguments arguments;
  std::vector<std::string> given;  // the names of `arguments` given on the command line
};

// Parses and validates argv; $MASTER_ADDR and $MASTER_PORT in `env` stand
// in for --master-addr and --master-port when those are not given. Returns
// nullopt when --help was printed. Throws UsageError for anything the user
// must fix. The result is never changed afterwards: what a launcher's
// environment decides instead is a value of its own (arguments_in_effect).
std::optional<Options> parse_options(int argc, const char* const* argv, const Environment& env);
std::optional<Options> parse_options(int argc, const char* const* argv);  // with an empty environment
std::optional<Options> parse_options(const std::vector<std::string>& argv, const Environment& env);

// What a launcher other than ours decided that a flag would otherwise say,
// as (argument name, value): the store's address and port, the node's
// worker count, the node count and this node's rank. Empty for our own
// launcher's workers, whose flags are the launcher's.
Arguments launcher_decisions(const WorkerEnv& env);

// The communication hook a --compression value names, with PowerSGD's
// knobs. Throws UsageError for another value.
hooks::CommHookPtr make_comm_hook(const std::string& compression, const hooks::PowerSgdOptions& powersgd);

// `mnist_ddp run [FLAGS] -- PROGRAM [ARGS...]`: our launcher for any
// program. `launch` holds the launcher's flags (--nproc, --gpus, --backend,
// --nnodes, --node-rank, --master-addr, --master-port, --timeout,
// --max-restarts), as parse_options() reads and checks them.
struct RunCommand {
  Options launch;
  std::vector<std::string> program;  // PROGRAM, then its ARGS
};

// Parses argv = {"mnist_ddp", "run", FLAGS..., "--", PROGRAM, ARGS...}.
// Returns nullopt when --help was printed; throws UsageError for a bad flag
// or no program.
std::optional<RunCommand> parse_run_command(const std::vector<std::string>& argv, const Environment& env);

// `arguments` as flags: {"--nnodes", "2", "--node-rank", "1"}.
std::vector<std::string> command_line_of(const Arguments& arguments);

// `opts.arguments` with the values a launcher's environment `decided`
// (environment.hpp, launcher_decisions) in place: what the run uses, as the
// log, summary.json and checkpoints report it.
Arguments arguments_in_effect(const Options& opts, const Arguments& decided);

// One line naming each flag given on the command line with another value
// than `decided` gives it: "the launcher's environment overrides the
// command line: --nproc 2 (given 4)"; "" when none.
std::string overridden_flags(const Options& opts, const Arguments& decided);

// The settings every rank of a job must share: `arguments` minus those that
// are each machine's own (paths, devices, node rank, ...). Ranks compare
// them at start-up.
Arguments shared_settings(const Arguments& arguments);

}  // namespace mnist_ddp
