#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include "app/train/checkpoint.hpp"
#include "app/base/files.hpp"
#include "app/train/model.hpp"
#include "app/train/resume.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::TempDir;

Checkpoint sample(int64_t step) {
  torch::manual_seed(step);
  Checkpoint c;
  c.epoch = step / 10;
  c.batch = step % 10;
  c.step = step;
  c.best_accuracy = 97.123456789012345;
  c.world_size = 3;
  c.compression = "powersgd_fp16";
  c.arguments = {{"batch_size", "32"}, {"path", "./a dir/with spaces/"}};
  c.model.insert("module.fc.weight", torch::randn({4, 3}));
  c.model.insert("module.bn.num_batches_tracked", torch::tensor(step));
  c.training.insert("optimizer/momentum/module.fc.weight", torch::randn({4, 3}));
  c.training.insert("rank/2/rng/cpu", torch::randint(0, 255, {5056}, torch::kUInt8));
  return c;
}

void expect_same(const Checkpoint& a, const Checkpoint& b) {
  EXPECT_EQ(a.epoch, b.epoch);
  EXPECT_EQ(a.batch, b.batch);
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.best_accuracy, b.best_accuracy);  // bit-exact round trip
  EXPECT_EQ(a.world_size, b.world_size);
  EXPECT_EQ(a.compression, b.compression);
  EXPECT_EQ(a.arguments, b.arguments);
  for (const auto* dicts : {&a.model, &a.training}) {
    const auto& other = dicts == &a.model ? b.model : b.training;
    ASSERT_EQ(dicts->size(), other.size());
    for (const auto& item : *dicts) EXPECT_TRUE(torch::equal(item.value(), other.at(item.key()))) << item.key();
  }
}

std::string hex32(uint32_t v) {
  char text[16];
  std::snprintf(text, sizeof text, "%08x", v);
  return text;
}

std::string checkpoint_error(const std::string& dir) {
  try {
    load_checkpoint(dir);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "(loaded)";
}

std::string file_named(const std::string& dir, const std::string& role) {
  std::ifstream in(dir + "/manifest");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("file " + role + " ", 0) == 0) return dir + "/" + line.substr(6 + role.size()).substr(0, line.substr(6 + role.size()).find(' '));
  return "";
}

TEST(Checkpoint, RoundTripsEveryField) {
  TempDir dir;
  EXPECT_FALSE(has_checkpoint(dir / "ckpt"));
  save_checkpoint(dir / "ckpt", sample(27));
  EXPECT_TRUE(has_checkpoint(dir / "ckpt"));
  expect_same(load_checkpoint(dir / "ckpt"), sample(27));
}

// A checkpoint of 2 ranks after 10 steps of 2 micro-batches of 16 images
// a rank (640 images of its epoch) goes on, under other shapes of a step,
// past as many images, rounded up to a whole step.
TEST(Checkpoint, AResumedBatchCountsEveryMicroBatchsImages) {
  Checkpoint c;
  c.batch = 10;
  c.world_size = 2;
  c.arguments = {{"batch_size", "16"}, {"accumulate", "2"}};
  EXPECT_EQ(resumed_batch(c, 16, 2, 2), 10);  // as written
  EXPECT_EQ(resumed_batch(c, 32, 2), 10);     // one batch of the same 32 images
  EXPECT_EQ(resumed_batch(c, 16, 2), 20);
  EXPECT_EQ(resumed_batch(c, 16, 4, 2), 5);
  c.arguments = {{"batch_size", "32"}};  // written by a run without --accumulate
  EXPECT_EQ(resumed_batch(c, 16, 2, 4), 5);
  EXPECT_EQ(resumed_batch(c, 24, 2, 2), 7);  // 640 / 96 = 6.7
}

