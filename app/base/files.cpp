#include "app/base/files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>

namespace mnist_ddp::files {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path, int error = errno) {
  throw std::runtime_error("cannot " + what + " " + path + ": " +
                           (error == ELOOP ? std::string("it is a symbolic link, and mnist_ddp follows none there")
                                           : std::strerror(error)));
}

std::string user_name(uid_t uid) {
  const passwd* p = getpwuid(uid);
  return (p ? std::string(p->pw_name) + " " : std::string()) + "(uid " + std::to_string(uid) + ")";
}

// Why a directory (or link) owned by `owner` is not this user's to write in; "" when it is.
std::string foreign(uid_t owner) {
  if (owner == geteuid()) return "";
  return "it belongs to user " + user_name(owner) + ", not to " + user_name(geteuid()) +
         ", and mnist_ddp writes only into its own user's directories";
}

// A name no one can guess, so nobody can plant a link or file there first.
std::string unguessable(const std::string& name) {
  unsigned char bytes[8] = {};
  if (getrandom(bytes, sizeof bytes, 0) != static_cast<ssize_t>(sizeof bytes)) {
    std::random_device device;
    for (auto& b : bytes) b = static_cast<unsigned char>(device());
  }
  std::string out = "." + name + ".tmp.";
  char hex[3];
  for (unsigned char b : bytes) {
    std::snprintf(hex, sizeof hex, "%02x", b);
    out += hex;
  }
  return out;
}

}  // namespace

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

DirectoryLock::DirectoryLock(const std::string& dir, const std::string& holder) {
  const std::string file = join(dir, ".lock");
  fd_ = OwnedFd(open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (fd_.get() < 0) throw std::runtime_error("--path " + dir + ": cannot open " + file + ": " + std::strerror(errno));
  if (flock(fd_.get(), LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    char said[256] = {};
    const ssize_t n = pread(fd_.get(), said, sizeof said - 1, 0);
    std::string who(said, n > 0 ? static_cast<size_t>(n) : 0);
    who = who.substr(0, who.find('\n'));
    if (error != EWOULDBLOCK)
      throw std::runtime_error("--path " + dir + ": cannot lock " + file + ": " + std::strerror(error));
    throw std::runtime_error("--path " + dir + " is in use by another job (" +
                             (who.empty() ? std::string("its holder is starting") : who) +
                             "): give this one a --path of its own, or wait for that one to end");
  }
  const std::string me = holder + ", pid " + std::to_string(getpid()) + "\n";
  if (ftruncate(fd_.get(), 0) != 0 || pwrite(fd_.get(), me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    // The lock holds all the same; only the name of its holder is missing.
  }
}

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) close(fd_);
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

// ---- AppendFile ----

void AppendFile::write(const std::string& text) {
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd_.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("write", path_);
    done += static_cast<size_t>(n);
  }
}

// ---- Directory ----

Directory Directory::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("open the directory", path);
  return Directory(fd, path);
}

Directory Directory::open_own(const std::string& path, bool create) {
  // The parent as named (links the caller gave included), then the last
  // component relative to it, never through a link.
  std::string parent = ".", leaf = path;
  const size_t end = path.find_last_not_of('/');
  if (end != std::string::npos) leaf = path.substr(0, end + 1);
  if (const size_t slash = leaf.find_last_of('/'); slash != std::string::npos) {
    parent = slash == 0 ? "/" : leaf.substr(0, slash);
    leaf = leaf.substr(slash + 1);
  }
  if (create) make_directories(parent);
  const Directory up = open(parent);
  if (create && mkdirat(up.fd_.get(), leaf.c_str(), 0777) != 0 && errno != EEXIST) fail("create the directory", path);
  const int fd = openat(up.fd_.get(), leaf.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) fail("open the directory", path, errno == ENOTDIR && up.is_link(leaf) ? ELOOP : errno);
  Directory dir(fd, path);
  struct stat st;
  if (fstat(fd, &st) != 0) fail("inspect", path);
  if (const std::string why = foreign(st.st_uid); !why.empty())
    throw std::runtime_error("cannot write into " + path + ": " + why);
  return dir;
}

