#include "app/base/options.hpp"

#include <CLI/CLI.hpp>

#include "base/environment.hpp"

#include <algorithm>
#include <cfloat>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <sstream>

namespace mnist_ddp {
namespace {

// Validators whose messages say what is allowed. CLI11 prefixes the flag name.
// Every number must be finite and at most `max`: "inf" or "1e17" seconds
// would overflow the milliseconds and deadlines made of them.
CLI::Validator number(double min, bool min_allowed, double max, const std::string& what,
                      const std::string& bound = "") {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v)) return "must be " + what + ", got '" + s + "'";
        if (!std::isfinite(v) || !(min_allowed ? v >= min : v > min) || v > max)
          return "must be " + what + (bound.empty() ? "" : " " + bound) + ", got '" + s + "'";
        return "";
      },
      what);
}

// An integer flag of type T from `min` up to `max` (T's largest unless
// given): decimal digits, a sign allowed, as argparse's int() reads them.
// Past T's range is refused: CLI11 would clamp it (2^64-1 for a seed,
// 2^63-1 for a step count). The text becomes the number's plain form,
// which CLI11 then converts ("010" is 10, not octal 8): a transform, as
// CLI11 calls a validator that changes the text.
template <typename T>
CLI::Validator integer(T min, const std::string& what, T max = std::numeric_limits<T>::max(),
                       const std::string& bound = "up to " + std::to_string(std::numeric_limits<T>::max())) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        std::string text = s;
        if (text.size() > 1 && text[0] == '+' && text[1] != '-') text.erase(0, 1);
        T value{};
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        const bool whole = !text.empty() && end == text.data() + text.size();
        const bool too_large = whole && ((error == std::errc::result_out_of_range && text[0] != '-') ||
                                         (error == std::errc() && value > max));
        if (too_large) return "must be " + what + (bound.empty() ? "" : " " + bound) + ", got '" + s + "'";
        if (!whole || error != std::errc() || value < min) return "must be " + what + ", got '" + s + "'";
        s = std::to_string(value);
        return "";
      },
      what);
}
CLI::Validator positive_int(const std::string& what = "a positive integer") { return integer<int>(1, what); }
CLI::Validator counting_int(const std::string& what = "an integer >= 0") { return integer<int>(0, what); }
// Seeds are unsigned: "-1" is refused, not taken as 2^64 - 1.
CLI::Validator seed() {
  return integer<std::uint64_t>(0, "an integer in 0..18446744073709551615", std::numeric_limits<std::uint64_t>::max(), "")
      .description("0..2^64-1");
}

// Text that reads back as written: a path that holds a newline cannot be
// recorded line by line (the checkpoint's manifest), nor shown on one line.
CLI::Validator printable(const std::string& what) {
  return CLI::Validator(
      [what](std::string& s) -> std::string {
        for (unsigned char c : s)
          if (c < 0x20 || c == 0x7f) return "must be " + what;
        return "";
      },
      what);
}

CLI::Validator one_of(const std::vector<std::string>& choices) {
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : ", ") + c;
  return CLI::Validator(
      [choices, list](std::string& s) -> std::string {
        if (std::find(choices.begin(), choices.end(), s) != choices.end()) return "";
        return "must be one of " + list + ", got '" + s + "'";
      },
      "{" + list + "}");
}

