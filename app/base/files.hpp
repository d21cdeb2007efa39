// Paths and directories through POSIX calls.
//
// Why not std::filesystem: LibTorch 2.x's libtorch.so exports its own copy of
// std::filesystem's symbols, built by another compiler, and code linked
// against it may call that copy with this compiler's object layout (a crash
// in remove_all was seen). Nothing in mnist_ddp calls std::filesystem.
//
// What a run writes goes through a Directory: opened once, every file in it
// opened relative to its descriptor and never through a symbolic link
// (O_NOFOLLOW, the *at calls), new files created exclusively under names
// nobody can guess. So a link planted in --path, or in its checkpoint
// directory, redirects no write and no removal.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace mnist_ddp::files {

// `dir` + "/" + `name`, without doubling a trailing slash.
std::string join(const std::string& dir, const std::string& name);

bool exists(const std::string& path);
bool is_directory(const std::string& path);

// Creates `path` and any missing parents. Throws std::runtime_error naming
// the directory that could not be created and why.
void make_directories(const std::string& path);

// A file descriptor this object owns: closed on destruction, moved not
// copied; -1 for none.
class OwnedFd {
 public:
  OwnedFd() = default;
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  OwnedFd& operator=(OwnedFd&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  ~OwnedFd();
  int get() const { return fd_; }

 private:
  int fd_ = -1;
};

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

 private:
  OwnedFd fd_;  // closing it drops the lock
};

// The names in `dir`, without "." and "..", in no particular order; empty
// when it cannot be read.
std::vector<std::string> list_directory(const std::string& dir);

// Removes a file; a missing one is not an error.
void remove_file(const std::string& path);

// Removes `path` and everything under it, as far as it can; never throws.
void remove_tree(const std::string& path);

// A file open for appending; closes on destruction. Move-only.
class AppendFile {
 public:
  AppendFile() = default;
  AppendFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  // Writes all of `text`. Throws std::runtime_error naming the file.
  void write(const std::string& text);
  int fd() const { return fd_.get(); }

 private:
  OwnedFd fd_;
  std::string path_;
};

// A directory held open by its descriptor. Every call names a file directly
// in it (no '/'), never follows a symbolic link there, and throws
// std::runtime_error naming the file and why. Move-only; the calls may be
// made from any thread.
class Directory {
 public:
  Directory() = default;

  // Opens the directory `path` to read from it (a link the caller names is
  // followed).
  static Directory open(const std::string& path);
  // Opens the directory `path` to write into it, making it (and its
  // parents) when `create`. Its last component must not be a symbolic link,
  // and it must belong to this process's user.
  static Directory open_own(const std::string& path, bool create);

  const std::string& path() const { return path_; }
  std::string path_of(const std::string& name) const { return join(path_, name); }
  bool valid() const { return fd_.get() >= 0; }

  // Whether `name` exists (a dangling link counts), and whether it is a
  // symbolic link.
  bool has(const std::string& name) const;
  bool is_link(const std::string& name) const;
  // The whole of `name`.
  std::vector<char> read(const std::string& name) const;
  // Writes `bytes` to a new file of an unguessable name beside `name`,
  // flushes it to disk and renames it over `name` (a link there is
  // replaced, not followed).
  void write_atomically(const std::string& name, const std::vector<char>& bytes) const;
  // Opens `name` for appending, creating it.
  AppendFile append(const std::string& name) const;
  // Removes `name` (a link, not its target); a missing one is not an error.
  void remove(const std::string& name) const;
  // Renames `from` to `to`, which must not exist yet.
  void rename(const std::string& from, const std::string& to) const;
  // The names in it, without "." and "..".
  std::vector<std::string> list() const;
  // Flushes the directory's entries (renames, removals) to disk.
  void sync() const;

 protected:
  Directory(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  OwnedFd fd_;
  std::string path_;
};

// The run's directory, --path, opened once by each process that writes in
// it (the launcher's preflight, rank 0). Creates it (and its parents) when
// missing. Refuses, with std::runtime_error "--path <path>: <why>", a
// directory of another user (or a link of another user to one), one this
// process cannot write, and one where a file the run writes
// (mnist_train.log, metrics.csv, summary.json, mnist_model.pt, checkpoint)
// is a symbolic link.
class RunDirectory : public Directory {
 public:
  explicit RunDirectory(const std::string& path);
};

// RunDirectory's checks, for a caller that needs no descriptor.
void make_run_directory(const std::string& path);

}  // namespace mnist_ddp::files
