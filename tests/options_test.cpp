#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <regex>
#include <sstream>

#include "mnist_ddp/files.hpp"
#include "mnist_ddp/launcher.hpp"
#include "mnist_ddp/options.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

Options parse(std::vector<std::string> args) {
  args.insert(args.begin(), "mnist_ddp");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return *parse_options(static_cast<int>(argv.size()), argv.data());
}

std::string usage_error(const std::vector<std::string>& args) {
  try {
    parse(args);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(Options, DefaultsAreTheReferencesAndAllArgumentsAreListed) {
  const Options o = parse({});
  EXPECT_EQ(o.batch_size, 32);
  EXPECT_EQ(o.test_batch_size, 256);
  EXPECT_EQ(o.epochs, 20);
  EXPECT_DOUBLE_EQ(o.lr, 0.01);
  EXPECT_DOUBLE_EQ(o.momentum, 0.9);
  EXPECT_DOUBLE_EQ(o.weight_decay, 5e-4);
  EXPECT_EQ(o.workers, 4);
  EXPECT_EQ(o.compression, "powersgd_fp16");
  EXPECT_EQ(o.log_interval, 10);
  EXPECT_EQ(o.path, "./logging/");
  EXPECT_EQ(o.nproc, 2);
  EXPECT_EQ(o.master_port, 0);
  std::map<std::string, std::string> args(o.arguments.begin(), o.arguments.end());
  EXPECT_EQ(args.at("batch_size"), "32");
  EXPECT_EQ(args.at("log_interval"), "10");
  EXPECT_EQ(args.at("weight_decay"), "0.0005");
  EXPECT_EQ(o.arguments.front().first, "batch_size");
}

TEST(Options, ReferenceSpellingsAndAliases) {
  const Options o = parse({"--log_interval", "5", "--wd", "0.001", "--batch-size", "64", "--gpus", "0,1",
                           "--compression", "none"});
  EXPECT_EQ(o.log_interval, 5);
  EXPECT_DOUBLE_EQ(o.weight_decay, 0.001);
  EXPECT_EQ(o.batch_size, 64);
  EXPECT_EQ(o.gpus, (std::vector<int>{0, 1}));
  EXPECT_EQ(o.compression, "none");
  std::map<std::string, std::string> args(o.arguments.begin(), o.arguments.end());
  EXPECT_EQ(args.at("log_interval"), "5");  // the parsed value, not the default
}

TEST(Options, AnOptionGivenTwiceTakesItsLastValueAsArgparseDoes) {
  const Options o = parse({"--compression", "none", "--epochs", "3", "--compression", "fp16", "--gpus", "0,1"});
  EXPECT_EQ(o.compression, "fp16");
  EXPECT_EQ(o.epochs, 3);
  EXPECT_EQ(o.gpus, (std::vector<int>{0, 1}));
}

TEST(Options, BadValuesNameTheFlagAndWhatIsAllowed) {
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {{"--compression", "zip"}, {"--compression", "none, fp16, powersgd, powersgd_fp16, batched_powersgd_fp16", "zip"}},
      {{"--batch-size", "0"}, {"--batch-size", "positive integer"}},
      {{"--batch-size", "-3"}, {"--batch-size", "positive integer"}},
      {{"--batch-size", "abc"}, {"--batch-size", "abc"}},
      {{"--epochs", "0"}, {"--epochs", "positive integer"}},
      {{"--lr", "0"}, {"--lr", "positive number"}},
      {{"--lr", "fast"}, {"--lr", "fast"}},
      {{"--backend", "mpi"}, {"--backend", "auto, nccl, gloo"}},
      {{"--master-port", "70000"}, {"--master-port", "0..65535"}},
      {{"--dataset", "cifar"}, {"--dataset", "mnist, fashion-mnist"}},
      {{"--nproc", "0"}, {"--nproc", "positive integer"}},
      {{"--no-such-flag"}, {"--no-such-flag"}},
  };
  for (const auto& c : cases) {
    const std::string msg = usage_error(c.args);
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const auto& piece : c.expected) EXPECT_NE(msg.find(piece), std::string::npos) << "'" << msg << "' lacks '" << piece << "'";
  }
}

