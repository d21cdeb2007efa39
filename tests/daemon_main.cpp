// daemon(3) for real, for the tests of what outlives a launcher
// (launcher_test.cpp): `mnist_ddp_test_daemon PIDFILE PROGRAM [ARGS...]`
// becomes a daemon (its parent exits, it starts a session of its own,
// leaves the working directory and the terminal), appends its pid to
// PIDFILE (an absolute path) and execs PROGRAM, which keeps that pid.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>

int main(int argc, char** argv) {
  if (argc < 3 || daemon(0, 0) != 0) return 1;
  const int fd = open(argv[1], O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  char line[32];
  const int length = std::snprintf(line, sizeof line, "%d\n", static_cast<int>(getpid()));
  if (fd < 0 || write(fd, line, static_cast<size_t>(length)) != length) return 1;
  close(fd);
  execvp(argv[2], argv + 2);
  return 127;
}
