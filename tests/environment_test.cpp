// The environment module: every launcher's variables read back as the
// worker they describe, our launcher's environment for its workers, and
// the placement of a node's workers on its devices.
#include <gtest/gtest.h>

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <thread>

#include "base/environment.hpp"
#include "app/base/error_report.hpp"
#include "app/base/options.hpp"
#include "app/base/placement.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::parse;

TEST(WorkerEnv, FirstHostOfASlurmNodeList) {
  EXPECT_EQ(first_slurm_host("gpu[003-005,010],cpu7"), "gpu003");
  EXPECT_EQ(first_slurm_host("node7"), "node7");
  EXPECT_EQ(first_slurm_host("a1,b[1-2]"), "a1");
  EXPECT_EQ(first_slurm_host("rack[2,4]-node"), "rack2-node");
}

// What this process's environment says it is, read as main() reads it.
std::optional<WorkerEnv> worker_env_from_environment() { return launched_worker(read_environment()); }

// Runs `check` with exactly `vars` set among the variables a launcher uses.
void with_environment(const std::map<std::string, std::string>& vars, const std::function<void()>& check) {
  const std::vector<std::string> names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                          "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                                          "SLURM_LOCALID", "SLURM_TASKS_PER_NODE", "SLURM_NODEID",
                                          "SLURM_JOB_NODELIST", "SLURM_NODELIST", "MNIST_DDP_NNODES",
                                          "MNIST_DDP_ROUND", "MNIST_DDP_ERROR_FD", "SLURM_JOB_ID",
                                          "SLURM_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
                                          "TORCHELASTIC_RESTART_COUNT"};
  std::map<std::string, std::string> saved;
  for (const auto& n : names) {
    if (const char* v = std::getenv(n.c_str())) saved[n] = v;
    unsetenv(n.c_str());
  }
  for (const auto& [n, v] : vars) setenv(n.c_str(), v.c_str(), 1);
  check();
  for (const auto& n : names) unsetenv(n.c_str());
  for (const auto& [n, v] : saved) setenv(n.c_str(), v.c_str(), 1);
}