bool Directory::has(const std::string& name) const {
  struct stat st;
  return fstatat(fd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
}

bool Directory::is_link(const std::string& name) const {
  struct stat st;
  return fstatat(fd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode);
}

std::vector<char> Directory::read(const std::string& name) const {
  const int fd = openat(fd_.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) fail("read", path_of(name));
  std::vector<char> bytes;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int saved = errno;
      close(fd);
      fail("read", path_of(name), saved);
    }
    if (n == 0) break;
    bytes.insert(bytes.end(), buf, buf + n);
  }
  close(fd);
  return bytes;
}

void Directory::write_atomically(const std::string& name, const std::vector<char>& bytes) const {
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 16; ++attempt) {
    tmp = unguessable(name);
    fd = openat(fd_.get(), tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) fail("write", path_of(tmp));
  auto undo = [&](const char* what, const std::string& file) {
    const int saved = errno;
    if (fd >= 0) close(fd);
    unlinkat(fd_.get(), tmp.c_str(), 0);
    fail(what, file, saved);
  };
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) undo("write", path_of(tmp));
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) undo("flush", path_of(tmp));
  const int closed = close(fd);
  fd = -1;
  if (closed != 0) undo("write", path_of(tmp));
  if (renameat(fd_.get(), tmp.c_str(), fd_.get(), name.c_str()) != 0) undo("write", path_of(name));
}

AppendFile Directory::append(const std::string& name) const {
  const int fd = openat(fd_.get(), name.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) fail("open", path_of(name));
  return AppendFile(fd, path_of(name));
}

void Directory::remove(const std::string& name) const { unlinkat(fd_.get(), name.c_str(), 0); }

void Directory::rename(const std::string& from, const std::string& to) const {
  if (has(to)) fail("rename " + path_of(from) + " to", path_of(to), EEXIST);
  if (renameat(fd_.get(), from.c_str(), fd_.get(), to.c_str()) != 0) fail("rename " + path_of(from) + " to", path_of(to));
}

std::vector<std::string> Directory::list() const {
  std::vector<std::string> names;
  const int fd = openat(fd_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);  // fdopendir takes the descriptor
  DIR* d = fd >= 0 ? fdopendir(fd) : nullptr;
  if (!d) {
    if (fd >= 0) close(fd);
    fail("list", path_);
  }
  while (const dirent* entry = readdir(d)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  return names;
}

void Directory::sync() const { fsync(fd_.get()); }

// ---- RunDirectory ----

RunDirectory::RunDirectory(const std::string& path) {
  auto refuse = [&](const std::string& why) { throw std::runtime_error("--path " + path + ": " + why); };
  struct stat st;
  if (lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
    if (const std::string why = foreign(st.st_uid); !why.empty()) refuse("a symbolic link that " + why.substr(3));
  try {
    if (!is_directory(path)) make_directories(path);
    static_cast<Directory&>(*this) = open(path);
  } catch (const std::exception& e) {
    refuse(e.what());
  }
  if (fstat(fd_.get(), &st) != 0) refuse(std::strerror(errno));
  if (const std::string why = foreign(st.st_uid); !why.empty()) refuse(why + "; choose another --path");
  if (faccessat(fd_.get(), ".", W_OK | X_OK, AT_EACCESS) != 0) refuse("the directory is not writable");
  for (const char* name : {"mnist_train.log", "metrics.csv", "summary.json", "mnist_model.pt", "checkpoint"})
    if (is_link(name))
      refuse(std::string(name) + " is a symbolic link, and mnist_ddp writes through none: remove it or choose "
                                 "another --path");
}

void make_run_directory(const std::string& path) { RunDirectory checked(path); }

}  // namespace mnist_ddp::files
