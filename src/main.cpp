// mnist_ddp: parse options, then either launch the workers or be one.
#include <signal.h>
#include <sys/stat.h>

#include <iostream>
#include <string>
#include <vector>

#include "mnist_ddp/base/environment.hpp"
#include "mnist_ddp/base/logging.hpp"
#include "mnist_ddp/base/options.hpp"
#include "mnist_ddp/base/placement.hpp"
#include "mnist_ddp/launch/launcher.hpp"
#include "mnist_ddp/launch/supervisor.hpp"
#include "mnist_ddp/worker.hpp"

int main(int argc, char** argv) {
  using namespace mnist_ddp;
  // Before any thread exists (supervisor.hpp): a worker gets its mask back below.
  const sigset_t original_mask = block_launcher_signals();
  const Environment env = read_environment();
  quiet_libtorch_logs(env.libtorch_log_level);
  umask(umask(0) | S_IWOTH);  // nothing we create is world-writable, whatever the caller's umask
  try {
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
    const auto lock = preflight(node);
    return run_launcher(node, placement, env, args, original_mask);
  } catch (const UsageError& e) {
    std::cerr << "mnist_ddp: error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "mnist_ddp: error: " << e.what() << std::endl;
    return 1;
  }
}
