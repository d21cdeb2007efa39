#include "app/worker.hpp"

#include <malloc.h>
#include <unistd.h>

#include <gloo/common/error.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <set>

#include "app/base/error_report.hpp"
#include "app/base/files.hpp"
#include "app/base/logging.hpp"
#include "app/base/placement.hpp"
#include "mnist_ddp/comm/process_group.hpp"
#include "comm/collectives.hpp"
#include "comm/group.hpp"
#include "comm/runtime.hpp"
#include "app/train/model.hpp"
#include "app/train/trainer.hpp"

namespace mnist_ddp {
namespace {

// What the worker knows of its run besides the options: the arguments as
// the launcher's environment leaves them in effect, and the environment's
// launch time and fault injection.
RunContext run_context(const Options& opts, const Environment& env, const WorkerEnv& worker) {
  RunContext run;
  const Arguments decided = launcher_decisions(worker);
  run.arguments = arguments_in_effect(opts, decided);
  run.nnodes = worker.ours() ? worker.nnodes : opts.nnodes;
  for (const auto& [name, value] : decided)
    if (name == "nnodes") run.nnodes = std::stoi(value);
  run.launch_time = env.launch_time;
  run.faults = faults_from(env);
  return run;
}

bool given(const Options& opts, const std::string& name) {
  return std::find(opts.given.begin(), opts.given.end(), name) != opts.given.end();
}

// Where this worker trains: as our launcher planned it, or, started by
// another launcher, as planned here for its local rank.
std::pair<std::string, int> backend_and_device(const Options& opts, const Environment& env, const WorkerEnv& worker) {
  if (worker.ours()) return {worker.backend, worker.device};
  const Placement placement = plan_placement(opts, count_visible_gpus(env.cuda_visible_devices));
  return {placement.backend, device_of_local_rank(placement, worker.local_rank)};
}


// The one line a worker started by another launcher logs about a
// --max-restarts given to it: restarts are that launcher's.
std::string restarts_belong_to(const std::string& launcher, int max_restarts) {
  const std::string advice =
      launcher == "torchrun"  ? "torchrun's --max_restarts restarts the workers, which resume with --resume auto"
      : launcher == "slurm"   ? "sbatch --requeue (scripts/slurm_mnist_ddp.sbatch) requeues a preempted job"
      : launcher == "kubeflow" ? "the PyTorchJob's restartPolicy restarts the pods"
                               : launcher + " restarts nothing: run it again with --resume auto";
  return "--max-restarts " + std::to_string(max_restarts) + " is ignored: restarts belong to the launcher that "
         "started the workers (" + launcher + "): " + advice;
}

// After a collective failed with `error`: who went silent, as the nodes
// and ranks lost and the --timeout that ran out, in our words, Gloo's after.
// Sets `echo` when another process's failure explains this one.
std::string name_the_lost(const ProcessGroup& group, const Options& opts, const std::string& error, bool& echo) {
  const bool nodes = group.local_world_size() < group.world_size();
  const std::string waited = "no word within --timeout " + fmt::format("{:g}", opts.timeout) + " s";
  const std::optional<std::vector<int>> silent = silent_ranks(group);
  echo = !silent || !silent->empty();
  if (!silent)  // nor does the store answer: its host, or the link to it, is gone
    return "lost node " + std::to_string(node_of(group, 0)) + " (rank 0 and the store it hosts): " + waited +
           " from its ranks or its store; the link to it is down, or it hangs (" + error + ")";
  if (silent->empty()) return error;
  std::string who, where;
  std::set<int> lost_nodes;
  for (int r : *silent) {
    who += (who.empty() ? "" : ", ") + std::to_string(r);
    lost_nodes.insert(node_of(group, r));
  }
  for (int node : lost_nodes) where += (where.empty() ? "node " : ", node ") + std::to_string(node);
  return "lost rank" + std::string(silent->size() > 1 ? "s " : " ") + who +
         (*silent == std::vector<int>{0} ? " (the store's host)" : nodes ? " (" + where + ")" : "") + ": " + waited +
         " (" + error + ")";
}

}  // namespace

void configure_worker_process(int threads) {
  // A step allocates and frees activations of several MB. By default glibc
  // maps each one afresh and unmaps it on free, so every step page-faults
  // them in again; those faults serialise on the process's memory map while
  // the communication threads allocate too, and cost more than half a step
  // on 2 CPU workers (182 -> 81 ms per step measured). Keep freed memory.
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
  mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024);
  at::set_num_threads(threads);
  at::set_num_interop_threads(1);
}

