// The run's directory as a hostile neighbour leaves it: another user's
// directory, links planted where the run writes.
#include <gtest/gtest.h>

#include <unistd.h>

#include "app/base/files.hpp"
#include "test_util.hpp"

namespace mnist_ddp {
namespace {

using test::TempDir;

// The message a --path is refused with, or "(accepted)".
std::string refusal(const std::string& path) {
  try {
    files::RunDirectory dir(path);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(accepted)";
}

constexpr uid_t kNobody = 65534;

TEST(RunDirectory, AnotherUsersDirectoryOrLinkIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to make a directory of another user";
  TempDir dir;
  const std::string theirs = dir / "theirs";
  files::make_directories(theirs);
  ASSERT_EQ(chown(theirs.c_str(), kNobody, kNobody), 0);
  std::string msg = refusal(theirs);
  EXPECT_NE(msg.find("--path " + theirs + ": it belongs to user"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(uid 65534)"), std::string::npos) << msg;
  // Their link to a directory of ours is theirs too.
  files::make_directories(dir / "ours");
  ASSERT_EQ(symlink((dir / "ours").c_str(), (dir / "their_link").c_str()), 0);
  ASSERT_EQ(lchown((dir / "their_link").c_str(), kNobody, kNobody), 0);
  msg = refusal(dir / "their_link");
  EXPECT_NE(msg.find("a symbolic link that belongs to user"), std::string::npos) << msg;
  // Our own link to our own directory is ours.
  ASSERT_EQ(symlink((dir / "ours").c_str(), (dir / "our_link").c_str()), 0);
  EXPECT_EQ(refusal(dir / "our_link"), "(accepted)");
}

TEST(RunDirectory, ALinkWhereTheRunWritesIsRefusedAndNeverFollowed) {
  TempDir dir;
  const std::string victim = dir / "victim";
  test::write_file(victim, "precious", false);
  for (const std::string name : {"mnist_train.log", "metrics.csv", "summary.json", "mnist_model.pt", "checkpoint"}) {
    SCOPED_TRACE(name);
    const std::string path = dir / ("run_" + name);
    files::make_directories(path);
    ASSERT_EQ(symlink(victim.c_str(), (path + "/" + name).c_str()), 0);
    const std::string msg = refusal(path);
    EXPECT_NE(msg.find("--path " + path + ": " + name + " is a symbolic link"), std::string::npos) << msg;
  }
  // Planted after the check, a link is still not followed: a write replaces
  // it, an append and a read refuse it.
  const std::string path = dir / "run";
  files::RunDirectory run(path);
  ASSERT_EQ(symlink(victim.c_str(), (path + "/mnist_model.pt").c_str()), 0);
  ASSERT_EQ(symlink(victim.c_str(), (path + "/mnist_train.log").c_str()), 0);
  run.write_atomically("mnist_model.pt", {'n', 'e', 'w'});
  EXPECT_THROW(run.append("mnist_train.log"), std::runtime_error);
  EXPECT_THROW(run.read("mnist_train.log"), std::runtime_error);
  EXPECT_EQ(test::read_text(victim), "precious");
  EXPECT_EQ(test::read_text(path + "/mnist_model.pt"), "new");
  EXPECT_EQ(test::read_symlink(path + "/mnist_model.pt"), "");
  for (const auto& name : files::list_directory(path))
    EXPECT_EQ(name.find(".tmp."), std::string::npos) << "a temporary file was left: " << name;
}

}  // namespace
}  // namespace mnist_ddp
