#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <regex>
#include <sstream>

#include "base/environment.hpp"
#include "app/base/options.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::parse;
using test::usage_error;

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
      // Infinite, not a number, or past what the program can count in.
      {{"--timeout", "inf"}, {"--timeout", "up to 604800", "'inf'"}},
      {{"--timeout", "1e17"}, {"--timeout", "up to 604800", "'1e17'"}},
      {{"--timeout", "nan"}, {"--timeout", "'nan'"}},
      {{"--bucket-cap-mb", "inf"}, {"--bucket-cap-mb", "up to 1048576"}},
      {{"--bucket-cap-mb", "1e300"}, {"--bucket-cap-mb", "up to 1048576"}},
      {{"--lr", "inf"}, {"--lr", "positive number", "'inf'"}},
      {{"--lr", "-inf"}, {"--lr", "positive number"}},
      {{"--momentum", "inf"}, {"--momentum", "'inf'"}},
      {{"--weight-decay", "nan"}, {"--weight-decay", "'nan'"}},
      {{"--min-compression-rate", "inf"}, {"--min-compression-rate", "'inf'"}},
      {{"--orthogonalization-epsilon", "inf"}, {"--orthogonalization-epsilon", "'inf'"}},
      {{"--batch-size", "inf"}, {"--batch-size", "'inf'"}},
      {{"--epochs", "99999999999"}, {"--epochs", "'99999999999'"}},
      {{"--seed", "-1"}, {"--seed", "0..18446744073709551615"}},
      {{"--powersgd-seed", "-1"}, {"--powersgd-seed", "0..18446744073709551615"}},
      // Past what the float32 math, or the store's whole seconds, can take.
      {{"--lr", "1e39"}, {"--lr", "up to 3.4e38", "'1e39'"}},
      {{"--wd", "1e39"}, {"--weight-decay", "up to 3.4e38"}},
      {{"--momentum", "1e39"}, {"--momentum", "up to 3.4e38"}},
      {{"--orthogonalization-epsilon", "1e39"}, {"--orthogonalization-epsilon", "up to 3.4e38"}},
      {{"--timeout", "0.99"}, {"--timeout", "from 1", "'0.99'"}},
      // What a manifest records line by line must read back.
      {{"--path", "/tmp/x/odd\nnewline"}, {"--path", "without newlines"}},
      {{"--resume", "ckpt\r"}, {"--resume", "without newlines"}},
      {{"--data-dir", "data\t"}, {"--data-dir", "without newlines"}},
  };
  for (const auto& c : cases) {
    const std::string msg = usage_error(c.args);
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const auto& piece : c.expected) EXPECT_NE(msg.find(piece), std::string::npos) << "'" << msg << "' lacks '" << piece << "'";
  }
}

// Issue 48: an integer past what its flag holds is refused in one line,
// never clamped (CLI11 would make a seed 2^64-1 and a step count 2^63-1);
// the largest value is taken as given, and the text is read as decimal.
TEST(Options, EveryIntegerFlagRefusesWhatItCannotHold) {
  const std::string huge = "99999999999999999999";
  const std::vector<std::pair<std::string, std::string>> flags = {
      {"--batch-size", "2147483647"},       {"--test-batch-size", "2147483647"},   {"--epochs", "2147483647"},
      {"--workers", "2147483647"},          {"--log-interval", "2147483647"},      {"--gpus", "2147483647"},
      {"--nproc", "2147483647"},            {"--nnodes", "2147483647"},            {"--max-restarts", "2147483647"},
      {"--checkpoint-every", "2147483647"}, {"--accumulate", "1024"},              {"--seed", "18446744073709551615"},
      {"--powersgd-seed", "18446744073709551615"}, {"--max-steps", "9223372036854775807"},
      {"--checkpoint-steps", "9223372036854775807"}, {"--powersgd-rank", "9223372036854775807"},
      {"--start-powersgd-iter", "9223372036854775807"}, {"--node-rank", "2147483647"}, {"--master-port", "65535"}};
  for (const auto& [flag, largest] : flags) {
    SCOPED_TRACE(flag);
    for (const std::string& value : {huge, "-" + huge, largest + "0"}) {
      const std::string msg = usage_error({flag, value});
      EXPECT_EQ(msg.rfind(flag + ": must be ", 0), 0u) << msg;
      EXPECT_NE(msg.find("got '" + value + "'"), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
    // The next integer up: refused, saying how far the flag goes.
    std::string next = largest;
    for (size_t i = next.size(); i-- > 0;) {
      if (next[i] != '9') {
        ++next[i];
        break;
      }
      next[i] = '0';
      if (i == 0) next.insert(0, "1");
    }
    EXPECT_NE(usage_error({flag, next}).find(largest), std::string::npos) << usage_error({flag, next});
    if (flag != "--node-rank") {  // below --nnodes
      EXPECT_EQ(usage_error({flag, largest}), "(accepted)");
    }
  }
  const Options o = parse({"--seed", "18446744073709551615", "--max-steps", "9223372036854775807",
                           "--powersgd-seed", "010", "--checkpoint-steps", "+7", "--epochs", "010",
                           "--master-port", "010"});
  EXPECT_EQ(o.seed, 18446744073709551615u);
  EXPECT_EQ(o.max_steps, 9223372036854775807);
  EXPECT_EQ(o.powersgd.random_seed(), 10u);  // decimal, as argparse's int() reads it: not octal
  EXPECT_EQ(o.checkpoint_steps, 7);
  EXPECT_EQ(o.epochs, 10);
  EXPECT_EQ(o.master_port, 10);  // as MASTER_PORT=010 reads it
  for (const std::string value : {"1.5", "0x10", "1e3", "+-3", " 5", ""})
    EXPECT_NE(usage_error({"--max-steps", value}).find("--max-steps: must be an integer >= 0, got '" + value + "'"),
              std::string::npos)
        << usage_error({"--max-steps", value});
  // mnist_ddp run's flags too.
  const std::vector<std::string> run = {"mnist_ddp", "run", "--nproc", huge, "--", "true"};
  try {
    parse_run_command(run, Environment{});
    ADD_FAILURE() << "run --nproc " << huge << " was accepted";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), "run: --nproc: must be a positive integer up to 2147483647, got '" + huge + "'");
  }
}