TEST(WorkerEnv, EachLauncherConvention) {
  with_environment({}, [] { EXPECT_FALSE(worker_env_from_environment()); });
  with_environment({{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"},
                    {"GROUP_RANK", "2"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}},
                   [] {
                     const auto env = worker_env_from_environment();
                     ASSERT_TRUE(env);
                     EXPECT_EQ(env->rank, 2);
                     EXPECT_EQ(env->world_size, 3);
                     EXPECT_EQ(env->node_rank, 2);
                     EXPECT_EQ(env->master_addr, "10.0.0.1");
                     EXPECT_FALSE(env->agent_store);  // rank 0 hosts the store
                     EXPECT_EQ(env->restart, 0);
                   });
  with_environment({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29400"},
                    {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "3"}},
                   [] {
                     const auto env = worker_env_from_environment();
                     ASSERT_TRUE(env);
                     EXPECT_TRUE(env->agent_store);  // torchrun's agent hosts it
                     EXPECT_EQ(env->restart, 3);
                   });
  with_environment({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                    {"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_NODEID", "1"}, {"SLURM_JOB_NODELIST", "gpu[003-004]"},
                    {"SLURM_JOB_ID", "1234567"}, {"SLURM_RESTART_COUNT", "1"}},
                   [] {
                     const auto env = worker_env_from_environment();
                     ASSERT_TRUE(env);
                     EXPECT_EQ(env->rank, 5);
                     EXPECT_EQ(env->world_size, 8);
                     EXPECT_EQ(env->local_rank, 1);
                     EXPECT_EQ(env->local_world_size, 4);
                     EXPECT_EQ(env->master_addr, "gpu003");
                     EXPECT_EQ(env->master_port, 24567);  // follows the job: 20000 + SLURM_JOB_ID % 10000
                     EXPECT_EQ(env->restart, 1);          // requeued once
                   });
  with_environment({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "gpu[003-004]"},
                    {"MASTER_ADDR", "head"}, {"MASTER_PORT", "4000"}},
                   [] {
                     const auto env = worker_env_from_environment();
                     EXPECT_EQ(env->master_addr, "head");
                     EXPECT_EQ(env->master_port, 4000);
                   });
  with_environment({{"MNIST_DDP_NNODES", "2"}, {"GROUP_RANK", "1"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"},
                    {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}, {"MNIST_DDP_ROUND", "2"}},
                   [] {
                     const auto env = worker_env_from_environment();
                     ASSERT_TRUE(env);
                     EXPECT_EQ(env->rank, -1);  // agreed through the store
                     EXPECT_EQ(env->nnodes, 2);
                     EXPECT_EQ(env->node_rank, 1);
                     EXPECT_EQ(env->round, 2);
                   });
  with_environment({{"RANK", "3"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}},
                   [] { EXPECT_THROW(worker_env_from_environment(), UsageError); });
}

// The environment each other launcher gives a process, read without
// touching this process's own.
TEST(WorkerEnv, MpiAndKubeflowConventions) {
  // Open MPI's mpirun -np 4 on one host: the store on loopback, its port
  // following the job (the same for every rank, another for the next job).
  const std::vector<std::string> ompi = {"OMPI_COMM_WORLD_RANK=3", "OMPI_COMM_WORLD_SIZE=4",
                                         "OMPI_COMM_WORLD_LOCAL_RANK=3", "OMPI_COMM_WORLD_LOCAL_SIZE=4",
                                         "OMPI_MCA_ess_base_jobid=1586561025"};
  auto w = launched_worker(environment_from(ompi));
  ASSERT_TRUE(w);
  EXPECT_EQ(w->launcher, "mpirun");
  EXPECT_EQ(w->rank, 3);
  EXPECT_EQ(w->world_size, 4);
  EXPECT_EQ(w->local_rank, 3);
  EXPECT_EQ(w->local_world_size, 4);
  EXPECT_EQ(w->master_addr, "127.0.0.1");
  EXPECT_GE(w->master_port, 20000);
  EXPECT_LT(w->master_port, 30000);
  auto other_job = ompi;
  other_job.back() = "OMPI_MCA_ess_base_jobid=1586626561";
  EXPECT_NE(launched_worker(environment_from(other_job))->master_port, w->master_port);
  // Across two hosts the address comes from MASTER_ADDR or --master-addr.
  const std::vector<std::string> two_hosts = {"OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=4",
                                              "OMPI_COMM_WORLD_LOCAL_RANK=0", "OMPI_COMM_WORLD_LOCAL_SIZE=2"};
  w = launched_worker(environment_from(two_hosts));
  EXPECT_EQ(w->node_rank, 1);
  EXPECT_EQ(w->master_addr, "");
  WorkerEnv flags = *w;
  EXPECT_THROW(resolve_store_address(flags, "127.0.0.1", false, 0, false), UsageError);
  resolve_store_address(flags, "node0", true, 0, false);
  EXPECT_EQ(flags.master_addr, "node0");
  EXPECT_EQ(flags.master_port, 29500);
  auto with_addr = two_hosts;
  with_addr.push_back("MASTER_ADDR=10.0.0.1");
  with_addr.push_back("MASTER_PORT=4000");
  w = launched_worker(environment_from(with_addr));
  EXPECT_EQ(w->master_addr, "10.0.0.1");
  EXPECT_EQ(w->master_port, 4000);

  // MPICH's (hydra's) mpiexec -n 2 on one host: the port follows its proxy.
  Environment hydra = environment_from({"PMI_RANK=1", "PMI_SIZE=2", "MPI_LOCALRANKID=1", "MPI_LOCALNRANKS=2"});
  hydra.parent_pid = 4242;
  w = launched_worker(hydra);
  ASSERT_TRUE(w);
  EXPECT_EQ(w->launcher, "mpiexec");
  EXPECT_EQ(w->rank, 1);
  EXPECT_EQ(w->local_rank, 1);
  EXPECT_EQ(w->master_port, 20000 + 4242);

  // A PyTorchJob pod started without torchrun: RANK is the pod's index.
  const Environment pod = environment_from({"MASTER_ADDR=job-master-0", "MASTER_PORT=23456", "WORLD_SIZE=4",
                                            "RANK=3", "PET_NNODES=4", "PET_NODE_RANK=3", "PET_NPROC_PER_NODE=1"});
  w = launched_worker(pod);
  ASSERT_TRUE(w);
  EXPECT_EQ(w->launcher, "kubeflow");
  EXPECT_EQ(w->rank, 3);
  EXPECT_EQ(w->local_rank, 0) << "one process per pod, whatever its RANK";
  EXPECT_EQ(w->local_world_size, 1);
  EXPECT_EQ(w->node_rank, 3);
  // With two processes per pod, this one launches them.
  const Environment pod_of_two = environment_from({"MASTER_ADDR=job-master-0", "MASTER_PORT=23456", "WORLD_SIZE=4",
                                                   "RANK=1", "PET_NNODES=2", "PET_NODE_RANK=1", "PET_NPROC_PER_NODE=2"});
  EXPECT_FALSE(launched_worker(pod_of_two));
  const Arguments decided = node_decisions(pod_of_two);
  const std::map<std::string, std::string> d(decided.begin(), decided.end());
  EXPECT_EQ(d.at("nnodes"), "2");
  EXPECT_EQ(d.at("node_rank"), "1");
  EXPECT_EQ(d.at("nproc"), "2");
  EXPECT_EQ(d.at("master_addr"), "job-master-0");
  EXPECT_EQ(d.at("master_port"), "23456");
  // Kubeflow's Trainer: PET_* only.
  const Arguments trainer = node_decisions(environment_from(
      {"PET_NNODES=3", "PET_NODE_RANK=2", "PET_NPROC_PER_NODE=auto", "PET_MASTER_ADDR=a", "PET_MASTER_PORT=1234"}));
  const std::map<std::string, std::string> t(trainer.begin(), trainer.end());
  EXPECT_EQ(t.at("nnodes"), "3");
  EXPECT_EQ(t.at("node_rank"), "2");
  EXPECT_EQ(t.count("nproc"), 0u) << "auto: the placement decides";
  EXPECT_EQ(t.at("master_port"), "1234");
  // NODE_RANK (Ray, Lightning) counts where GROUP_RANK is absent.
  EXPECT_EQ(launched_worker(environment_from({"RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=1",
                                              "NODE_RANK=1", "MASTER_PORT=29500"}))->node_rank, 1);
}

// An environment that says this process is one of several, from a launcher
// mnist_ddp does not read, is refused, naming the variables.
TEST(WorkerEnv, AnUnknownLaunchersRanksAreRefused) {
  for (const auto& vars : std::vector<std::vector<std::string>>{{"MV2_COMM_WORLD_RANK=1", "MV2_COMM_WORLD_SIZE=4"},
                                                                {"JSM_NAMESPACE_RANK=0", "JSM_NAMESPACE_SIZE=2"},
                                                                {"LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2"},
                                                                {"WORLD_SIZE=8"}}) {
    const Environment env = environment_from(vars);
    ASSERT_FALSE(launched_worker(env));
    try {
      node_decisions(env);
      ADD_FAILURE() << vars[0] << " was not refused";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(vars[0]), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  }
  // One of one, or nothing at all: our own launcher, with nothing decided.
  EXPECT_TRUE(node_decisions(environment_from({"MV2_COMM_WORLD_RANK=0", "MV2_COMM_WORLD_SIZE=1"})).empty());
  EXPECT_TRUE(node_decisions(environment_from({"PATH=/usr/bin"})).empty());
}

// Our launcher's worker environment, built without a fork, reads back as
// the WorkerEnv it was built from; a parent's launcher variables never leak
// through, and the user's thread count and log level stand.
TEST(WorkerEnv, TheLaunchersEnvironmentReadsBackAsTheWorkerItDescribes) {
  WorkerEnv w;
  w.local_rank = 1;
  w.local_world_size = 3;
  w.node_rank = 1;
  w.nnodes = 2;
  w.master_addr = "10.0.0.7";
  w.master_port = 29511;
  w.round = 3;
  w.error_report_fd = 9;
  const std::vector<std::string> parent = {"PATH=/usr/bin", "RANK=7", "WORLD_SIZE=9", "MASTER_PORT=1",
                                           "MNIST_DDP_ROUND=4"};
  const std::vector<std::string> env = worker_environment(w, parent, 8);
  std::map<std::string, std::string> vars;
  for (const auto& kv : env) {
    const std::string key = kv.substr(0, kv.find('='));
    EXPECT_EQ(vars.count(key), 0u) << key << " set twice";
    vars[key] = kv.substr(kv.find('=') + 1);
  }
  EXPECT_EQ(vars.at("PATH"), "/usr/bin");
  EXPECT_EQ(vars.count("RANK") + vars.count("WORLD_SIZE"), 0u);
  EXPECT_EQ(vars.at("MNIST_DDP_ROUND"), "3");
  EXPECT_EQ(vars.at("OMP_NUM_THREADS"), "2");  // 8 cores, 3 workers
  std::map<std::string, std::string> launcher_vars = vars;
  for (const auto& key : {"PATH", "OMP_NUM_THREADS"}) launcher_vars.erase(key);
  with_environment(launcher_vars, [&] {
    const auto back = worker_env_from_environment();
    ASSERT_TRUE(back);
    EXPECT_EQ(back->rank, -1);
    EXPECT_EQ(back->local_rank, 1);
    EXPECT_EQ(back->local_world_size, 3);
    EXPECT_EQ(back->node_rank, 1);
    EXPECT_EQ(back->nnodes, 2);
    EXPECT_EQ(back->master_addr, "10.0.0.7");
    EXPECT_EQ(back->master_port, 29511);
    EXPECT_EQ(back->round, 3);
    EXPECT_EQ(back->error_report_fd, 9);
  });
  // What the launcher planned for the worker, and when it launched it.
  w.backend = "nccl";
  w.device = 1;
  const Environment planned = environment_from(worker_environment(w, parent, 8, 1764000000.25), 5);
  EXPECT_EQ(planned.launch_time, 1764000000.25);
  const auto worker = launched_worker(planned);
  ASSERT_TRUE(worker);
  EXPECT_EQ(worker->launcher, "mnist_ddp");
  EXPECT_EQ(worker->backend, "nccl");
  EXPECT_EQ(worker->device, 1);
  EXPECT_EQ(environment_from({}, 5).launch_time, 5) << "no launcher's time: when the process started";
  const auto own = worker_environment(w, {"OMP_NUM_THREADS=5"}, 8);
  EXPECT_NE(std::find(own.begin(), own.end(), "OMP_NUM_THREADS=5"), own.end());
  EXPECT_EQ(std::count_if(own.begin(), own.end(), [](const std::string& kv) { return kv.rfind("OMP_NUM_THREADS=", 0) == 0; }), 1);
}

// A worker's error line survives the trip through the launcher's pipe.
TEST(WorkerEnv, AnErrorReportReadsBackAsSent) {
  const std::string line = error_report_line({4, true, "rank 6: lost rank 0 (the store's host): timed out"});
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(std::count(line.begin(), line.end(), '\n'), 1);
  const auto back = parse_error_report(line);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->local_rank, 4);
  EXPECT_TRUE(back->echo);
  EXPECT_EQ(back->message, "rank 6: lost rank 0 (the store's host): timed out");
  EXPECT_FALSE(parse_error_report(error_report_line({0, false, "x"})).value().echo);
  EXPECT_FALSE(parse_error_report("no tabs here"));
}

// A one-GPU machine runs several workers on its GPU over Gloo; NCCL refuses.
TEST(Placement, WorkersShareAGpuOverGlooAndNcclRefusesARepeatedDevice) {
  auto place = [](const std::vector<std::string>& args, bool cuda_build, int visible) {
    return plan_placement(parse(args), cuda_build, visible);
  };
  auto refusal = [&](const std::vector<std::string>& args, bool cuda_build, int visible) {
    try {
      place(args, cuda_build, visible);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  Placement p = place({"--gpus", "0,0"}, true, 1);
  EXPECT_EQ(p.backend, "gloo") << "auto: a repeated id means sharing, so Gloo";
  EXPECT_EQ(p.devices, (std::vector<int>{0, 0}));
  EXPECT_EQ(p.local_workers, 2);
  p = place({"--backend", "gloo", "--gpus", "0,0,0"}, true, 1);
  EXPECT_EQ(p.devices, (std::vector<int>{0, 0, 0}));
  p = place({}, true, 2);
  EXPECT_EQ(p.backend, "nccl");
  EXPECT_EQ(p.devices, (std::vector<int>{0, 1}));
  p = place({"--nproc", "3"}, true, 0);
  EXPECT_EQ(p.backend, "gloo");
  EXPECT_TRUE(p.devices.empty());
  EXPECT_EQ(p.local_workers, 3);

  EXPECT_EQ(refusal({"--backend", "nccl", "--gpus", "0,0"}, true, 1),
            "--gpus: device 0 is listed twice, but --backend nccl needs a GPU of its own per worker; use --backend "
            "gloo to let workers share a GPU");
  EXPECT_EQ(refusal({"--gpus", "0,2"}, true, 2), "--gpus: device 2 does not exist (2 visible, ids 0..1)");
  EXPECT_EQ(refusal({"--backend", "gloo", "--gpus", "0"}, false, 0),
            "--gpus: device 0 does not exist (no CUDA device is visible to this build)");
  EXPECT_NE(refusal({"--backend", "nccl"}, false, 0).find("CPU-only LibTorch"), std::string::npos);
  EXPECT_NE(refusal({"--backend", "nccl"}, true, 0).find("no CUDA device is visible"), std::string::npos);
}

// What CUDA_VISIBLE_DEVICES leaves visible, as CUDA reads it, without CUDA.
TEST(Placement, VisibleGpusAreCountedAsCudaReadsTheVariable) {
  EXPECT_EQ(count_visible_gpus(std::nullopt, 4), 4);
  EXPECT_EQ(count_visible_gpus(std::string("1,3"), 4), 2);
  EXPECT_EQ(count_visible_gpus(std::string("GPU-8e3c0f5a-1b2c,MIG-4f0a"), 4), 2);
  EXPECT_EQ(count_visible_gpus(std::string("2"), 8), 1);  // one GPU per task
  EXPECT_EQ(count_visible_gpus(std::string("0,1,2"), 2), 2);  // no more than there are
  EXPECT_EQ(count_visible_gpus(std::string(""), 4), 0);
  EXPECT_EQ(count_visible_gpus(std::string("NoDevFiles"), 4), 0);  // Slurm, no GPU allocated
  EXPECT_EQ(count_visible_gpus(std::string("-1"), 4), 0);
  EXPECT_EQ(count_visible_gpus(std::string("0,-1,1"), 4), 1);  // up to the first that is not a device
}

// Slurm's --gpus-per-task=1, one-GPU pods, CUDA_VISIBLE_DEVICES narrowed per
// task: a rank that sees exactly one GPU trains on it whatever its local rank.
TEST(Placement, ARankThatSeesOneGpuUsesItWhateverItsLocalRank) {
  const Placement one = plan_placement(parse({}), true, 1);
  EXPECT_EQ(one.backend, "nccl");
  for (int local_rank : {0, 1, 3}) EXPECT_EQ(device_of_local_rank(one, local_rank), 0);
  const Placement two = plan_placement(parse({}), true, 2);
  EXPECT_EQ(device_of_local_rank(two, 1), 1);
  EXPECT_THROW(device_of_local_rank(two, 2), UsageError);  // two visible, a third rank: no GPU of its own
  const Placement cpu = plan_placement(parse({}), true, 0);
  EXPECT_EQ(cpu.backend, "gloo");
  EXPECT_EQ(device_of_local_rank(cpu, 3), -1);
  EXPECT_EQ(device_of_local_rank(plan_placement(parse({"--gpus", "1,0"}), true, 2), 0), 1);
}

TEST(Placement, AWorkersThreadsAreAShareOfTheCoresItMayRunOn) {
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof all, &all), 0);
  EXPECT_EQ(usable_cores(), CPU_COUNT(&all));
  const int machine = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_LE(2 * threads_per_worker(2, 0), std::max(2, machine)) << "two workers take at most the machine's cores";
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  cpu_set_t one;  // one core, as `taskset -c N` or a Slurm or container cpuset leaves
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof one, &one), 0);
  const int cores = usable_cores(), share = threads_per_worker(1, 0), asked = threads_per_worker(1, 3);
  ASSERT_EQ(sched_setaffinity(0, sizeof all, &all), 0);
  EXPECT_EQ(cores, 1);
  EXPECT_EQ(share, 1) << "a worker bound to one core got more threads (its share of the machine's cores)";
  EXPECT_EQ(asked, 3) << "OMP_NUM_THREADS is the user's";
}

