#include "mnist_ddp/base/files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace mnist_ddp::files {

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_directories(const std::string& path) {
  if (path.empty() || is_directory(path)) return;
  const size_t slash = path.find_last_of('/', path.size() - 2);
  if (slash != std::string::npos && slash > 0) make_directories(path.substr(0, slash));
  if (mkdir(path.c_str(), 0777) != 0 && !(errno == EEXIST && is_directory(path)))
    throw std::runtime_error("cannot create the directory " + path + ": " + std::strerror(errno));
}

void make_run_directory(const std::string& path) {
  if (!is_directory(path)) {
    try {
      make_directories(path);
    } catch (const std::exception& e) {
      throw std::runtime_error("--path " + path + ": " + e.what());
    }
  }
  if (access(path.c_str(), W_OK | X_OK) != 0)
    throw std::runtime_error("--path " + path + ": the directory is not writable");
}

DirectoryLock::DirectoryLock(const std::string& dir, const std::string& holder) {
  const std::string file = join(dir, ".lock");
  fd_ = open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd_ < 0) throw std::runtime_error("--path " + dir + ": cannot open " + file + ": " + std::strerror(errno));
  if (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    char said[256] = {};
    const ssize_t n = pread(fd_, said, sizeof said - 1, 0);
    close(fd_);
    fd_ = -1;
    std::string who(said, n > 0 ? static_cast<size_t>(n) : 0);
    who = who.substr(0, who.find('\n'));
    if (error != EWOULDBLOCK)
      throw std::runtime_error("--path " + dir + ": cannot lock " + file + ": " + std::strerror(error));
    throw std::runtime_error("--path " + dir + " is in use by another job (" +
                             (who.empty() ? std::string("its holder is starting") : who) +
                             "): give this one a --path of its own, or wait for that one to end");
  }
  const std::string me = holder + ", pid " + std::to_string(getpid()) + "\n";
  if (ftruncate(fd_, 0) != 0 || pwrite(fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    // The lock holds all the same; only the name of its holder is missing.
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) close(fd_);  // and with it the lock
}

std::vector<std::string> list_directory(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (!d) return names;
  while (const dirent* entry = readdir(d)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  return names;
}

void remove_file(const std::string& path) { unlink(path.c_str()); }

void remove_tree(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const auto& name : list_directory(path)) remove_tree(join(path, name));
    rmdir(path.c_str());
  } else {
    unlink(path.c_str());
  }
}

}  // namespace mnist_ddp::files