TEST(Checkpoint, ASaveInterruptedAnywhereLeavesThePreviousOneLoadable) {
  TempDir dir;
  const std::string ckpt = dir / "ckpt";
  save_checkpoint(ckpt, sample(10));
  // Count the file operations of one save, then interrupt a save after each.
  std::vector<std::string> points;
  save_checkpoint(dir / "probe", sample(11), [&](const std::string& what) { points.push_back(what); });
  ASSERT_GE(points.size(), 4u);
  for (size_t k = 0; k < points.size(); ++k) {
    struct Interrupted {};
    size_t seen = 0;
    try {
      save_checkpoint(ckpt, sample(20 + static_cast<int64_t>(k)), [&](const std::string&) {
        if (seen++ == k) throw Interrupted{};
      });
    } catch (const Interrupted&) {
    }
    const Checkpoint loaded = load_checkpoint(ckpt);
    // Before the manifest is renamed the old checkpoint stands, after it the new one.
    const bool manifest_written = k >= 2;
    expect_same(loaded, manifest_written ? sample(20 + static_cast<int64_t>(k)) : sample(10));
    save_checkpoint(ckpt, sample(10));  // back to the first one for the next round
  }
  // No leftovers: the newest and the previous manifest, and the two files each names.
  int regular = 0;
  for (const auto& name : files::list_directory(ckpt)) regular += test::is_regular_file(files::join(ckpt, name));
  EXPECT_EQ(regular, 6);
}

// The checkpoint before the newest stays until the next save, and stands in
// for a newest one that no longer verifies, saying why.
TEST(Checkpoint, ThePreviousCheckpointStandsInForADamagedNewestOne) {
  TempDir dir;
  const std::string ckpt = dir / "ckpt";
  save_checkpoint(ckpt, sample(1));
  const std::string first_model = file_named(ckpt, "model");
  save_checkpoint(ckpt, sample(2));
  EXPECT_TRUE(files::exists(first_model));
  save_checkpoint(ckpt, sample(3));
  EXPECT_FALSE(files::exists(first_model)) << "only the last two checkpoints are kept";
  expect_same(load_checkpoint(ckpt), sample(3));
  EXPECT_TRUE(read_checkpoint_files(ckpt).fallback.empty());

  const std::string model = file_named(ckpt, "model");
  test::resize_file(model, test::file_size(model) / 2);
  const CheckpointFiles read = read_checkpoint_files(ckpt);
  EXPECT_NE(read.fallback.find(model + " is truncated"), std::string::npos) << read.fallback;
  EXPECT_NE(read.fallback.find("using the checkpoint before it"), std::string::npos) << read.fallback;
  expect_same(parse_checkpoint(read), sample(2));
}

TEST(Checkpoint, DamagedOrForeignCheckpointsSayWhatIsWrong) {
  TempDir dir;
  const std::string ckpt = dir / "ckpt";
  EXPECT_NE(checkpoint_error(dir / "nowhere").find("is not a directory holding a checkpoint"), std::string::npos);
  files::make_directories(ckpt);
  EXPECT_NE(checkpoint_error(ckpt).find("no checkpoint in"), std::string::npos);

  save_checkpoint(ckpt, sample(5));
  const std::string training = file_named(ckpt, "training");
  const auto size = test::file_size(training);
  test::resize_file(training, size - 100);
  auto msg = checkpoint_error(ckpt);
  EXPECT_NE(msg.find(training + " is truncated (" + std::to_string(size - 100) + " of " + std::to_string(size)),
            std::string::npos)
      << msg;

  save_checkpoint(ckpt, sample(6));
  const std::string model = file_named(ckpt, "model");
  {
    std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(test::file_size(model) / 2));
    f.put('\x7f');
  }
  msg = checkpoint_error(ckpt);
  EXPECT_NE(msg.find(model + " is corrupt"), std::string::npos) << msg;

  save_checkpoint(ckpt, sample(7));
  files::remove_file(file_named(ckpt, "model"));
  EXPECT_NE(checkpoint_error(ckpt).find("is missing"), std::string::npos);

  test::write_file(ckpt + "/manifest", "{\"not\": \"ours\"}\n", false);
  EXPECT_NE(checkpoint_error(ckpt).find("is not a mnist_ddp checkpoint manifest"), std::string::npos);
}

