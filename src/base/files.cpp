#include "mnist_ddp/base/files.hpp"

#include <dirent.h>
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
