#include "app/launch/launcher.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <system_error>

#include "app/base/faults.hpp"
#include "app/base/files.hpp"
#include "comm/secrets.hpp"
#include "comm/store.hpp"
#include "app/launch/containment.hpp"
#include "app/launch/restart_rounds.hpp"
#include "app/launch/supervisor.hpp"
#include "app/train/checkpoint.hpp"
#include "app/train/data.hpp"
#include "app/train/preemption.hpp"
#include "app/train/resume.hpp"

namespace mnist_ddp {
namespace {

constexpr auto kGracePeriod = std::chrono::seconds(5);  // SIGTERM, then SIGKILL
// For workers to finish their step and checkpoint it after a preemption
// signal (Slurm's KillWait is 30 s by default, --signal=USR1@60 gives 60).
constexpr auto kPreemptionGrace = std::chrono::seconds(60);
// How long a process a worker left behind has to end after SIGTERM.
constexpr auto kOrphanGrace = std::chrono::milliseconds(2000);
// Where the nodes say how their secrets stand (comm/secrets.hpp): node 0's
// store lives as long as the job, its rounds included.
const SecretKeys kSecretKeys(0);

std::string node(int n) { return "node " + std::to_string(n); }

// The launcher as the subreaper of everything its workers start: whatever
// is still running when it returns, or throws, is ended (supervisor.hpp).
struct OrphansEnd {
  OrphansEnd() { become_subreaper(); }
  ~OrphansEnd() { end_orphans(kOrphanGrace); }
};

// What the launcher starts: this binary as mnist_ddp's workers, or a
// program of the user's (mnist_ddp run).
struct Workers {
  std::string program;            // the file to exec
  std::vector<std::string> argv;  // argv[0] included
  bool ours = true;               // mnist_ddp's workers: data to fit, --resume auto on a restart
};

class Launcher {
 public:
  Launcher(const Options& opts, const Placement& placement, const Environment& env, Workers workers,
           const sigset_t& original_mask, const JobContainment& job)
      : opts_(opts), placement_(placement), env_(env), workers_(std::move(workers)), job_(job),
        supervisor_(original_mask) {
    supervisor_.set_cgroup(job.cgroup_procs_fd());
  }
  ~Launcher() {
    rounds_.reset();  // holds the store too: close_store() must let go of the last reference
    close_store(store_);  // never waits on a stalled store (store.hpp)
  }