TEST(Options, PowerSgdKnobs) {
  const Options d = parse({});
  EXPECT_EQ(d.powersgd.rank, 2);
  EXPECT_EQ(d.powersgd.start_iter, 1000);
  EXPECT_DOUBLE_EQ(d.powersgd.min_compression_rate, 2);
  EXPECT_TRUE(d.powersgd.error_feedback);
  EXPECT_TRUE(d.powersgd.warm_start);
  EXPECT_DOUBLE_EQ(d.powersgd.orthogonalization_epsilon, 0);
  EXPECT_EQ(d.powersgd.seed, 0u);
  const Options o = parse({"--powersgd-rank", "4", "--start-powersgd-iter", "0", "--no-error-feedback",
                           "--no-warm-start", "--orthogonalization-epsilon", "1e-8", "--powersgd-seed", "7",
                           "--min-compression-rate", "3"});
  EXPECT_EQ(o.powersgd.rank, 4);
  EXPECT_EQ(o.powersgd.start_iter, 0);
  EXPECT_FALSE(o.powersgd.error_feedback);
  EXPECT_FALSE(o.powersgd.warm_start);
  EXPECT_DOUBLE_EQ(o.powersgd.orthogonalization_epsilon, 1e-8);
  EXPECT_EQ(o.powersgd.seed, 7u);
  std::map<std::string, std::string> args(o.arguments.begin(), o.arguments.end());
  EXPECT_EQ(args.at("no_error_feedback"), "true");
  const std::map<std::string, std::string> defaults(d.arguments.begin(), d.arguments.end());
  EXPECT_EQ(defaults.at("no_warm_start"), "false");
}

TEST(Options, PowerSgdNeedsPlainStepsBeforeErrorFeedbackOrWarmStart) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--start-powersgd-iter", "1"}, {"--start-powersgd-iter", "0", "--no-warm-start"},
           {"--start-powersgd-iter", "1", "--no-error-feedback"}}) {
    const std::string msg = usage_error(args);
    EXPECT_NE(msg.find("--start-powersgd-iter"), std::string::npos) << msg;
    EXPECT_NE(msg.find("must be > 1"), std::string::npos) << msg;
  }
  EXPECT_EQ(usage_error({"--start-powersgd-iter", "0", "--no-warm-start", "--no-error-feedback"}), "(accepted)");
  EXPECT_NE(usage_error({"--powersgd-rank", "0"}).find("--powersgd-rank"), std::string::npos);
}

TEST(WorkerEnv, FirstHostOfASlurmNodeList) {
  EXPECT_EQ(first_slurm_host("gpu[003-005,010],cpu7"), "gpu003");
  EXPECT_EQ(first_slurm_host("node7"), "node7");
  EXPECT_EQ(first_slurm_host("a1,b[1-2]"), "a1");
  EXPECT_EQ(first_slurm_host("rack[2,4]-node"), "rack2-node");
}

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

TEST(Options, SeveralNodesNeedAPortAndAValidNodeRank) {
  EXPECT_EQ(parse({"--nnodes", "2"}).master_port, 29500);
  EXPECT_NE(usage_error({"--nnodes", "2", "--node-rank", "2"}).find("--node-rank 2: must be below --nnodes 2"),
            std::string::npos);
  EXPECT_NE(usage_error({"--nnodes", "2", "--master-port", "0"}).find("single node only"), std::string::npos);
  const auto settings = shared_settings(parse({"--nnodes", "2", "--node-rank", "1", "--nproc", "3"}));
  std::map<std::string, std::string> shared(settings.begin(), settings.end());
  EXPECT_EQ(shared.count("node_rank") + shared.count("nproc") + shared.count("path"), 0u);
  EXPECT_EQ(shared.at("nnodes"), "2");
  EXPECT_EQ(shared.at("compression"), "powersgd_fp16");
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
  EXPECT_EQ(apply_launcher_environment(opts, env),
            "the launcher's environment overrides the command line: --master-port 24567 (given 1234), --nproc 2 "
            "(given 4)");
  const std::map<std::string, std::string> args(opts.arguments.begin(), opts.arguments.end());
  EXPECT_EQ(args.at("master_addr"), "10.0.0.1");
  EXPECT_EQ(args.at("master_port"), "24567");
  EXPECT_EQ(args.at("nproc"), "2");
  EXPECT_EQ(args.at("nnodes"), "2");
  EXPECT_EQ(args.at("node_rank"), "1");
  EXPECT_EQ(args.at("epochs"), "3");
  EXPECT_EQ(opts.nnodes, 2);
  EXPECT_EQ(opts.master_port, 24567);
  env.round = 0;  // our launcher's worker: its flags are the launcher's, untouched
  Options ours = parse({"--nproc", "4"});
  EXPECT_EQ(apply_launcher_environment(ours, env), "");
  EXPECT_EQ(ours.nproc, 4);
}

