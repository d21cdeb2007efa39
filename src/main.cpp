// mnist_ddp: parse options, then either launch the workers or be one.
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "mnist_ddp/launcher.hpp"
#include "mnist_ddp/logging.hpp"
#include "mnist_ddp/options.hpp"
#include "mnist_ddp/worker.hpp"

int main(int argc, char** argv) {
  using namespace mnist_ddp;
  const auto launched = std::chrono::system_clock::now().time_since_epoch();
  // Before any thread exists (launcher.hpp): a worker gets its mask back below.
  const sigset_t original_mask = block_launcher_signals();
  quiet_libtorch_logs();
  umask(umask(0) | S_IWOTH);  // nothing we create is world-writable, whatever the caller's umask
  try {
    const std::optional<Options> opts = parse_options(argc, argv);
    if (!opts) return 0;  // --help
    if (const auto env = worker_env_from_environment()) {
      sigprocmask(SIG_SETMASK, &original_mask, nullptr);
      return run_worker(*opts, *env);
    }
    const Placement placement = plan_placement(*opts);
    preflight(*opts);
    // The workers time their start-up from here.
    setenv("MNIST_DDP_LAUNCH_TIME", std::to_string(std::chrono::duration<double>(launched).count()).c_str(), 1);
    return run_launcher(*opts, placement, std::vector<std::string>(argv, argv + argc), original_mask);
  } catch (const UsageError& e) {
    std::cerr << "mnist_ddp: error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "mnist_ddp: error: " << e.what() << std::endl;
    return 1;
  }
}
