// An LD_PRELOAD witness of what a process asks of the file system, for tests/crash_order.py: each
// write to a regular file (consecutive writes to one file are one event), fsync / fdatasync,
// rename, unlink and rmdir, one line each in the file $REMAT_IO_LOG ("fsync /path", "rename /a /b"),
// paths as /proc/self/fd shows them at that moment. With $REMAT_IO_CRASH_AT=N the process kills
// itself with SIGKILL just before its N-th event (1-based): a crash at that point of its I/O.
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

namespace {
pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
long events, crash_at = -1;
int log_fd = -1, initialized;
char last_write[PATH_MAX];  // the file of the last event, when that was a write

void init() {
  if (initialized) return;
  initialized = 1;
  const char *log = getenv("REMAT_IO_LOG"), *crash = getenv("REMAT_IO_CRASH_AT");
  if (log) log_fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (crash) crash_at = atol(crash);
}

// The path of a descriptor of a regular file or folder ("" for pipes, terminals, sockets).
void path_of(int fd, char *out) {
  char link[64];
  struct stat st;
  out[0] = 0;
  if (fstat(fd, &st) != 0 || !(S_ISREG(st.st_mode) || S_ISDIR(st.st_mode))) return;
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, out, PATH_MAX - 1);
  out[n > 0 ? n : 0] = 0;
}

void event(const char *kind, const char *a, const char *b) {
  pthread_mutex_lock(&lock);
  init();
  const int is_write = strcmp(kind, "write") == 0;
  if (is_write && strcmp(last_write, a) == 0) {  // the same file's next write: the same event
    pthread_mutex_unlock(&lock);
    return;
  }
  snprintf(last_write, sizeof last_write, "%s", is_write ? a : "");
  if (++events == crash_at) raise(SIGKILL);
  if (log_fd >= 0) {
    char line[2 * PATH_MAX + 32];
    const int n = snprintf(line, sizeof line, "%s %s%s%s\n", kind, a, b ? " " : "", b ? b : "");
    if (n > 0 && write(log_fd, line, (size_t)n) < 0) abort();
  }
  pthread_mutex_unlock(&lock);
}

// The file-system path of `path` relative to `dirfd` (AT_FDCWD: the working folder).
void absolute(int dirfd, const char *path, char *out) {
  char base[PATH_MAX];
  if (path[0] == '/') {
    snprintf(out, PATH_MAX, "%s", path);
    return;
  }
  if (dirfd == AT_FDCWD) {
    if (!getcwd(base, sizeof base)) base[0] = 0;
  } else {
    path_of(dirfd, base);
  }
  snprintf(out, PATH_MAX, "%s/%s", base, path);
}

#define NEXT(name) (reinterpret_cast<decltype(&name)>(dlsym(RTLD_NEXT, #name)))

void write_event(int fd) {
  char path[PATH_MAX];
  if (fd == log_fd) return;
  path_of(fd, path);
  if (path[0] && strncmp(path, "/proc/", 6) != 0) event("write", path, NULL);
}

void sync_event(int fd) {
  char path[PATH_MAX];
  path_of(fd, path);
  if (path[0]) event("fsync", path, NULL);
}

void rename_event(int from_dir, const char *from, int to_dir, const char *to) {
  char a[PATH_MAX], b[PATH_MAX];
  absolute(from_dir, from, a);
  absolute(to_dir, to, b);
  event("rename", a, b);
}

void remove_event(int dir, const char *path, const char *kind) {
  char a[PATH_MAX];
  absolute(dir, path, a);
  event(kind, a, NULL);
}

}  // namespace

// (noexcept where glibc declares the function so)
extern "C" {
ssize_t write(int fd, const void *buf, size_t n) {
  write_event(fd);
  return NEXT(write)(fd, buf, n);
}
ssize_t writev(int fd, const struct iovec *iov, int count) {
  write_event(fd);
  return NEXT(writev)(fd, iov, count);
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t offset) {
  write_event(fd);
  return NEXT(pwrite64)(fd, buf, n, offset);
}

int fsync(int fd) { return sync_event(fd), NEXT(fsync)(fd); }
int fdatasync(int fd) { return sync_event(fd), NEXT(fdatasync)(fd); }

int rename(const char *from, const char *to) noexcept {
  rename_event(AT_FDCWD, from, AT_FDCWD, to);
  return NEXT(rename)(from, to);
}
int renameat(int from_dir, const char *from, int to_dir, const char *to) noexcept {
  rename_event(from_dir, from, to_dir, to);
  return NEXT(renameat)(from_dir, from, to_dir, to);
}
int renameat2(int from_dir, const char *from, int to_dir, const char *to, unsigned flags) noexcept {
  rename_event(from_dir, from, to_dir, to);
  return NEXT(renameat2)(from_dir, from, to_dir, to, flags);
}

int unlink(const char *path) noexcept { return remove_event(AT_FDCWD, path, "unlink"), NEXT(unlink)(path); }
int rmdir(const char *path) noexcept { return remove_event(AT_FDCWD, path, "rmdir"), NEXT(rmdir)(path); }
int unlinkat(int dir, const char *path, int flags) noexcept {
  remove_event(dir, path, flags & AT_REMOVEDIR ? "rmdir" : "unlink");
  return NEXT(unlinkat)(dir, path, flags);
}
}  // extern "C"