// The pages a user reads: README.md, data/README.md and docs/*.md, as paths
// relative to the source tree.
std::vector<std::string> documentation_pages() {
  std::vector<std::string> pages = {"README.md", "data/README.md"};
  for (const auto& name : files::list_directory(std::string(MNIST_DDP_SOURCE_DIR) + "/docs"))
    if (name.size() > 3 && name.substr(name.size() - 3) == ".md") pages.push_back("docs/" + name);
  return pages;
}

std::string source_text(const std::string& relative) {
  return test::read_text(std::string(MNIST_DDP_SOURCE_DIR) + "/" + relative);
}

// Every flag the README and docs/ show for mnist_ddp (its flags table, and
// what follows the binary or its wrappers on a command line) is one that
// `mnist_ddp --help` lists.
TEST(Docs, EveryDocumentedFlagExists) {
  int status = -1;
  const std::string help = test::shell(std::string(MNIST_DDP_BINARY) + " --help", &status);
  ASSERT_EQ(status, 0) << help;
  const std::regex flag(R"(--[a-z][a-z0-9_-]*)");
  auto listed = [&](const std::string& f) { return std::regex_search(help, std::regex(f + R"((?![a-z0-9_-]))")); };
  int checked = 0;
  for (const auto& page : documentation_pages()) {
    std::istringstream lines(source_text(page));
    int number = 0;
    for (std::string line; std::getline(lines, line);) {
      ++number;
      std::string part;
      if (line.rfind("| `--", 0) == 0) {  // a row of the flags table
        part = line.substr(0, line.find('|', 1));
      } else {
        for (const std::string program : {"mnist_ddp ", "run_mnist_ddp.sh ", "slurm_mnist_ddp.sbatch "})
          if (const size_t at = line.find(program); at != std::string::npos && part.empty())
            part = line.substr(at + program.size());
        part = part.substr(0, part.find_first_of("#|`"));
      }
      for (auto it = std::sregex_iterator(part.begin(), part.end(), flag); it != std::sregex_iterator(); ++it) {
        ++checked;
        EXPECT_TRUE(listed(it->str())) << page << ":" << number << ": " << it->str() << " is not in mnist_ddp --help";
      }
    }
  }
  EXPECT_GT(checked, 40) << "the flags table is gone from README.md";
}

// A fenced code block of a page: where it starts, the HTML comment on the
// line before it, and its commands (lines joined at a trailing backslash,
// a trailing "# comment" dropped).
struct CodeBlock {
  std::string where;
  std::string marker;
  std::vector<std::string> commands;
};

std::vector<CodeBlock> code_blocks(const std::string& page) {
  std::vector<CodeBlock> blocks;
  std::istringstream lines(source_text(page));
  std::string previous, last_nonblank;
  bool in_block = false;
  int number = 0;
  for (std::string line; std::getline(lines, line); previous = line) {
    ++number;
    if (line.rfind("```", 0) == 0) {
      if (!in_block) {
        std::smatch m;
        const bool marked = std::regex_match(last_nonblank, m, std::regex(R"(<!-- (.*) -->)"));
        blocks.push_back({page + ":" + std::to_string(number), marked ? m[1].str() : "", {}});
      }
      in_block = !in_block;
      continue;
    }
    if (!line.empty()) last_nonblank = line;
    if (in_block && !line.empty()) {
      auto& commands = blocks.back().commands;
      const bool continued = !commands.empty() && !commands.back().empty() && commands.back().back() == '\\';
      if (continued) {
        commands.back().pop_back();
        commands.back() += line.substr(line.find_first_not_of(' '));
      } else {
        commands.push_back(line);
      }
    } else if (line.rfind("    ", 0) == 0 && previous.empty()) {
      blocks.push_back({page + ":" + std::to_string(number), "an indented block: fence it, so that it can be marked", {}});
    }
  }
  for (auto& block : blocks)
    for (auto& command : block.commands) {
      if (const size_t hash = command.find(" #"); hash != std::string::npos) command.erase(hash);
      command.erase(command.find_last_not_of(' ') + 1);
    }
  return blocks;
}

