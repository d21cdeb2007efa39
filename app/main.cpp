// mnist_ddp: parse options, then either launch the workers or be one;
// mnist_ddp run -- PROGRAM: launch another program's workers.
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "base/environment.hpp"
#include "comm/store.hpp"
#include "app/base/logging.hpp"
#include "app/base/options.hpp"
#include "app/base/placement.hpp"
#include "app/launch/launcher.hpp"
#include "app/launch/supervisor.hpp"
#include "app/train/trainer.hpp"
#include "app/worker.hpp"

namespace {

// mnist_ddp run: this node's launcher for the user's program.
int run(const std::vector<std::string>& argv, const mnist_ddp::Environment& env, const sigset_t& original_mask) {
  using namespace mnist_ddp;
  if (const std::optional<WorkerEnv> worker = launched_worker(env))
    throw UsageError("run: this process is a worker that " + worker->launcher +
                     " started; run the program directly under it, or start one mnist_ddp run per machine");
  std::optional<RunCommand> command = parse_run_command(argv, env);
  if (!command) return 0;  // --help
  // What the environment decides for this node (Kubeflow's PET_*) wins, as for mnist_ddp's own launcher.
  std::vector<std::string> args(argv.begin(), std::find(argv.begin(), argv.end(), "--"));
  const Arguments decided = node_decisions(env);
  for (const std::string& flag : command_line_of(decided)) args.push_back(flag);
  args.push_back("--");
  args.insert(args.end(), command->program.begin(), command->program.end());
  if (!decided.empty()) command = parse_run_command(args, env);
  const Placement placement = plan_placement(command->launch, count_visible_gpus(env.cuda_visible_devices));
  return run_program(command->launch, placement, env, command->program, original_mask);
}

// "rank 3: " in a worker another launcher started (torchrun, Slurm,
// mpirun): each of its ranks prints its own line, so each says whose it
// is. "" where ours started it (it reports one line for all) or none did.
std::string whose_line(const mnist_ddp::Environment& env) {
  try {
    const std::optional<mnist_ddp::WorkerEnv> worker = mnist_ddp::launched_worker(env);
    if (worker && !worker->ours() && worker->rank >= 0) return "rank " + std::to_string(worker->rank) + ": ";
  } catch (const std::exception&) {
  }
  return "";
}

int launch_or_work(int argc, char** argv) {
  using namespace mnist_ddp;
  // Before any thread exists (supervisor.hpp): a worker gets its mask back below.
  const sigset_t original_mask = block_launcher_signals();
  umask(umask(0) | S_IWOTH);  // nothing we create is world-writable, whatever the caller's umask
  std::string who;
  try {
    const Environment env = read_environment();
    who = whose_line(env);
    quiet_libtorch_logs(env.libtorch_log_level);
    if (argc > 1 && std::string(argv[1]) == "run") return run(std::vector<std::string>(argv, argv + argc), env, original_mask);
    const std::optional<Options> opts = parse_options(argc, argv, env);
    if (!opts) return 0;  // --help
    if (const std::optional<WorkerEnv> worker = launched_worker(env)) {
      sigprocmask(SIG_SETMASK, &original_mask, nullptr);
      return run_worker(*opts, env, *worker);
    }
    // This node's launcher. What its environment decides (Kubeflow's PET_*)
    // joins the command line, for it and for its workers.
    std::vector<std::string> args(argv, argv + argc);
    const Arguments decided = node_decisions(env);
    for (const std::string& flag : command_line_of(decided)) args.push_back(flag);
    const Options node = decided.empty() ? *opts : *parse_options(args, env);
    if (const std::string overridden = overridden_flags(*opts, decided); !overridden.empty())
      std::cerr << "mnist_ddp: " << overridden << std::endl;
    const Placement placement = plan_placement(node, count_visible_gpus(env.cuda_visible_devices));
    // What the CPU cannot run is refused here, once, before anything is made; a GPU's by its workers.
    if (placement.devices.empty()) check_amp(node, torch::kCPU);
    const auto lock = preflight(node);
    return run_launcher(node, placement, env, args, original_mask);
  } catch (const UsageError& e) {
    say_no_more();
    std::cerr << "mnist_ddp: error: " << who << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    say_no_more();
    std::cerr << "mnist_ddp: error: " << who << error_line(e) << std::endl;
    return 1;
  } catch (...) {
    say_no_more();
    std::cerr << "mnist_ddp: error: " << who << "a failure of unknown kind" << std::endl;
    return 1;
  }
}

}  // namespace

// Every object of ours is gone when launch_or_work returns (the group, the
// trainer, the launcher's children and lock are its locals).
int main(int argc, char** argv) { mnist_ddp::end_process(launch_or_work(argc, argv)); }
