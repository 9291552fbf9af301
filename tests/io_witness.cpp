// An LD_PRELOAD witness of what a process asks of the file system, for tests/crash_order.py: each
// write to a regular file (consecutive writes to one file are one event), fsync / fdatasync,
// rename, unlink and rmdir, one line each in the file $REMAT_IO_LOG ("fsync /path", "rename /a /b"),
// paths as /proc/self/fd shows them at that moment. With $REMAT_IO_CRASH_AT=N the process kills
// itself with SIGKILL just before its N-th event (1-based): a crash at that point of its I/O.
// Faults for tests/mutations.py ($REMAT_MUTATION): no_fsync (fsync and fdatasync do nothing and
// are not logged), flip_snapshot_byte (one byte of a model.safetensors flipped on its way to the
// disk: after the trainer took its checksum).
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
int log_fd = -1, initialized, no_fsync, flip_byte;
char last_write[PATH_MAX];  // the file of the last event, when that was a write

void init() {
  if (initialized) return;
  initialized = 1;
  const char *log = getenv("REMAT_IO_LOG"), *crash = getenv("REMAT_IO_CRASH_AT");
  if (log) log_fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (crash) crash_at = atol(crash);
  const char *mutation = getenv("REMAT_MUTATION");
  no_fsync = mutation && strcmp(mutation, "no_fsync") == 0;
  flip_byte = mutation && strcmp(mutation, "flip_snapshot_byte") == 0;
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

// flip_snapshot_byte: whether this write (of n bytes to fd) is the one whose last byte flips: the
// first to a model.safetensors that ends past the file's header (the header's length is the
// file's first 8 bytes, on the disk by then): a tensor's byte, so the CRC-32 is what must see it.
int flips(int fd, size_t n) {
  char path[PATH_MAX];
  pthread_mutex_lock(&lock);
  init();
  int flip = flip_byte && n <= (1 << 20);
  pthread_mutex_unlock(&lock);
  if (!flip) return 0;
  path_of(fd, path);
  const off_t at = lseek(fd, 0, SEEK_CUR);
  if (!strstr(path, "model.safetensors") || at < 8) return 0;
  unsigned long long header = 0;
  const int file = open(path, O_RDONLY | O_CLOEXEC);
  if (file < 0) return 0;
  flip = pread(file, &header, 8, 0) == 8 && (unsigned long long)at + n > 8 + header;
  close(file);
  pthread_mutex_lock(&lock);
  flip = flip && flip_byte;
  if (flip) flip_byte = 0;
  pthread_mutex_unlock(&lock);
  return flip;
}
char flipped[1 << 20];
struct iovec flipped_iov[16];

int sync_event(int fd) {  // whether to call the real fsync
  char path[PATH_MAX];
  pthread_mutex_lock(&lock);
  init();
  pthread_mutex_unlock(&lock);
  if (no_fsync) return 0;
  path_of(fd, path);
  if (path[0]) event("fsync", path, NULL);
  return 1;
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
  if (fd == log_fd) return NEXT(write)(fd, buf, n);  // the log's own line, under the lock
  write_event(fd);
  if (flips(fd, n)) {
    memcpy(flipped, buf, n);
    flipped[n - 1] ^= 0x10;
    buf = flipped;
  }
  return NEXT(write)(fd, buf, n);
}
ssize_t writev(int fd, const struct iovec *iov, int count) {
  write_event(fd);
  size_t n = 0;
  for (int i = 0; i < count; ++i) n += iov[i].iov_len;
  if (count > 0 && count <= 16 && iov[count - 1].iov_len > 0 && flips(fd, n)) {  // the last byte: the last iov's
    memcpy(flipped_iov, iov, sizeof(struct iovec) * (size_t)count);
    struct iovec &last = flipped_iov[count - 1];
    memcpy(flipped, last.iov_base, last.iov_len);
    flipped[last.iov_len - 1] ^= 0x10;
    last.iov_base = flipped;
    iov = flipped_iov;
  }
  return NEXT(writev)(fd, iov, count);
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t offset) {
  write_event(fd);
  return NEXT(pwrite64)(fd, buf, n, offset);
}

int fsync(int fd) { return sync_event(fd) ? NEXT(fsync)(fd) : 0; }
int fdatasync(int fd) { return sync_event(fd) ? NEXT(fdatasync)(fd) : 0; }

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
