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
    const Placement placement = plan_placement(*opts, count_visible_gpus(env.cuda_visible_devices));
    preflight(*opts);
    return run_launcher(*opts, placement, env, std::vector<std::string>(argv, argv + argc), original_mask);
  } catch (const UsageError& e) {
    std::cerr << "mnist_ddp: error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "mnist_ddp: error: " << e.what() << std::endl;
    return 1;
  }
}