  int run() {
    // What a worker holds, measured: 63 MB of its own, and the data set.
    constexpr int64_t kWorkerBytes = 63 << 20;
    const int64_t data = workers_.ours ? kWorkerBytes + dataset_bytes(opts_.data_dir, opts_.dataset) : 0;
    check_workers_fit(opts_, placement_, data, usable_cores(), available_memory());
    // The nodes' secret, read where several nodes need it (and a bad file
    // refused before anything opens).
    std::string secret;
    if (opts_.nnodes > 1) {
      std::string warning;
      try {
        secret = env_.secret.read(&warning);
      } catch (const UsageError& e) {
        say_no_more();
        std::cerr << "mnist_ddp: error: " << e.what() << std::endl;
        if (opts_.node_rank > 0)
          tell_the_first(opts_.master_addr, opts_.master_port, kSecretKeys,
                         secret_difference(node(opts_.node_rank), node(0), SecretStand::unusable_file));
        else
          tell_the_nodes();
        return 2;
      }
      if (!warning.empty()) std::cerr << "mnist_ddp: warning: " << warning << std::endl;
    }
    try {
      if (const int code = open_job_store(); code >= 0) return code;
      if (const int code = hold_for_test(); code >= 0) return code;
      if (opts_.nnodes > 1)
        if (const int code = compare_secrets(secret); code >= 0) return code;
    } catch (const std::system_error& e) {  // LibTorch's socket errors say only what the socket said
      lost_node_0s_store(e);
    } catch (const c10::Error& e) {
      lost_node_0s_store(e);
    }
    // Every key of the job under a prefix no other process can name (store.hpp,
    // "Note on neighbours"): drawn here for one node, from the secret for several.
    prefix_ = !secret.empty() ? prefix_for_secret(secret) : opts_.nnodes == 1 ? random_prefix() : "";
    if (prefix_.empty() && opts_.node_rank == 0)
      std::cerr << "mnist_ddp: warning: the store at " << opts_.master_addr << ":" << store_->getPort()
                << " takes any process that reaches it at its word: give every node the same MNIST_DDP_SECRET "
                   "(docs/clusters.md)"
                << std::endl;
    StorePtr job_store = store_;
    if (!prefix_.empty()) job_store = c10::make_intrusive<c10d::PrefixStore>(prefix_, store_);
    rounds_ = std::make_unique<RestartRounds>(job_store, opts_.node_rank, opts_.nnodes, timeout());
    RestartRounds& rounds = *rounds_;
    std::vector<std::string> argv = workers_.argv;
    double launched = env_.launch_time;
    for (int round = 0;; ++round) {
      round_ = round;
      const int code = supervise(rounds, round, start_workers(round, argv, launched));
      end_orphans(kOrphanGrace);  // what the workers left running ends with them
      const bool again = code != 0 && !interrupted_ && code != 2 && round < opts_.max_restarts;
      RestartRounds::Outcome next{again, failure_};
      if (again) next = rounds.join(round + 1, failure_, [this] { return signalled(100); });
      if (!next.start) {
        if (code == 0) {  // a clean end, after restarts or none: no error to tell
          if (round > 0) std::cout << "mnist_ddp: the job finished after " << round << " restart(s)" << std::endl;
          return 0;
        }
        failure_ = next.why;
        say_no_more();
        if (!failure_.empty())
          std::cerr << "mnist_ddp: error: " << failure_
                    << (round == 0                     ? std::string()
                        : round == opts_.max_restarts ? " (restarted " + std::to_string(round) + " times; no restart left)"
                                                      : " (restarted " + std::to_string(round) + " times)")
                    << std::endl;
        if (code != 0)
          rounds.refuse(round + 1, "node " + std::to_string(opts_.node_rank) + " stopped" +
                                       (failure_.empty() ? std::string(" (interrupted)") : ": " + failure_));
        return code;
      }
      announce_restart(next.why, round + 1);
      // --resume auto starts from the beginning where node 0 has no checkpoint yet.
      if (round == 0 && workers_.ours) argv.insert(argv.end(), {"--resume", "auto"});  // the last --resume wins
      launched = unix_seconds();  // the restarted workers time their start-up from now
    }
  }

 private:
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(static_cast<int64_t>(opts_.timeout * 1000));
  }

  // A store request that failed on its socket ("Connection reset by
  // peer"), said as what it means. Node 0's launcher hosts the store, so
  // its own failure is passed on as it is.
  [[noreturn]] void lost_node_0s_store(const std::exception& e) {
    if (opts_.node_rank == 0) throw;
    throw std::runtime_error("lost node 0's store at " + opts_.master_addr + ":" + std::to_string(opts_.master_port) +
                             " (its launcher stopped, or dropped the connection): " + error_line(e));
  }

  // Faults::hold_workers_until. Returns -1, or the exit code of a signal.
  int hold_for_test() {
    const std::string path = faults_from(env_).hold_workers_until;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!path.empty() && !files::exists(path) && std::chrono::steady_clock::now() < deadline)
      if (const auto event = supervisor_.wait(std::chrono::milliseconds(50)); event.signal) return on_signal(event.signal);
    return -1;
  }

  // Node 0 cannot use its secret file: its store stays up saying so, until
  // every other node has ended over the secret, --timeout passes or a
  // signal comes, so that no node waits --timeout for a store that never
  // opens. A store that cannot open (the port taken) tells nobody.
  void tell_the_nodes() {
    try {
      store_ = open_store(opts_.master_addr, opts_.master_port, true, timeout());
      const StoreClient client(store_, timeout(), "the store");
      client.set(kSecretKeys.check, kFirstCannotUseItsFile);
      std::cerr << "mnist_ddp: telling the other nodes, for up to " << static_cast<int64_t>(opts_.timeout)
                << " s (--timeout; Ctrl-C ends it)" << std::endl;
      const auto deadline = std::chrono::steady_clock::now() + timeout();
      while (client.add(kSecretKeys.ended, 0) < opts_.nnodes - 1 && std::chrono::steady_clock::now() < deadline)
        if (supervisor_.wait(std::chrono::milliseconds(100)).signal) return;
    } catch (const std::exception&) {
    }
  }

