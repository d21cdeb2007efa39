// The launcher's checks before the start (launcher.hpp).
#include "app/launch/launcher.hpp"

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <future>
#include <iostream>
#include <memory>
#include <thread>

#include "app/base/files.hpp"
#include "app/train/checkpoint.hpp"
#include "app/train/data.hpp"
#include "app/train/model.hpp"
#include "app/train/preemption.hpp"
#include "app/train/resume.hpp"

namespace mnist_ddp {
namespace {

std::unique_ptr<files::DirectoryLock> checks_before_start(const Options& opts) {
  check_dataset_files(opts.data_dir, opts.dataset);
  const bool existed = files::is_directory(opts.path);
  files::make_run_directory(opts.path);
  auto lock = std::make_unique<files::DirectoryLock>(opts.path, "mnist_ddp launcher of node " +
                                                                    std::to_string(opts.node_rank));
  std::cout << "The folder '" << opts.path << "' " << (existed ? "already exists." : "was created.") << std::endl;
  if (const std::string dir = resume_dir(opts); !dir.empty()) {
    const Checkpoint c = load_checkpoint(dir);
    check_resumable(c, opts, dir);
    Net net;
    load_state_dict(*net, c.model, "module.", "checkpoint " + dir);
  }
  return lock;
}

}  // namespace

// The checks run on a thread of their own while this one answers Ctrl-C,
// SIGTERM and SIGHUP (blocked since main(), as they stay for the
// supervisor): a check stuck opening a file (a FIFO, a hung network
// filesystem) cannot hold the launcher. Nothing is started yet, so a
// signal ends the process there and then.
std::unique_ptr<files::DirectoryLock> preflight(const Options& opts) {
  auto checks = std::make_shared<std::packaged_task<std::unique_ptr<files::DirectoryLock>()>>(
      [&opts] { return checks_before_start(opts); });
  std::future<std::unique_ptr<files::DirectoryLock>> done = checks->get_future();
  std::thread([checks] { (*checks)(); }).detach();
  sigset_t stop;
  sigemptyset(&stop);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&stop, sig);
  const timespec tick{0, 50'000'000};
  while (done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    if (const int sig = sigtimedwait(&stop, nullptr, &tick); sig > 0) {
      std::cerr << "mnist_ddp: " << signal_name(sig) << " received during the checks before the start (" << opts.data_dir
                << ", " << opts.path << "): nothing was started" << std::endl;
      std::_Exit(128 + sig);
    }
  }
  return done.get();
}

}  // namespace mnist_ddp
