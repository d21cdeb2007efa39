// Paths and directories through POSIX calls.
//
// Why not std::filesystem: LibTorch 2.x's libtorch.so exports its own copy of
// std::filesystem's symbols, built by another compiler, and code linked
// against it may call that copy with this compiler's object layout (a crash
// in remove_all was seen). Nothing in mnist_ddp calls std::filesystem.
#pragma once

#include <string>
#include <vector>

namespace mnist_ddp::files {

// `dir` + "/" + `name`, without doubling a trailing slash.
std::string join(const std::string& dir, const std::string& name);

bool exists(const std::string& path);
bool is_directory(const std::string& path);

// Creates `path` and any missing parents. Throws std::runtime_error naming
// the directory that could not be created and why.
void make_directories(const std::string& path);

// Makes the run's directory `path` (--path) and any missing parents, and
// checks that this process may write there. Throws std::runtime_error
// "--path <path>: <why>".
void make_run_directory(const std::string& path);

// One job's hold on its --path: an exclusive lock on `<dir>/.lock`, taken
// without waiting and held while the object lives; the kernel drops it
// when the holder dies, so a crashed job never blocks the next. The file
// says who holds it.
class DirectoryLock {
 public:
  // Takes the lock for `holder` ("mnist_ddp launcher"). Throws
  // std::runtime_error "--path <dir> is in use by ... (pid N): ..." when
  // another process holds it, or naming why the file cannot be made.
  DirectoryLock(const std::string& dir, const std::string& holder);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

// The names in `dir`, without "." and "..", in no particular order; empty
// when it cannot be read.
std::vector<std::string> list_directory(const std::string& dir);

// Removes a file; a missing one is not an error.
void remove_file(const std::string& path);

// Removes `path` and everything under it, as far as it can; never throws.
void remove_tree(const std::string& path);

}  // namespace mnist_ddp::files