std::string python_name(const CLI::Option* opt) {
  std::string name = opt->get_lnames().front();
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

// CLI11 phrases a failed conversion differently in each version; say it our way.
std::string one_line(const CLI::ParseError& e, const CLI::App& app) {
  std::string msg = e.what();
  if (const auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
  if (e.get_name() == "ConversionError") {
    for (const CLI::Option* opt : app.get_options()) {
      const std::string flag = "--" + opt->get_lnames().front();
      if (msg.find(opt->get_lnames().front()) != std::string::npos)
        return flag + ": '" + (opt->results().empty() ? std::string() : opt->results().back()) +
               "' is not a valid " + opt->get_type_name() + " value";
    }
  }
  return msg;
}

// The launcher's flags: where the workers run and how the nodes meet.
void add_launch_flags(CLI::App& app, Options& o) {
  app.add_option("--gpus", o.gpus,
                 "CUDA device ids, one worker each, e.g. 0,1 (default: all visible); an id given twice, e.g. 0,0, "
                 "puts two workers on one GPU over Gloo")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->transform(counting_int("a device id >= 0"));
  app.add_option("--backend", o.backend,
                 "Process group backend: nccl on CUDA, gloo on CPU or for workers sharing a GPU (auto: nccl when a "
                 "GPU is visible and no --gpus id repeats)")
      ->check(one_of({"auto", "nccl", "gloo"}));
  app.add_option("--nproc", o.nproc, "Worker processes when training on CPU")->transform(positive_int());
  app.add_option("--nnodes", o.nnodes, "Machines in the job, each running mnist_ddp with its own --node-rank")
      ->transform(positive_int());
  app.add_option("--node-rank", o.node_rank, "This machine's place among the --nnodes (node 0 hosts the store)")
      ->transform(counting_int());
  app.add_option("--master-addr", o.master_addr, "Address of node 0, which hosts the store (or $MASTER_ADDR)");
  app.add_option("--master-port", o.master_port,
                 "Port of the store (or $MASTER_PORT); 0 picks a free one on a single node; 29500 for several")
      ->transform(integer<int>(0, "a port number in 0..65535", 65535, ""));
  // A week at most: Gloo counts its timeout in int milliseconds (24 days).
  // A second at least: the store and Gloo count whole seconds in places.
  app.add_option("--timeout", o.timeout, "Seconds a rendezvous or collective may wait for a peer")
      ->check(number(1, true, 604800, "a number of seconds from 1 up to 604800 (a week)"));
}

void add_max_restarts(CLI::App& app, Options& o, const std::string& how) {
  app.add_option("--max-restarts", o.max_restarts, "After a worker fails, " + how + ", at most this many times")
      ->transform(counting_int());
}

// What the environment stands in for, and what the flags must agree on.
void settle_launch_flags(const CLI::App& app, Options& o, const Environment& env) {
  if (!app.count("--master-addr") && !env.master_addr.empty()) o.master_addr = env.master_addr;
  const bool port_given = app.count("--master-port") > 0;
  if (!port_given) {
    if (const std::string& port = env.master_port; !port.empty()) {
      char* end = nullptr;
      const long value = std::strtol(port.c_str(), &end, 10);
      if (*end || value < 0 || value > 65535)
        throw UsageError("$MASTER_PORT='" + port + "' is not a port number in 0..65535");
      o.master_port = static_cast<int>(value);
    } else if (o.nnodes > 1) {
      o.master_port = 29500;
    }
  }
  if (o.node_rank >= o.nnodes)
    throw UsageError("--node-rank " + std::to_string(o.node_rank) + ": must be below --nnodes " +
                     std::to_string(o.nnodes));
  if (o.nnodes > 1 && o.master_port == 0)
    throw UsageError("--master-port 0: a free port can be picked on a single node only; give the port node 0 "
                     "listens on to every node (default 29500)");
}

// Every option as parsed, in --help order, and which were given.
void record_arguments(const CLI::App& app, Options& o) {
  for (const CLI::Option* opt : app.get_options()) {
    if (opt == app.get_help_ptr()) continue;
    if (opt->count()) o.given.push_back(python_name(opt));
    if (opt->get_expected_min() == 0) {  // a flag
      o.arguments.emplace_back(python_name(opt), opt->count() ? "true" : "false");
      continue;
    }
    const_cast<CLI::Option*>(opt)->capture_default_str();  // the value as parsed
    const std::string name = python_name(opt), value = opt->get_default_str();
    // Options the reference lacks are recorded only when set otherwise: a
    // default run logs and writes what it did before they existed.
    if ((name == "amp" && value == "none") || (name == "accumulate" && value == "1")) continue;
    o.arguments.emplace_back(name, value);
  }
  for (auto& [name, value] : o.arguments) {  // what the environment decided
    if (name == "master_addr") value = o.master_addr;
    if (name == "master_port") value = std::to_string(o.master_port);
  }
}

void set_defaults(CLI::App& app) {
  app.option_defaults()->always_capture_default();
  // As argparse does: an option given twice takes its last value.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.get_formatter()->column_width(34);
}

}  // namespace

std::optional<Options> parse_options(int argc, const char* const* argv, const Environment& env) {
  Options o;
  CLI::App app{
      "Trains a CNN on MNIST with data parallelism: one worker process per GPU (NCCL) or\n"
      "--nproc worker processes on CPU (Gloo), gradients averaged by our DistributedDataParallel\n"
      "and compressed by the hook chosen with --compression. To run another program's workers the\n"
      "same way: mnist_ddp run [FLAGS] -- PROGRAM [ARGS...] (mnist_ddp run --help).",
      "mnist_ddp"};
  set_defaults(app);

  app.add_option("--batch-size", o.batch_size, "Training images per process and step")->transform(positive_int());
  app.add_option("--test-batch-size", o.test_batch_size, "Evaluation images per process and batch")
      ->transform(positive_int());
  app.add_option("--epochs", o.epochs, "Passes over the training set")->transform(positive_int());
  // The optimizer's numbers meet float32 tensors: at most float32's largest.
  app.add_option("--lr", o.lr, "Initial learning rate (cosine-annealed to 0 over --epochs)")
      ->check(number(0, false, FLT_MAX, "a positive number", "up to 3.4e38"));
  app.add_option("--momentum", o.momentum, "SGD momentum")->check(number(0, true, FLT_MAX, "a number >= 0", "up to 3.4e38"));
  app.add_option("--weight-decay,--wd", o.weight_decay, "SGD weight decay (L2 penalty)")
      ->check(number(0, true, FLT_MAX, "a number >= 0", "up to 3.4e38"));
  app.add_option("--workers", o.workers,
                 "Ignored, so the reference's command lines run: batches are sliced from data held in memory, "
                 "with no loader processes")
      ->transform(counting_int());
  app.add_option("--compression", o.compression, "Gradient communication hook")->check(one_of(kAllCompressions));
  app.add_option("--log-interval,--log_interval", o.log_interval, "Batches between two training log lines")
      ->transform(positive_int());
  app.add_option("--path", o.path, "Directory for the log file, the best model and checkpoints")
      ->check(printable("a path without newlines or other control characters"));

  add_launch_flags(app, o);

  app.add_option("--data-dir", o.data_dir, "Directory holding MNIST/raw or FashionMNIST/raw")
      ->check(printable("a path without newlines or other control characters"));
  app.add_option("--dataset", o.dataset, "Dataset to train on")->check(one_of({"mnist", "fashion-mnist"}));
  app.add_option("--seed", o.seed, "Seed of model init, data order and dropout")->transform(seed());
  app.add_option("--max-steps", o.max_steps, "Stop after this many training steps in total (0: no limit)")
      ->transform(integer<std::int64_t>(0, "an integer >= 0"));
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "Epochs between checkpoints into <path>/checkpoint (0: none); also written when --max-steps stops")
      ->transform(counting_int());
  app.add_option("--checkpoint-steps", o.checkpoint_steps,
                 "Also checkpoint every this many training steps (0: by epoch only)")
      ->transform(integer<std::int64_t>(0, "an integer >= 0"));
  add_max_restarts(app, o, "restart the workers of every node from the newest checkpoint");
  app.add_option("--resume", o.resume,
                 "Continue from a checkpoint directory; 'auto': <path>/checkpoint when it holds one; 'never' (the "
                 "default): start afresh")
      ->check(printable("a path without newlines or other control characters"));
  app.add_option("--amp", o.amp,
                 "Mixed precision: forward and loss under autocast to bf16 or fp16 (fp16 with an agreed loss scale); "
                 "parameters, optimizer and statistics stay float32")
      ->check(one_of({"none", "bf16", "fp16"}));
  app.add_option("--accumulate", o.accumulate,
                 "Micro-batches of --batch-size whose gradients each optimizer step sums, communicating on the last")
      ->transform(integer<int>(1, "an integer from 1 up to 1024", 1024, ""));
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "A gradient bucket closes once it holds this many MB (the first at 1 MB, or this if less)")
      ->check(number(0, false, 1 << 20, "a positive number of MB up to 1048576"));
  bool no_check = false;
  app.add_flag("--no-check-collectives", no_check,
               "Issue collectives without checking them against every rank's (to measure what the check costs)");

  auto& ps = o.powersgd;
  app.add_option("--powersgd-rank", ps.matrix_approximation_rank(), "PowerSGD matrix approximation rank")
      ->transform(integer<std::int64_t>(1, "a positive integer"));
  app.add_option("--start-powersgd-iter", ps.start_powersgd_iter(), "Steps of plain allreduce before PowerSGD starts")
      ->transform(integer<std::int64_t>(0, "an integer >= 0"));
  app.add_option("--min-compression-rate", ps.min_compression_rate(),
                 "PowerSGD compresses a matrix only when it saves at least this factor")
      ->check(number(0, false, FLT_MAX, "a positive number", "up to 3.4e38"));
  bool no_error_feedback = false, no_warm_start = false;
  app.add_flag("--no-error-feedback", no_error_feedback, "PowerSGD: drop the compression error instead of carrying it");
  app.add_flag("--no-warm-start", no_warm_start, "PowerSGD: draw a fresh Q every step");
  app.add_option("--orthogonalization-epsilon", ps.orthogonalization_epsilon(),
                 "PowerSGD: added to column norms when orthogonalising")
      ->check(number(0, true, FLT_MAX, "a number >= 0", "up to 3.4e38"));
  app.add_option("--powersgd-seed", ps.random_seed(), "PowerSGD: seed of Q's initial draws")->transform(seed());

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    throw UsageError(one_line(e, app));
  }

  settle_launch_flags(app, o, env);
  if (o.resume == "never") o.resume.clear();

  o.check_collectives = !no_check;
  ps.use_error_feedback(!no_error_feedback);
  ps.warm_start(!no_warm_start);
  if ((ps.use_error_feedback() || ps.warm_start()) && ps.start_powersgd_iter() <= 1)
    throw UsageError("--start-powersgd-iter " + std::to_string(ps.start_powersgd_iter()) +
                     ": must be > 1 while error feedback or warm start is on (PowerSGD needs plain steps first); "
                     "raise it or pass --no-error-feedback --no-warm-start");

  record_arguments(app, o);
  return o;
}