// Every code block in README.md and docs/ says what checks it, in an HTML
// comment on the line before it:
//   <!-- check: run -->            this test runs each command, in order, in
//                                  one directory, on a small data set and for
//                                  a few steps (only ./build/mnist_ddp lines);
//   <!-- check: ci -->             .ci/run runs each command (with arguments
//                                  that keep it short);
//   <!-- check: test A.B, C.D -->  those tests run the commands: they exist,
//                                  and their sources use every flag shown;
//   <!-- not runnable here: why --> or <!-- not a command: what -->.
// And every script, page or source a page names exists.
TEST(Docs, EveryDocumentedCommandRunsOrSaysWhyNot) {
  std::map<std::string, std::string> test_sources;  // "Suite.Name" -> the file that defines it
  for (const auto& name : files::list_directory(std::string(MNIST_DDP_SOURCE_DIR) + "/tests")) {
    if (name.size() < 4 || name.substr(name.size() - 4) != ".cpp") continue;
    const std::string text = source_text("tests/" + name);
    const std::regex definition(R"(TEST(?:_F)?\((\w+), (\w+)\))");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), definition); it != std::sregex_iterator(); ++it)
      test_sources[(*it)[1].str() + "." + (*it)[2].str()] = text;
  }
  const std::string ci = source_text(".ci/run");
  const std::regex flag(R"(--[a-z][a-z0-9_-]*)");
  test::TempDir data;
  test::write_synthetic_mnist(data.path(), 256, 64);
  std::map<std::string, int> count;
  for (const auto& page : documentation_pages()) {
    for (const auto& block : code_blocks(page)) {
      SCOPED_TRACE(block.where + " <!-- " + block.marker + " -->");
      const std::string kind = block.marker.substr(0, block.marker.find(':'));
      const std::string detail = block.marker.find(": ") == std::string::npos ? "" : block.marker.substr(block.marker.find(": ") + 2);
      ++count[kind];
      if (block.marker == "check: run") {
        test::TempDir cwd;
        for (size_t i = 0; i < block.commands.size(); ++i) {
          const std::string& command = block.commands[i];
          ASSERT_EQ(command.rfind("./build/mnist_ddp ", 0), 0u) << "check: run runs ./build/mnist_ddp lines only: " << command;
          const std::string line = "cd '" + cwd.path() + "' && timeout -k 5 120 " + MNIST_DDP_BINARY +
                                   command.substr(command.find(' ')) + " --data-dir '" + data.path() +
                                   "' --max-steps " + std::to_string(2 * (i + 1)) + " 2>&1";
          int status = -1;
          const std::string out = test::shell(line, &status);
          EXPECT_EQ(status, 0) << command << "\n" << out;
          EXPECT_NE(out.find("Replicas: all"), std::string::npos) << command << "\n" << out;
        }
      } else if (block.marker == "check: ci") {
        for (const auto& command : block.commands)
          EXPECT_NE(ci.find(command), std::string::npos) << ".ci/run does not run: " << command;
      } else if (kind == "check" && detail.rfind("test ", 0) == 0) {
        std::string sources;
        std::istringstream names(detail.substr(5));
        for (std::string name; std::getline(names >> std::ws, name, ',');) {
          ASSERT_TRUE(test_sources.count(name)) << "no test " << name;
          sources += test_sources[name];
        }
        for (const auto& command : block.commands)
          for (auto it = std::sregex_iterator(command.begin(), command.end(), flag); it != std::sregex_iterator(); ++it)
            EXPECT_NE(sources.find(it->str()), std::string::npos) << it->str() << " of '" << command << "' is used by none of: " << detail;
      } else if (kind == "not runnable here" || kind == "not a command") {
        EXPECT_GE(detail.size(), 4u) << "say why";
      } else {
        ADD_FAILURE() << "a code block needs <!-- check: run|ci|test A.B -->, <!-- not runnable here: why --> "
                         "or <!-- not a command: what --> on the line before it";
      }
    }
    const std::string text = source_text(page);
    const std::regex named(R"((?:scripts|tests|docs|data|src|include)/[A-Za-z0-9_./-]*\.(?:sh|py|sbatch|md|hpp|cpp|png)|run_mnist_ddp\.sh)");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), named); it != std::sregex_iterator(); ++it)
      EXPECT_TRUE(files::exists(std::string(MNIST_DDP_SOURCE_DIR) + "/" + it->str())) << page << " names " << it->str() << ", which is not there";
  }
  EXPECT_GE(count["check"], 5) << "the README's commands are no longer marked";
}

}  // namespace
}  // namespace mnist_ddp