// Any damage to the newest manifest (a CRC field that is no number, a
// manifest cut mid-line, one digit flipped, none at all) falls back to the
// previous checkpoint, saying what was wrong; never a parse error, never a
// position read wrong.
TEST(Checkpoint, ADamagedManifestFallsBackToThePreviousCheckpointSayingWhy) {
  TempDir dir;
  const std::string ckpt = dir / "ckpt";
  save_checkpoint(ckpt, sample(31));
  save_checkpoint(ckpt, sample(32));
  const std::string manifest = test::read_text(ckpt + "/manifest");
  ASSERT_NE(manifest.find("\nbatch 2\n"), std::string::npos) << manifest;
  std::string garbage_crc = manifest;
  const size_t crc_at = garbage_crc.find(' ', garbage_crc.find(' ', garbage_crc.find(' ', garbage_crc.find("file model ") + 5) + 1) + 1) + 1;
  garbage_crc.replace(crc_at, 8, "zz!?zz!?");
  std::string flipped = manifest;
  flipped.replace(flipped.find("\nbatch 2\n"), 9, "\nbatch 7\n");
  // Forged with a checksum made anew, or as format 1 (no checksum): the
  // training file's own copy of its manifest says otherwise.
  const std::string forged_body = flipped.substr(0, flipped.rfind("checksum "));
  const std::string resealed = forged_body + "checksum " + hex32(crc32_of(forged_body.data(), forged_body.size())) + "\n";
  const std::string downgraded = "mnist_ddp checkpoint 1" + forged_body.substr(forged_body.find('\n'));
  const std::vector<std::tuple<std::string, std::string, std::string>> damages = {
      {"a CRC32 that is no number", garbage_crc, "its checksum does not match"},
      {"cut mid-line", manifest.substr(0, manifest.find("\nstep ") + 4), "cut short"},
      {"one digit flipped", flipped, "its checksum does not match its contents"},
      {"empty", "", "not a mnist_ddp checkpoint manifest"},
      {"a digit flipped and sealed anew", resealed, "it says 'batch 7' where its training file "},
      {"a digit flipped as format 1", downgraded, "it says format 1, but its training file "},
  };
  for (const auto& [what, text, why] : damages) {
    SCOPED_TRACE(what);
    test::write_file(ckpt + "/manifest", text, false);
    CheckpointFiles read;
    ASSERT_NO_THROW(read = read_checkpoint_files(ckpt));
    EXPECT_NE(read.fallback.find(ckpt + "/manifest"), std::string::npos) << read.fallback;
    EXPECT_NE(read.fallback.find(why), std::string::npos) << read.fallback;
    EXPECT_NE(read.fallback.find("using the checkpoint before it"), std::string::npos) << read.fallback;
    expect_same(parse_checkpoint(read), sample(31));
  }
  // A manifest of format 1 over files of its time (no manifest inside) still reads.
  const std::string old = dir / "old";
  save_checkpoint(old, sample(33));
  const std::string training = file_named(old, "training");
  const std::vector<char> plain = serialize(sample(33).training);
  test::write_file(training, std::string(plain.data(), plain.size()), false);
  std::string format1 = test::read_text(old + "/manifest");
  format1 = "mnist_ddp checkpoint 1" + format1.substr(format1.find('\n'), format1.rfind("checksum ") - format1.find('\n'));
  const std::string entry = "file training " + training.substr(old.size() + 1) + " ";
  const size_t size_at = format1.find(entry) + entry.size();
  format1.replace(size_at, format1.find('\n', size_at) - size_at,
                  std::to_string(plain.size()) + " " + hex32(crc32_of(plain.data(), plain.size())));
  test::write_file(old + "/manifest", format1, false);
  expect_same(load_checkpoint(old), sample(33));
  files::remove_file(ckpt + "/manifest");
  const CheckpointFiles read = read_checkpoint_files(ckpt);
  EXPECT_NE(read.fallback.find("has no manifest"), std::string::npos) << read.fallback;
  expect_same(parse_checkpoint(read), sample(31));
}