std::optional<Options> parse_options(int argc, const char* const* argv) {
  return parse_options(argc, argv, Environment{});
}

std::optional<Options> parse_options(const std::vector<std::string>& argv, const Environment& env) {
  std::vector<const char*> pointers;
  for (const auto& a : argv) pointers.push_back(a.c_str());
  return parse_options(static_cast<int>(pointers.size()), pointers.data(), env);
}

std::optional<RunCommand> parse_run_command(const std::vector<std::string>& argv, const Environment& env) {
  RunCommand run;
  const auto dash = std::find(argv.begin(), argv.end(), "--");
  const std::vector<std::string> flags(argv.begin() + std::min<size_t>(2, argv.size()), dash);
  if (dash != argv.end()) run.program.assign(dash + 1, argv.end());
  CLI::App app{
      "Runs PROGRAM as the workers of one data-parallel job, as it runs its own: one process per GPU (NCCL)\n"
      "or --nproc processes on the CPU (Gloo), each finding its place with mnist_ddp::init_process_group();\n"
      "a worker that fails stops the others, Ctrl-C stops them all, --max-restarts starts them again.\n"
      "Usage: mnist_ddp run [OPTIONS] -- PROGRAM [ARGS...]",
      "mnist_ddp run"};
  set_defaults(app);
  add_launch_flags(app, run.launch);
  add_max_restarts(app, run.launch, "start every node's workers again");
  std::vector<const char*> pointers{"mnist_ddp run"};
  for (const auto& f : flags) pointers.push_back(f.c_str());
  try {
    app.parse(static_cast<int>(pointers.size()), pointers.data());
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    throw UsageError("run: " + one_line(e, app));
  }
  if (run.program.empty() || run.program.front().empty())
    throw UsageError("run: no program: mnist_ddp run [--nproc N ...] -- PROGRAM [ARGS...]");
  settle_launch_flags(app, run.launch, env);
  record_arguments(app, run.launch);
  return run;
}