// Under torchrun or Slurm the environment decides the placement flags; the
// arguments then report what is used, and the flags given otherwise are named.
TEST(WorkerEnv, TheLaunchersEnvironmentOverridesPlacementFlagsAndSaysWhich) {
  Options opts = parse({"--master-port", "1234", "--nproc", "4", "--epochs", "3"});
  WorkerEnv env;
  env.rank = 3;
  env.world_size = 4;
  env.local_rank = 1;
  env.local_world_size = 2;
  env.node_rank = 1;
  env.master_addr = "10.0.0.1";
  env.master_port = 24567;
  const Arguments decided = launcher_decisions(env);
  EXPECT_EQ(overridden_flags(opts, decided),
            "the launcher's environment overrides the command line: --master-port 24567 (given 1234), --nproc 2 "
            "(given 4)");
  const Arguments in_effect = arguments_in_effect(opts, decided);
  const std::map<std::string, std::string> args(in_effect.begin(), in_effect.end());
  EXPECT_EQ(args.at("master_addr"), "10.0.0.1");
  EXPECT_EQ(args.at("master_port"), "24567");
  EXPECT_EQ(args.at("nproc"), "2");
  EXPECT_EQ(args.at("nnodes"), "2");
  EXPECT_EQ(args.at("node_rank"), "1");
  EXPECT_EQ(args.at("epochs"), "3");
  EXPECT_EQ(opts.master_port, 1234);  // the options stay as parsed
  env.round = 0;  // our launcher's worker: its flags are the launcher's, untouched
  Options ours = parse({"--nproc", "4"});
  EXPECT_TRUE(launcher_decisions(env).empty());
  EXPECT_EQ(overridden_flags(ours, launcher_decisions(env)), "");
  const Arguments ours_in_effect = arguments_in_effect(ours, launcher_decisions(env));
  const std::map<std::string, std::string> ours_args(ours_in_effect.begin(), ours_in_effect.end());
  EXPECT_EQ(ours_args.at("nproc"), "4");
}

}  // namespace
}  // namespace mnist_ddp
