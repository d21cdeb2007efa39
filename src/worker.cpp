#include "mnist_ddp/worker.hpp"

#include <malloc.h>
#include <unistd.h>

#include <gloo/common/error.h>

#include <iostream>

#include <spdlog/spdlog.h>

#include "mnist_ddp/checkpoint.hpp"
#include "mnist_ddp/data.hpp"
#include "mnist_ddp/dist.hpp"
#include "mnist_ddp/files.hpp"
#include "mnist_ddp/logging.hpp"
#include "mnist_ddp/model.hpp"
#include "mnist_ddp/resume.hpp"
#include "mnist_ddp/trainer.hpp"

namespace mnist_ddp {
namespace {

void prepare_output_dir(const std::string& path, bool announce) {
  const bool existed = files::is_directory(path);
  if (!existed) {
    try {
      files::make_directories(path);
    } catch (const std::exception& e) {
      throw std::runtime_error("--path " + path + ": " + e.what());
    }
  }
  if (access(path.c_str(), W_OK | X_OK) != 0)
    throw std::runtime_error("--path " + path + ": the directory is not writable");
  if (announce) std::cout << "The folder '" << path << "' " << (existed ? "already exists." : "was created.") << std::endl;
}

// An exception's first line, without LibTorch's backtrace.
std::string error_line(const std::exception& e) {
  std::string msg = e.what();
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) msg = c10e->what_without_backtrace();
  return msg.substr(0, msg.find('\n'));
}

}  // namespace

void configure_worker_process(int local_workers) {
  // A step allocates and frees activations of several MB. By default glibc
  // maps each one afresh and unmaps it on free, so every step page-faults
  // them in again; those faults serialise on the process's memory map while
  // the communication threads allocate too, and cost more than half a step
  // on 2 CPU workers (182 -> 81 ms per step measured). Keep freed memory.
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
  mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024);
  at::set_num_threads(threads_per_worker(local_workers));
  at::set_num_interop_threads(1);
}

void preflight(const Options& opts) {
  check_dataset_files(opts.data_dir, opts.dataset);
  prepare_output_dir(opts.path, /*announce=*/true);
  if (const std::string dir = resume_dir(opts); !dir.empty()) {
    Net net;
    load_state_dict(*net, load_checkpoint(dir).model, "module.", "checkpoint " + dir);
  }
}

int run_worker(const Options& given, const WorkerEnv& env) {
  Options opts = given;
  const std::string overridden = apply_launcher_environment(opts, env);
  int code = 1;
  std::unique_ptr<Dist> dist;
  std::string message;
  bool echo = false;  // the error only follows from another process's failure
  try {
    const Placement placement = plan_placement(opts);
    configure_worker_process(env.local_world_size);
    Settings settings = shared_settings(opts);
    int64_t parameters = 0;
    for (const auto& p : Net()->parameters()) parameters += p.numel();
    settings.emplace_back("model", "Net with " + std::to_string(parameters) + " parameters");
    dist = std::make_unique<Dist>(connect(env, placement, opts.timeout, settings));
    if (dist->rank == 0) prepare_output_dir(opts.path, /*announce=*/false);
    init_logging(opts.path, dist->rank);
    if (!overridden.empty()) spdlog::warn("{}", overridden);
    const int preempted = Trainer(opts, *dist).run();
    return preempted ? 128 + preempted : 0;
  } catch (const UsageError& e) {
    message = e.what();
    code = 2;
  } catch (const PeerLost& e) {
    message = e.what();
    echo = true;
  } catch (const std::exception& e) {
    message = error_line(e);
    // A collective that failed (LibTorch's or Gloo's error): name who went
    // silent, unless this rank was being stopped, which says its launcher
    // (or scheduler) already knows why; the peers' heartbeats take seconds.
    const bool collective = dynamic_cast<const c10::Error*>(&e) || dynamic_cast<const gloo::Exception*>(&e);
    echo = collective && preemption_signal() != 0;
    if (collective && !echo && dist && dist->world_size > 1) {
      const std::vector<int> silent = dist->silent_ranks();
      std::string who;
      for (int r : silent) who += (who.empty() ? "" : ", ") + std::to_string(r);
      echo = !silent.empty();
      if (echo)
        message = "lost rank" + std::string(silent.size() > 1 ? "s " : " ") + who +
                  (silent == std::vector<int>{0} ? " (the store's host)" : "") + ": " + message;
    }
  }
  show_progress("");
  log_error_to_file(message);
  report_worker_error(env, dist ? dist->rank : env.rank, message, echo);
  // Leave without destructors: a process group or the collective thread
  // could wait for peers that are gone.
  std::cout.flush();
  std::cerr.flush();
  _exit(code);
}

}  // namespace mnist_ddp