  // Whether every node has node 0's secret (store.hpp, "Note on
  // neighbours"): node 0 leaves a salted digest of its own at the store's
  // root (never the secret); another node compares, and a node whose secret
  // differs says so there too, for node 0. Returns -1 when they agree, else
  // the exit code.
  int compare_secrets(const std::string& secret) {
    const StoreClient client(store_, timeout(), "node 0's store");
    if (opts_.node_rank == 0) {
      client.set(kSecretKeys.check, secret_check(secret, random_prefix()));
      return -1;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    while (client.wait({kSecretKeys.check}, std::chrono::milliseconds(250)).size() == 1) {
      if (const auto event = supervisor_.wait(std::chrono::milliseconds(0)); event.signal) return on_signal(event.signal);
      if (std::chrono::steady_clock::now() >= deadline)
        throw std::runtime_error("node 0's store at " + opts_.master_addr + ":" + std::to_string(opts_.master_port) +
                                 " says nothing of its secret after " + std::to_string(static_cast<int64_t>(opts_.timeout)) +
                                 " s: is it mnist_ddp's node 0?");
    }
    const std::optional<SecretStand> how = stand_against(secret, client.get(kSecretKeys.check));
    if (!how) return -1;
    if (*how == SecretStand::unusable_file) {
      client.add(kSecretKeys.ended, 1);
      throw UsageError(secret_difference(node(0), node(0), *how) + ": " + secret_advice("node", *how));
    }
    const std::string why = secret_difference(node(opts_.node_rank), node(0), *how);
    try {
      client.set(kSecretKeys.differs, why);
    } catch (const std::exception&) {
    }
    throw UsageError(why + ": " + secret_advice("node", *how));
  }

  // The store outlives the workers, so the nodes can agree on a restart
  // through it. Node 0 hosts it; another node waits for it up to --timeout,
  // answering signals meanwhile. Returns -1 once it is open, else the exit code.
  int open_job_store() {
    if (opts_.node_rank == 0) {
      store_ = open_store(opts_.master_addr, opts_.master_port, true, timeout());
      return -1;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    for (;;) {
      try {
        store_ = open_store(opts_.master_addr, opts_.master_port, false, std::chrono::seconds(1));
        return -1;
      } catch (const std::runtime_error&) {
        if (std::chrono::steady_clock::now() >= deadline)
          throw std::runtime_error("could not reach node 0's store at " + opts_.master_addr + ":" +
                                   std::to_string(opts_.master_port) + " within " +
                                   std::to_string(static_cast<int64_t>(opts_.timeout)) +
                                   " s: start mnist_ddp there with --node-rank 0");
      }
      if (const auto event = supervisor_.wait(std::chrono::milliseconds(0)); event.signal)
        return on_signal(event.signal);
    }
  }

  // Starts round `round`'s workers. Returns early with what happened when a
  // worker already failed, or a signal came, while the others were being
  // started (many workers take a while to start).
  Supervisor::Event start_workers(int round, const std::vector<std::string>& argv, double launched) {
    for (int r = 0; r < placement_.local_workers; ++r) {
      WorkerEnv w;
      w.local_rank = r;
      w.local_world_size = placement_.local_workers;
      w.node_rank = opts_.node_rank;
      w.nnodes = opts_.nnodes;
      w.master_addr = opts_.master_addr;
      w.master_port = static_cast<int>(store_->getPort());
      w.store_prefix = prefix_;
      w.round = round;
      w.backend = placement_.backend;
      w.device = device_of_local_rank(placement_, r);
      w.error_report_fd = supervisor_.report_fd();
      w.timeout_ms = static_cast<int>(timeout().count());  // a program's process group takes it (process_group.hpp)
      w.job = job_.token();
      const auto env = worker_environment(w, env_.variables, usable_cores(), launched);
      supervisor_.start(r, workers_.program, argv, env);
      if (Supervisor::Event event = supervisor_.wait(std::chrono::milliseconds(0)); event.signal || event.failure)
        return event;
    }
    return {};
  }

  // Supervises round `round`, whose start came to `at_start`, until every
  // worker has exited, a worker fails, a signal arrives, or (with several
  // nodes) another node asks for the next round. Returns the exit code it
  // comes to.
  int supervise(RestartRounds& rounds, int round, const Supervisor::Event& at_start) {
    if (at_start.signal) return on_signal(at_start.signal);
    if (at_start.failure) return on_failure(*at_start.failure, round);
    while (supervisor_.any_running()) {
      const auto event = supervisor_.wait(opts_.nnodes > 1 ? std::chrono::milliseconds(250)
                                                           : std::chrono::milliseconds(-1));
      if (event.signal) return on_signal(event.signal);
      if (event.failure) return on_failure(*event.failure, round);
      if (opts_.nnodes > 1 && opts_.node_rank == 0 && round == 0) {
        const StoreClient client(store_, timeout(), "the store");
        const std::string said = client.check({kSecretKeys.differs}) ? client.get(kSecretKeys.differs) : "";
        const int from = secret_difference_of(said, "node", node(0));
        if (from > 0 && from < opts_.nnodes) {
          failure_ = said;
          supervisor_.stop(SIGTERM, kGracePeriod);
          say_no_more();
          std::cerr << "mnist_ddp: error: " << failure_ << ": "
                    << secret_advice("node", SecretStand::differs) << std::endl;
          failure_.clear();
          interrupted_ = true;
          return 2;
        }
      }
      if (auto cause = rounds.requested(round + 1)) {
        // Another node lost a worker: this node's workers wait on it in
        // vain, and start again with it.
        failure_ = *cause;
        supervisor_.stop(SIGKILL, std::chrono::seconds(0));
        return 1;
      }
    }
    return 0;
  }

  int on_failure(const Supervisor::Failure& failure, int round) {
    if (failure.report && failure.report->preempted) return on_preempted(failure, round);
    failure_ = failure.report ? failure.report->message
                              : "worker " + std::string(opts_.nnodes > 1 ? "local rank " : "rank ") +
                                    std::to_string(failure.index) + " (pid " + std::to_string(failure.pid) + ") " +
                                    describe_status(failure.status) + "; stopping the other workers";
    // A store host at its descriptor limit takes no client: under libuv's
    // loop its workers only time out, so this launcher says why.
    if (opts_.node_rank == 0 && store_ && descriptors_spent()) failure_ = out_of_descriptors(failure_);
    // A restart follows unless the restarts are spent: the others' state is
    // not needed (the restart resumes from the checkpoint), nor their
    // seconds of finding out who is gone.
    if (round < opts_.max_restarts)
      supervisor_.stop(SIGKILL, std::chrono::seconds(0));
    else
      supervisor_.stop(SIGTERM, kGracePeriod);
    return exit_code_of(failure.status);
  }

  // The workers stopped on a preemption signal that reached them, not this
  // launcher (a scheduler signals the workers, or another node's launcher
  // was signalled and every rank stopped with it): not a failure, and
  // never restarted. Returns the exit code, 128 + the signal.
  int on_preempted(const Supervisor::Failure& failure, int round) {
    interrupted_ = true;
    const int sig = exit_code_of(failure.status) - 128;
    supervisor_.stop(sig, kPreemptionGrace);  // the others stop after the same step
    const std::optional<std::string> node = rounds_->preempted(round, std::chrono::seconds(2));
    std::cout << "mnist_ddp: "
              << (node ? node->substr(0, node->find(':')) + " was preempted (" + signal_name(sig) + " to its launcher)"
                       : "the workers were preempted (" + signal_name(sig) + ")")
              << ": every rank stopped after the step they agreed on"
              << (workers_.ours ? ", checkpointed in " + checkpoint_dir(opts_) + "; --resume auto goes on from there"
                                : "")
              << std::endl;
    failure_.clear();
    return 128 + sig;
  }

  // A signal to the launcher: preemption is passed on, anything else stops
  // the workers. Returns the exit code.
  int on_signal(int sig) {
    interrupted_ = true;
    if (isatty(STDERR_FILENO)) std::cerr << "\r\033[K";  // rank 0's progress line
    if (sig == SIGTERM || sig == SIGUSR1) {  // preemption: keep the step the workers are on
      std::cout << "mnist_ddp: " << signal_name(sig) << " received: passed on to the "
                << (workers_.ours ? "workers, which checkpoint the step they are on, then stop"
                                  : "job's processes, which have " + std::to_string(static_cast<int>(kPreemptionGrace.count())) +
                                        " s to stop")
                << std::endl;
      if (rounds_) rounds_->preempt(round_, signal_name(sig));
      supervisor_.stop(sig, kPreemptionGrace);
    } else {
      std::cout << "KeyboardInterrupt received. Terminating processes..." << std::endl;
      // Our workers checkpoint on a hangup too, and name it.
      supervisor_.stop(sig == SIGHUP && workers_.ours ? SIGHUP : SIGTERM, kGracePeriod);
    }
    failure_.clear();
    return 128 + sig;
  }

  // Whether a signal came within `ms` milliseconds (handled as on_signal does).
  bool signalled(int ms) {
    const auto event = supervisor_.wait(std::chrono::milliseconds(ms));
    if (!event.signal) return false;
    on_signal(event.signal);
    return true;
  }

  void announce_restart(const std::string& cause, int restart) {
    if (!workers_.ours) {
      std::cout << "mnist_ddp: " << cause << "; restart " << restart << " of " << opts_.max_restarts << std::endl;
      return;
    }
    // Every node again, from the newest complete checkpoint (rank 0's, on node 0).
    const std::string dir = checkpoint_dir(opts_);
    const std::optional<Checkpoint> at = opts_.node_rank == 0 ? read_manifest(dir) : std::nullopt;
    std::cout << "mnist_ddp: " << cause << "; restart " << restart << " of " << opts_.max_restarts
              << (opts_.node_rank > 0 ? std::string(" from node 0's newest checkpoint")
                  : at ? " from the checkpoint of step " + std::to_string(at->step) + " in " + dir
                       : std::string(" from the start: no checkpoint yet"))
              << std::endl;
  }

  const Options& opts_;
  const Placement& placement_;
  const Environment& env_;
  const Workers workers_;
  const JobContainment& job_;
  Supervisor supervisor_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
  std::string prefix_;  // of every key of the job in the store
  std::string failure_;       // why the workers last failed, for the user
  bool interrupted_ = false;  // by a signal to the launcher, or a preemption: no restart
  std::unique_ptr<RestartRounds> rounds_;  // once the store is open
  int round_ = 0;                          // the round running
};

}  // namespace

int run_launcher(const Options& opts, const Placement& placement, const Environment& env,
                 const std::vector<std::string>& argv, const sigset_t& original_mask) {
  const JobContainment job(!faults_from(env).without_cgroup);  // first: its watcher is no child of ours
  const OrphansEnd orphans;
  Launcher launcher(opts, placement, env, {"/proc/self/exe", argv, true}, original_mask, job);
  return launcher.run();
}

std::string find_program(const std::string& name, const Environment& env) {
  auto runnable = [](const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    if (!runnable(name)) throw UsageError("run: " + name + " is not an executable file");
    return name;
  }
  const std::string path = env.get("PATH").value_or("/usr/local/bin:/usr/bin:/bin");
  std::istringstream dirs(path);
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && runnable(dir + "/" + name)) return dir + "/" + name;
  throw UsageError("run: " + name + ": no such program on PATH (" + path + ")");
}

int run_program(const Options& opts, const Placement& placement, const Environment& env,
                const std::vector<std::string>& program, const sigset_t& original_mask) {
  const std::string found = find_program(program.front(), env);
  const JobContainment job(!faults_from(env).without_cgroup);
  const OrphansEnd orphans;
  Launcher launcher(opts, placement, env, {found, program, false}, original_mask, job);
  return launcher.run();
}

}  // namespace mnist_ddp
