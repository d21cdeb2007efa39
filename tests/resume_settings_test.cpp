// Resuming under settings other than the checkpoint's: the run goes on
// from the right place or is refused, never trains nothing. Ranks are
// threads of this process, each with its own Trainer (test_util.hpp).
#include <gtest/gtest.h>

#include <spdlog/spdlog.h>

#include "app/train/trainer.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::TempDir;

// Trains `world` ranks with `args` to the end; returns the first rank's
// error, "" when none.
std::string train(int world, const std::vector<std::string>& args) {
  const Options opts = test::parse(args);
  RunContext run;
  run.arguments = opts.arguments;
  const auto level = spdlog::get_level();
  spdlog::set_level(spdlog::level::err);  // every rank would log rank 0's lines
  std::string error;
  try {
    test::run_ranks(world, [&](ProcessGroup& group) { Trainer(opts, run, group).run(); });
  } catch (const std::exception& e) {
    error = e.what();
  }
  spdlog::set_level(level);
  return error;
}

std::vector<std::string> job(const TempDir& dir, std::vector<std::string> extra) {
  std::vector<std::string> args = {"--data-dir", dir / "data", "--path", dir / "out", "--compression", "none",
                                   "--log-interval", "1000", "--batch-size", "32"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// 512 images: 8 steps an epoch on 2 ranks, 4 on 4. Stopped after step 6 on
// 2 ranks, the checkpoint is 6 batches into epoch 0: past the end of the
// epoch as 4 ranks cut it, which used to train nothing, ever.
TEST(ResumeUnderOtherSettings, MoreRanksOrLargerBatchesGoOnFromAsManyImagesOfTheEpoch) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 512, 64);
  for (const std::string batch : {"32", "64"}) {
    SCOPED_TRACE("--batch-size " + batch);
    files::remove_tree(dir / "out");
    ASSERT_EQ(train(2, job(dir, {"--epochs", "2", "--max-steps", "6"})), "");
    const Checkpoint stopped = load_checkpoint(dir / "out/checkpoint");
    ASSERT_EQ(stopped.step, 6);
    ASSERT_EQ(stopped.batch, 6);

    ASSERT_EQ(train(4, job(dir, {"--epochs", "2", "--resume", "auto", "--batch-size", batch})), "");
    const Checkpoint end = load_checkpoint(dir / "out/checkpoint");
    EXPECT_EQ(end.epoch, 2);
    EXPECT_EQ(end.world_size, 4);
    // 384 of epoch 0's images were trained: at 128 a step, 1 step of 4 is
    // left; at 256 a step, none of 2 (the epoch is complete). Then a whole
    // epoch 1.
    const Json summary = test::read_summary(dir / "out");
    ASSERT_EQ(summary.at("epochs").size(), 2u) << summary.dump(2);
    EXPECT_EQ(summary.at("epochs").at(0).at("steps").get<int64_t>(), batch == "32" ? 1 : 0);
    EXPECT_EQ(summary.at("epochs").at(1).at("steps").get<int64_t>(), batch == "32" ? 4 : 2);
    EXPECT_EQ(end.step, 6 + (batch == "32" ? 1 + 4 : 0 + 2));
  }
}

TEST(ResumeUnderOtherSettings, AnotherDatasetIsRefusedAndAnotherSeedTaken) {
  TempDir dir;
  test::write_synthetic_mnist(dir / "data", 256, 64);
  test::copy_tree(dir / "data/MNIST", dir / "data/FashionMNIST");
  ASSERT_EQ(train(2, job(dir, {"--epochs", "1"})), "");
  const std::string error = train(2, job(dir, {"--epochs", "2", "--resume", "auto", "--dataset", "fashion-mnist"}));
  EXPECT_NE(error.find("--dataset fashion-mnist: the checkpoint in " + (dir / "out/checkpoint") +
                       " was trained on mnist"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("start afresh with another --path"), std::string::npos) << error;
  EXPECT_EQ(load_checkpoint(dir / "out/checkpoint").step, 4) << "the refused run left the checkpoint as it was";
  ASSERT_EQ(train(2, job(dir, {"--epochs", "2", "--resume", "auto", "--seed", "5"})), "");
  EXPECT_EQ(load_checkpoint(dir / "out/checkpoint").step, 8);
}

// --resume auto starts afresh only where there is nothing: no directory,
// an empty one, or the leftovers of a first save cut short before its
// manifest. A directory that lost its newest manifest but holds the
// previous one resumes from that; something that is no directory is
// refused, saying so.
TEST(ResumeAuto, StartsAfreshOnlyWhereThereIsNothing) {
  TempDir dir;
  const Options opts = test::parse({"--path", dir / "out", "--resume", "auto"});
  const std::string ckpt = dir / "out/checkpoint";
  EXPECT_EQ(resume_dir(opts), "");
  files::make_directories(ckpt);
  EXPECT_EQ(resume_dir(opts), "");
  test::write_file(ckpt + "/model-1.pt", "half a save", false);
  EXPECT_EQ(resume_dir(opts), "");
  EXPECT_EQ(checkpoint_leftovers(ckpt), std::vector<std::string>{"model-1.pt"});

  Checkpoint c;
  c.model.insert("module.w", torch::ones({2}));
  c.step = 5;
  save_checkpoint(ckpt, c);
  c.step = 6;
  save_checkpoint(ckpt, c);
  files::remove_file(ckpt + "/manifest");
  ASSERT_EQ(resume_dir(opts), ckpt);
  const CheckpointFiles read = read_checkpoint_files(ckpt);
  EXPECT_NE(read.fallback.find("its newest checkpoint has no manifest"), std::string::npos) << read.fallback;
  EXPECT_EQ(parse_checkpoint(read).step, 5);

  files::remove_tree(ckpt);
  test::write_file(ckpt, "a file", false);
  ASSERT_EQ(resume_dir(opts), ckpt);
  try {
    read_checkpoint_files(ckpt);
    ADD_FAILURE() << "read a file as a checkpoint";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(ckpt + " is not a directory holding a checkpoint"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace mnist_ddp