// A newest checkpoint that is damaged or has lost its manifest is never
// pushed into manifest.previous, and its numbers are never reused: the
// intact previous checkpoint survives every later save until a new one
// has taken its place.
TEST(Checkpoint, ADamagedNewestNeverPushesOutTheIntactPreviousOne) {
  TempDir dir;
  const std::string ckpt = dir / "ckpt";
  for (const std::string damage : {"manifest removed", "model corrupt"}) {
    SCOPED_TRACE(damage);
    files::remove_tree(ckpt);
    save_checkpoint(ckpt, sample(41));
    save_checkpoint(ckpt, sample(42));
    if (damage == "manifest removed") {
      files::remove_file(ckpt + "/manifest");
    } else {
      const std::string model = file_named(ckpt, "model");
      test::write_file(model, "not the model", false);
    }
    expect_same(load_checkpoint(ckpt), sample(41));  // the run resumes from the previous one...
    save_checkpoint(ckpt, sample(43));               // ...and saves its next
    expect_same(load_checkpoint(ckpt), sample(43));
    test::write_file(ckpt + "/manifest", "damaged", false);
    SCOPED_TRACE("the intact checkpoint before stays the previous one");
    expect_same(load_checkpoint(ckpt), sample(41));
  }
}

// Nothing a save writes or removes goes through a symbolic link planted in
// the checkpoint directory, at a data file's name, a manifest's, or the
// temporary name older versions used (<file>.tmp.<pid>); nor is a checkpoint
// directory that is itself a link written into.
TEST(Checkpoint, ASaveFollowsNoLinkPlantedInItsDirectory) {
  TempDir dir;
  const std::string ckpt = dir / "ckpt", victim = dir / "victim";
  files::make_directories(ckpt);
  test::write_file(victim, "precious", false);
  const std::string pid = std::to_string(getpid());
  for (const std::string& name : std::vector<std::string>{"manifest", "manifest.previous", "model-1.pt", "training-1.pt", "model-1.pt.tmp." + pid,
                                 "training-1.pt.tmp." + pid, "manifest.tmp." + pid})
    ASSERT_EQ(symlink(victim.c_str(), (ckpt + "/" + name).c_str()), 0) << name;
  save_checkpoint(ckpt, sample(51));
  save_checkpoint(ckpt, sample(52));
  EXPECT_EQ(test::read_text(victim), "precious");
  expect_same(load_checkpoint(ckpt), sample(52));
  for (const auto& name : files::list_directory(ckpt)) EXPECT_EQ(test::read_symlink(ckpt + "/" + name), "") << name;

  files::make_directories(dir / "elsewhere");
  ASSERT_EQ(symlink((dir / "elsewhere").c_str(), (dir / "linked").c_str()), 0);
  try {
    save_checkpoint(dir / "linked", sample(53));
    ADD_FAILURE() << "wrote through a link";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("symbolic link"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(files::list_directory(dir / "elsewhere").empty());
}

std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> names = files::list_directory(dir);
  std::sort(names.begin(), names.end());
  return names;
}

// Issue 43: a folder that lost both manifests. The newest pair of files
// whose contents verify is resumed from, saying so; a run of another
// lineage saving there deletes none of them; files that carry no manifest
// of their own (written before training files did) are refused in one
// line that names them; a first save cut short is told apart, and so are
// a run's and its restart's (issue 55).
TEST(Checkpoint, FilesWithoutAManifestAreRecoveredOrRefusedAndNeverDeleted) {
  TempDir dir;
  const std::string ckpt = dir / "checkpoint";
  for (int64_t step : {101, 102, 103, 104}) {
    Checkpoint c = sample(step);
    c.lineage = "0a0a0a0a";
    save_checkpoint(ckpt, c);
  }
  files::remove_file(ckpt + "/manifest");
  files::remove_file(ckpt + "/manifest.previous");
  const std::vector<std::string> before = listing(ckpt);
  EXPECT_EQ(before, (std::vector<std::string>{"model-3-0a0a0a0a.pt", "model-4-0a0a0a0a.pt", "training-3-0a0a0a0a.pt",
                                              "training-4-0a0a0a0a.pt"}));
  // The newest pair damaged: the one before it.
  test::resize_file(ckpt + "/training-4-0a0a0a0a.pt", test::file_size(ckpt + "/training-4-0a0a0a0a.pt") - 7);
  const CheckpointFiles read = read_checkpoint_files(ckpt);
  EXPECT_NE(read.fallback.find(ckpt + " has no manifest: resuming from model-3-0a0a0a0a.pt and training-3-0a0a0a0a.pt, "
                               "the newest pair of its files whose contents verify (step 103)"),
            std::string::npos)
      << read.fallback;
  const Checkpoint recovered = parse_checkpoint(read);
  expect_same(recovered, sample(103));
  EXPECT_EQ(recovered.lineage, "") << "a recovered pair's lineage is not taken on";
  EXPECT_EQ(resume_dir(test::parse({"--path", dir.path(), "--resume", "auto"})), ckpt)
      << "files to recover are no fresh start";

  // Another lineage saves beside them twice: not one of them goes.
  for (int64_t step : {1, 2}) {
    Checkpoint c = sample(step);
    c.lineage = "0b0b0b0b";
    save_checkpoint(ckpt, c);
  }
  for (const std::string& name : before) EXPECT_TRUE(files::exists(ckpt + "/" + name)) << name << " was deleted";

  // Files of no manifest of their own: refused, naming them and the ways out.
  const std::string old = dir / "old";
  files::make_directories(old);
  const Checkpoint c = sample(7);
  test::write_file(old + "/model-103.pt", std::string(serialize(c.model).data(), serialize(c.model).size()), false);
  test::write_file(old + "/training-103.pt", std::string(serialize(c.training).data(), serialize(c.training).size()), false);
  test::write_file(old + "/model-104.pt", "x", false);
  EXPECT_EQ(checkpoint_error(old),
            "no checkpoint in " + old + ": it has no manifest, and no pair of its files model-103.pt, model-104.pt and "
            "1 more verifies: nothing resumes from them and nothing deletes them; move them away, or start afresh "
            "beside them with --resume never");
  EXPECT_FALSE(first_saves_cut_short(old));

  // A first save cut short, before its training file or before its
  // manifest: nothing to resume, a fresh start, said as such.
  const std::string first = dir / "first";
  save_checkpoint(first, sample(1));
  files::remove_file(first + "/manifest");
  ASSERT_TRUE(first_saves_cut_short(first));
  EXPECT_EQ(first_saves_cut_short(first)->size(), 2u);
  EXPECT_NE(checkpoint_error(first).find("(a first save cut short before its manifest)"), std::string::npos)
      << checkpoint_error(first);

  // A run and its restart each cut short in their first save: a lone file
  // of each, of generations 1 and 2; then a third run's lone model file
  // above them. Still nothing saved, and a fresh start.
  const std::string again = dir / "again/checkpoint";
  files::make_directories(again);
  const std::vector<char> model = serialize(sample(1).model);
  test::write_file(again + "/model-1-0c0c0c0c.pt", std::string(model.data(), model.size()), false);
  Checkpoint restart = sample(1);
  restart.lineage = "0d0d0d0d";
  save_checkpoint(again, restart);
  for (const char* name : {"manifest", "model-2-0d0d0d0d.pt"}) files::remove_file(again + "/" + name);
  ASSERT_EQ(listing(again), (std::vector<std::string>{"model-1-0c0c0c0c.pt", "training-2-0d0d0d0d.pt"}));
  ASSERT_TRUE(first_saves_cut_short(again)) << checkpoint_error(again);
  test::write_file(again + "/model-3-0e0e0e0e.pt", std::string(model.data(), model.size()), false);
  ASSERT_TRUE(first_saves_cut_short(again)) << checkpoint_error(again);
  EXPECT_EQ(resume_dir(test::parse({"--path", dir / "again", "--resume", "auto"})), "");
}

// A save that fails removes the files it wrote; a save removes its own
// lineage's leftovers, and nothing of another's.
TEST(Checkpoint, AFailedSaveLeavesNothingAndASaveRemovesOnlyItsOwnLeftovers) {
  TempDir dir;
  const std::string ckpt = dir / "ckpt";
  Checkpoint c = sample(5);
  c.lineage = "0c0c0c0c";
  save_checkpoint(ckpt, c);
  const std::vector<std::string> saved = listing(ckpt);
  struct DiskFull {};
  c.step = 6;
  EXPECT_THROW(save_checkpoint(ckpt, c, [](const std::string& what) {
                 if (what.rfind("wrote training", 0) == 0) throw DiskFull{};
               }),
               DiskFull);
  EXPECT_EQ(listing(ckpt), saved) << "the failed save's model and training files stay";
  EXPECT_EQ(load_checkpoint(ckpt).step, 5);

  test::write_file(ckpt + "/model-40-0c0c0c0c.pt", "ours, cut short", false);
  test::write_file(ckpt + "/.training-41-0c0c0c0c.pt.tmp.1f2e3d4c", "ours, half written", false);
  test::write_file(ckpt + "/model-40-0d0d0d0d.pt", "another run's", false);
  test::write_file(ckpt + "/.model-41-0d0d0d0d.pt.tmp.1f2e3d4c", "another run's", false);
  c.step = 7;
  save_checkpoint(ckpt, c);
  EXPECT_FALSE(files::exists(ckpt + "/model-40-0c0c0c0c.pt"));
  EXPECT_FALSE(files::exists(ckpt + "/.training-41-0c0c0c0c.pt.tmp.1f2e3d4c"));
  EXPECT_TRUE(files::exists(ckpt + "/model-40-0d0d0d0d.pt"));
  EXPECT_TRUE(files::exists(ckpt + "/.model-41-0d0d0d0d.pt.tmp.1f2e3d4c"));
  EXPECT_EQ(load_checkpoint(ckpt).step, 7);
  EXPECT_EQ(load_checkpoint(ckpt).lineage, "0c0c0c0c");
}

TEST(Checkpoint, AnotherModelIsRefusedByName) {
  Net net;
  TensorDict state = state_dict(*net);
  EXPECT_NO_THROW(load_state_dict(*net, state, "", "x"));
  TensorDict prefixed;
  for (const auto& item : state) prefixed.insert("module." + item.key(), item.value());
  EXPECT_NO_THROW(load_state_dict(*net, prefixed, "module.", "x"));

  TensorDict wrong_shape = state.copy();
  wrong_shape.insert_or_assign("fc2.weight", torch::zeros({11, 128}));
  try {
    load_state_dict(*net, wrong_shape, "", "checkpoint c");
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint c holds a different model: fc2.weight is [11, 128]"),
              std::string::npos)
        << e.what();
  }
  TensorDict missing = state.copy();
  EXPECT_EQ(missing.erase("bn1.running_var"), 1u);
  EXPECT_THROW(load_state_dict(*net, missing, "", "c"), CheckpointError);
}

}  // namespace
}  // namespace mnist_ddp