std::vector<std::string> command_line_of(const Arguments& arguments) {
  std::vector<std::string> out;
  for (const auto& [name, value] : arguments) {
    std::string flag = "--" + name;
    std::replace(flag.begin(), flag.end(), '_', '-');
    out.push_back(flag);
    out.push_back(value);
  }
  return out;
}

Arguments arguments_in_effect(const Options& opts, const Arguments& decided) {
  Arguments out = opts.arguments;
  for (const auto& [name, value] : decided)
    for (auto& [arg, old] : out)
      if (arg == name) old = value;
  return out;
}

std::string overridden_flags(const Options& opts, const Arguments& decided) {
  std::string overridden;
  for (const auto& [name, value] : decided) {
    if (std::find(opts.given.begin(), opts.given.end(), name) == opts.given.end()) continue;
    for (const auto& [arg, old] : opts.arguments) {
      if (arg != name || old == value) continue;
      overridden += (overridden.empty() ? "" : ", ") + command_line_of({{name, value}})[0] + " " + value + " (given " +
                    old + ")";
    }
  }
  return overridden.empty() ? "" : "the launcher's environment overrides the command line: " + overridden;
}

Arguments shared_settings(const Arguments& arguments) {
  static const std::vector<std::string> own = {"workers", "path", "gpus", "nproc", "node_rank", "master_addr",
                                               "master_port", "data_dir", "resume"};
  Arguments out;
  for (const auto& arg : arguments)
    if (std::find(own.begin(), own.end(), arg.first) == own.end()) out.push_back(arg);
  return out;
}

