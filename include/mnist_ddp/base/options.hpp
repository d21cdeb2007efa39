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

namespace mnist_ddp {

struct Environment;

// Options as (name, value) pairs, names spelled as the reference's argparse
// attributes (batch_size, log_interval, ...).
using Arguments = std::vector<std::pair<std::string, std::string>>;

inline const std::vector<std::string> kCompressions = {
    "none", "fp16", "powersgd", "powersgd_fp16", "batched_powersgd_fp16"};

// PyTorch's PowerSGDState knobs, with the reference's values.
struct PowerSgdOptions {
  int rank = 2;                      // matrix_approximation_rank
  int64_t start_iter = 1000;         // plain allreduce before this step (start_powerSGD_iter)
  double min_compression_rate = 2;   // compress an n x m matrix only if (n + m) r rate < n m
  bool error_feedback = true;        // carry each rank's compression error into its next step
  bool warm_start = true;            // reuse last step's Q instead of drawing a new one
  double orthogonalization_epsilon = 0;  // added to column norms in Gram-Schmidt
  uint64_t seed = 0;                 // seeds Q's initial draws, identically on every rank
};

struct Options {
  // --- The reference's flags. ---
  int batch_size = 32;        // training images per process and step
  int test_batch_size = 256;  // evaluation images per process and batch
  int epochs = 20;            // passes over the training set
  double lr = 0.01;           // initial learning rate, cosine-annealed to 0 over `epochs`
  double momentum = 0.9;      // SGD momentum
  double weight_decay = 5e-4; // SGD L2 penalty
  int workers = 4;            // ignored: the reference's loader processes; batches come from memory
  std::string compression = "powersgd_fp16";  // one of kCompressions
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
  std::string resume;         // a checkpoint directory, "auto" (<path>/checkpoint if any), or "" (none)

  // --- DistributedDataParallel and its communication hook. ---
  double bucket_cap_mb = 25;  // gradient bucket size (the first bucket is capped at 1 MB)
  PowerSgdOptions powersgd;   // for the powersgd* choices of `compression`

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
