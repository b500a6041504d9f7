/* ds41_state_lock: one ds41d per state directory.  See state_lock.h. */
#include "daemon/state_lock.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* mkdir -p: create dir and its missing parents; fails naming the component that could not be made. */
static int make_dirs(const char *dir, ds41_error *err) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf)
        return ds41_fail(err, "%s: path too long", dir);
    for (char *p = buf + 1;; p++) {
        if (*p != '/' && *p != 0) continue;
        char c = *p;
        *p = 0;
        if (mkdir(buf, 0750) != 0 && errno != EEXIST)
            return ds41_fail(err, "cannot create %s: %s", buf, strerror(errno));
        if (c == 0) break;
        *p = c;
    }
    struct stat st;
    if (stat(dir, &st) != 0) return ds41_fail(err, "%s: %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return ds41_fail(err, "%s: not a directory", dir);
    return 0;
}

/* The holder's pid from the lock file, 0 when it holds none (yet). */
static long read_pid(int fd) {
    char buf[32];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *end;
    long pid = strtol(buf, &end, 10);
    return pid > 0 && (*end == '\n' || *end == 0) ? pid : 0;
}

int ds41_state_lock_acquire(const char *dir, ds41_error *err) {
    char path[PATH_MAX];
    if (!dir || dir[0] != '/')
        return ds41_fail(err, "state directory %s: not an absolute path", dir ? dir : "(null)");
    if (snprintf(path, sizeof path, "%s/%s", dir, DS41_STATE_LOCK_FILE) >= (int)sizeof path)
        return ds41_fail(err, "state directory %s: path too long", dir);
    if (make_dirs(dir, err) != 0) return ds41_error_prefix(err, "state directory");
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        return ds41_fail(err, "state directory %s: cannot open the lock %s: %s", dir, path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return ds41_fail(err, "state directory %s: the lock %s is not a regular file", dir, path);
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        if (e != EWOULDBLOCK) {
            close(fd);
            return ds41_fail(err, "state directory %s: cannot lock %s: %s", dir, path, strerror(e));
        }
        /* The holder writes its pid right after it takes the lock: give it a moment when the
         * file is still empty, so the message names it. */
        long pid = read_pid(fd);
        for (int i = 0; i < 100 && pid == 0; i++) {
            nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
            pid = read_pid(fd);
        }
        close(fd);
        char who[48];
        if (pid > 0)
            snprintf(who, sizeof who, "pid %ld", pid);
        else
            snprintf(who, sizeof who, "an unknown pid");
        return ds41_fail(err, "state directory %s is in use by ds41d %s (lock %s)", dir, who, path);
    }
    char line[32];
    int len = snprintf(line, sizeof line, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, line, (size_t)len, 0) != len) {
        int e = errno;
        close(fd);
        return ds41_fail(err, "state directory %s: cannot write the pid into %s: %s", dir, path, strerror(e));
    }
    return fd;
}

void ds41_state_lock_release(int fd) {
    if (fd >= 0) close(fd);
}