Arguments launcher_decisions(const WorkerEnv& env) {
  if (env.ours()) return {};
  std::vector<std::pair<std::string, std::string>> decided = {
      {"master_addr", env.master_addr},
      {"master_port", std::to_string(env.master_port)},
      {"nproc", std::to_string(env.local_world_size)},
  };
  if (env.world_size % env.local_world_size == 0)
    decided.emplace_back("nnodes", std::to_string(env.world_size / env.local_world_size));
  decided.emplace_back("node_rank", std::to_string(env.node_rank));
  return decided;
}

hooks::CommHookPtr make_comm_hook(const std::string& compression, const hooks::PowerSgdOptions& powersgd) {
  if (compression == "none") return hooks::allreduce();
  if (compression == "fp16") return hooks::fp16_compress();
  if (compression == "powersgd") return hooks::powersgd(powersgd);
  if (compression == "powersgd_fp16") return hooks::fp16_compress_wrapper(hooks::powersgd(powersgd));
  if (compression == "batched_powersgd_fp16") return hooks::fp16_compress_wrapper(hooks::batched_powersgd(powersgd));
  if (compression == "bf16") return hooks::bf16_compress();
  if (compression == "powersgd_bf16") return hooks::bf16_compress_wrapper(hooks::powersgd(powersgd));
  if (compression == "batched_powersgd_bf16") return hooks::bf16_compress_wrapper(hooks::batched_powersgd(powersgd));
  throw UsageError("--compression " + compression + ": unknown");
}

}  // namespace mnist_ddp