int run_worker(const Options& opts, const Environment& env, const WorkerEnv& launched) {
  WorkerEnv worker = launched;
  int code = 1;
  std::unique_ptr<ProcessGroup> group;
  std::string message;
  bool echo = false;  // the error only follows from another process's failure
  std::unique_ptr<files::DirectoryLock> lock;  // this job's --path, under another launcher
  // A backend's failure (collectives.hpp), or a collective that waited the
  // whole timeout (watch.hpp): name who went silent, unless this rank was
  // being stopped; the peers' heartbeats take seconds.
  auto name_silent = [&](const std::string& what) {
    message = what;
    echo = preemption_signal() != 0;
    if (!echo && group && group->world_size() > 1) message = name_the_lost(*group, opts, message, echo);
  };
  try {
    resolve_store_address(worker, opts.master_addr, given(opts, "master_addr"), opts.master_port,
                          given(opts, "master_port"));
    const RunContext run = run_context(opts, env, worker);
    const auto [backend, device] = backend_and_device(opts, env, worker);
    configure_worker_process(threads_per_worker(worker.local_world_size, env.omp_num_threads));
    // Every rank compares these with rank 0's while joining, named as flags.
    Settings settings;
    for (auto [name, value] : shared_settings(run.arguments)) {
      std::replace(name.begin(), name.end(), '_', '-');
      settings.emplace_back("--" + name, value);
    }
    int64_t parameters = 0;
    for (const auto& p : Net()->parameters()) parameters += p.numel();
    settings.emplace_back("the model", "Net with " + std::to_string(parameters) + " parameters");
    group = std::make_unique<ProcessGroup>(init_process_group(
        worker, ProcessGroupOptions()
                    .backend(backend)
                    .device(cuda_device_or_cpu(device))
                    .timeout(std::chrono::milliseconds(static_cast<int64_t>(opts.timeout * 1000)))
                    .settings(settings)
                    .check_collectives(opts.check_collectives)));
    if (group->rank() == 0) {
      files::make_run_directory(opts.path);
      if (!worker.ours()) lock = std::make_unique<files::DirectoryLock>(opts.path, "mnist_ddp rank 0 under " + worker.launcher);
    }
    init_logging(opts.path, group->rank(), env.dumb_terminal);
    if (const std::string overridden = overridden_flags(opts, launcher_decisions(worker)); !overridden.empty())
      spdlog::warn("{}", overridden);
    if (!worker.ours() && opts.max_restarts > 0) spdlog::warn("{}", restarts_belong_to(worker.launcher, opts.max_restarts));
    const int preempted = Trainer(opts, run, *group).run();
    if (preempted)  // not a failure: the launcher must not restart or blame this rank
      report_worker_error(worker.error_report_fd,
                          {worker.local_rank, false,
                           "rank " + std::to_string(group->rank()) + " stopped on " + signal_name(preempted), true});
    return preempted ? 128 + preempted : 0;
  } catch (const UsageError& e) {
    message = e.what();
    code = 2;
  } catch (const CollectiveFailed& e) {
    name_silent(e.what());
  } catch (const CollectiveTimedOut& e) {
    name_silent(e.what());
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
    if (collective && !echo && group && group->world_size() > 1) message = name_the_lost(*group, opts, message, echo);
  }
  show_progress("");
  say_no_more();
  log_error_to_file(message);
  const int rank = group ? group->rank() : worker.rank;
  const std::string who = rank >= 0 ? "rank " + std::to_string(rank)
                                    : "node " + std::to_string(worker.node_rank) + " local rank " +
                                          std::to_string(worker.local_rank);
  report_worker_error(worker.error_report_fd, {worker.local_rank, echo, who + ": " + message});
  // Leave without destructors: a process group or the collective thread
  // could wait for peers that are gone.
  std::cout.flush();
  std::cerr.flush();
  _exit(code);
}

}  // namespace mnist_ddp