TEST(Options, PowerSgdKnobs) {
  const Options d = parse({});
  EXPECT_EQ(d.powersgd.matrix_approximation_rank(), 2);
  EXPECT_EQ(d.powersgd.start_powersgd_iter(), 1000);
  EXPECT_DOUBLE_EQ(d.powersgd.min_compression_rate(), 2);
  EXPECT_TRUE(d.powersgd.use_error_feedback());
  EXPECT_TRUE(d.powersgd.warm_start());
  EXPECT_DOUBLE_EQ(d.powersgd.orthogonalization_epsilon(), 0);
  EXPECT_EQ(d.powersgd.random_seed(), 0u);
  const Options o = parse({"--powersgd-rank", "4", "--start-powersgd-iter", "0", "--no-error-feedback",
                           "--no-warm-start", "--orthogonalization-epsilon", "1e-8", "--powersgd-seed", "7",
                           "--min-compression-rate", "3"});
  EXPECT_EQ(o.powersgd.matrix_approximation_rank(), 4);
  EXPECT_EQ(o.powersgd.start_powersgd_iter(), 0);
  EXPECT_FALSE(o.powersgd.use_error_feedback());
  EXPECT_FALSE(o.powersgd.warm_start());
  EXPECT_DOUBLE_EQ(o.powersgd.orthogonalization_epsilon(), 1e-8);
  EXPECT_EQ(o.powersgd.random_seed(), 7u);
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

TEST(Options, SeveralNodesNeedAPortAndAValidNodeRank) {
  EXPECT_EQ(parse({"--nnodes", "2"}).master_port, 29500);
  EXPECT_NE(usage_error({"--nnodes", "2", "--node-rank", "2"}).find("--node-rank 2: must be below --nnodes 2"),
            std::string::npos);
  EXPECT_NE(usage_error({"--nnodes", "2", "--master-port", "0"}).find("single node only"), std::string::npos);
  const auto settings = shared_settings(parse({"--nnodes", "2", "--node-rank", "1", "--nproc", "3"}).arguments);
  std::map<std::string, std::string> shared(settings.begin(), settings.end());
  EXPECT_EQ(shared.count("node_rank") + shared.count("nproc") + shared.count("path"), 0u);
  EXPECT_EQ(shared.at("nnodes"), "2");
  EXPECT_EQ(shared.at("compression"), "powersgd_fp16");
}

// $MASTER_ADDR and $MASTER_PORT stand in for the flags that are not given.
TEST(Options, TheEnvironmentGivesTheStoresAddressAndPort) {
  const Environment env = environment_from({"MASTER_ADDR=10.0.0.9", "MASTER_PORT=4242"});
  const std::vector<const char*> argv = {"mnist_ddp", "--master-port", "5000"};
  const Options o = *parse_options(static_cast<int>(argv.size()), argv.data(), env);
  EXPECT_EQ(o.master_addr, "10.0.0.9");
  EXPECT_EQ(o.master_port, 5000);  // the flag wins
  const std::vector<const char*> bare = {"mnist_ddp"};
  EXPECT_EQ(parse_options(1, bare.data(), env)->master_port, 4242);
  EXPECT_THROW(parse_options(1, bare.data(), environment_from({"MASTER_PORT=http"})), UsageError);
}

}  // namespace
}  // namespace mnist_ddp
