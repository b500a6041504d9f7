/* Tests for daemon/systemd and daemon/listen: notifications arrive in order
 * on a test-owned NOTIFY_SOCKET, the watchdog interval, socket activation
 * with a fake LISTEN_FDS/LISTEN_PID in forked children (valid and invalid
 * sockets), the daemon's own Unix socket (mode, group, parent directory,
 * stale and live sockets, safe removal) and loopback TCP. */
#include "daemon/listen.h"
#include "daemon/systemd.h"
#include "tests/tap.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char tmpdir[] = "/tmp/ds41-test-systemd-XXXXXX";

static void path_in_tmp(char *buf, size_t size, const char *name) {
    snprintf(buf, size, "%s/%s", tmpdir, name);
}

static bool has(const char *s, const char *needle) {
    return s && strstr(s, needle) != NULL;
}

/* ---- notifications ---------------------------------------------------------- */

static int open_notify_socket(const char *path, bool abstract, char *env_value, size_t env_size) {
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_un sun;
    memset(&sun, 0, sizeof sun);
    sun.sun_family = AF_UNIX;
    socklen_t len;
    if (abstract) {
        /* "\0name": Linux abstract namespace, NOTIFY_SOCKET=@name */
        snprintf(sun.sun_path + 1, sizeof sun.sun_path - 1, "%s", path);
        len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(path));
        snprintf(env_value, env_size, "@%s", path);
    } else {
        snprintf(sun.sun_path, sizeof sun.sun_path, "%s", path);
        len = sizeof sun;
        snprintf(env_value, env_size, "%s", path);
    }
    struct timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (bind(fd, (struct sockaddr *)&sun, len) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Next datagram as a string, or "" after the 2 s timeout. */
static void recv_msg(int fd, char *buf, size_t size) {
    ssize_t n = recv(fd, buf, size - 1, 0);
    buf[n > 0 ? n : 0] = 0;
}

static bool nothing_pending(int fd) {
    char c;
    return recv(fd, &c, 1, MSG_DONTWAIT) < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

static uint64_t monotonic_usec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void test_notify(void) {
    ds41_error err = {{0}};
    unsetenv("NOTIFY_SOCKET");
    TAP_CHECK(!ds41_sd_notify_enabled() && ds41_sd_ready("x", &err) == 0 && ds41_sd_stopping(&err) == 0,
              "without NOTIFY_SOCKET notifications are successful no-ops");

    char path[256], env[256];
    path_in_tmp(path, sizeof path, "notify");
    int fd = open_notify_socket(path, false, env, sizeof env);
    TAP_CHECK(fd >= 0, "a test-owned notify socket at %s", path);
    if (fd < 0) return;
    setenv("NOTIFY_SOCKET", env, 1);
    TAP_CHECK(ds41_sd_notify_enabled(), "NOTIFY_SOCKET set: notifications enabled");

    /* The sequence the daemon sends: load progress, ready, serving, a reload, stop. */
    uint64_t before = monotonic_usec();
    int rc = 0;
    rc |= ds41_sd_status(&err, "loading shard %d/%d", 17, 48);
    rc |= ds41_sd_extend_timeout(30000000, &err);
    rc |= ds41_sd_ready("serving ds41-tiny", &err);
    rc |= ds41_sd_watchdog_ping(&err);
    rc |= ds41_sd_reloading(&err);
    rc |= ds41_sd_ready(NULL, &err);
    rc |= ds41_sd_status(&err, "serving: %d sessions\nREADY=1", 3);
    rc |= ds41_sd_stopping(&err);
    uint64_t after = monotonic_usec();
    TAP_CHECK(rc == 0, "every notification is sent (%s)", rc ? err.msg : "ok");

    static const char *const want[] = {"STATUS=loading shard 17/48",
                                       "EXTEND_TIMEOUT_USEC=30000000",
                                       "READY=1\nSTATUS=serving ds41-tiny",
                                       "WATCHDOG=1",
                                       NULL, /* RELOADING: checked below */
                                       "READY=1",
                                       "STATUS=serving: 3 sessions READY=1",
                                       "STOPPING=1"};
    char got[512];
    const char *wrong = NULL;
    char wrong_got[512] = "";
    bool reload_ok = false;
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        recv_msg(fd, got, sizeof got);
        if (!want[i]) {
            unsigned long long usec = 0;
            reload_ok = sscanf(got, "RELOADING=1\nMONOTONIC_USEC=%llu", &usec) == 1 && usec >= before &&
                        usec <= after;
            continue;
        }
        if (!wrong && strcmp(got, want[i]) != 0) {
            wrong = want[i];
            snprintf(wrong_got, sizeof wrong_got, "%s", got);
        }
    }
    TAP_CHECK(!wrong, "the notify socket receives STATUS, EXTEND_TIMEOUT, READY, WATCHDOG, READY, STATUS, STOPPING in "
                      "order (first wrong: want '%s' got '%s')",
              wrong ? wrong : "", wrong_got);
    TAP_CHECK(reload_ok, "RELOADING=1 carries MONOTONIC_USEC of CLOCK_MONOTONIC now");
    TAP_CHECK(nothing_pending(fd), "nothing else was sent; a newline in STATUS did not smuggle a second READY=1");
    close(fd);
    unlink(path);

    char name[64];
    snprintf(name, sizeof name, "ds41-test-notify-%d", (int)getpid());
    fd = open_notify_socket(name, true, env, sizeof env);
    if (fd >= 0) {
        setenv("NOTIFY_SOCKET", env, 1);
        rc = ds41_sd_ready("abstract", &err);
        recv_msg(fd, got, sizeof got);
        TAP_CHECK(rc == 0 && strcmp(got, "READY=1\nSTATUS=abstract") == 0, "an abstract NOTIFY_SOCKET (@name) works");
        close(fd);
    } else {
        TAP_SKIP("abstract Unix sockets unavailable");
    }

    setenv("NOTIFY_SOCKET", "/nonexistent/notify", 1);
    rc = ds41_sd_stopping(&err);
    TAP_CHECK(rc == -1 && has(err.msg, "NOTIFY_SOCKET=/nonexistent/notify"),
              "a broken NOTIFY_SOCKET is an error naming it (%s)", err.msg);
    unsetenv("NOTIFY_SOCKET");
}

static void test_watchdog(void) {
    ds41_error err = {{0}};
    uint64_t usec = 1;
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
    TAP_CHECK(ds41_sd_watchdog_usec(&usec, &err) == 0 && usec == 0, "no WATCHDOG_USEC: watchdog off");
    char pid[32];
    snprintf(pid, sizeof pid, "%d", (int)getpid());
    setenv("WATCHDOG_USEC", "30000000", 1);
    setenv("WATCHDOG_PID", pid, 1);
    TAP_CHECK(ds41_sd_watchdog_usec(&usec, &err) == 0 && usec == 30000000, "WatchdogSec=30s for this pid: 30000000 us");
    snprintf(pid, sizeof pid, "%d", (int)getppid());
    setenv("WATCHDOG_PID", pid, 1);
    TAP_CHECK(ds41_sd_watchdog_usec(&usec, &err) == 0 && usec == 0, "WATCHDOG_PID of another process: off");
    unsetenv("WATCHDOG_PID");
    setenv("WATCHDOG_USEC", "soon", 1);
    TAP_CHECK(ds41_sd_watchdog_usec(&usec, &err) == -1 && has(err.msg, "WATCHDOG_USEC=soon"),
              "a malformed WATCHDOG_USEC is an error (%s)", err.msg);
    unsetenv("WATCHDOG_USEC");
}

/* ---- socket activation in forked children ---------------------------------------- */

typedef int (*child_fn)(int scenario, char *msg, size_t size);

/* Run fn in a child; its message comes back through a pipe.  True when the
 * child exited 0. */
static bool in_child(child_fn fn, int scenario, char *msg, size_t size) {
    int p[2];
    if (pipe(p) != 0) return false;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        /* keep the pipe away from 3, 4, ... where passed sockets go */
        int out = fcntl(p[1], F_DUPFD, 200);
        close(p[1]);
        char m[1024] = "";
        int ok = fn(scenario, m, sizeof m);
        if (out < 0 || write(out, m, strlen(m)) < 0) _exit(3);
        _exit(ok ? 0 : 1);
    }
    close(p[1]);
    ssize_t n = 0, got;
    while ((got = read(p[0], msg + n, size - 1 - (size_t)n)) > 0) n += got;
    msg[n > 0 ? n : 0] = 0;
    close(p[0]);
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) return false;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* Put the descriptors in fds[] at 3, 4, ... (SD_LISTEN_FDS_START) and set
 * LISTEN_FDS / LISTEN_PID (pid_offset 0 = this process). */
static void pass_fds(const int *fds, int n, int pid_offset, const char *names) {
    int high[8];
    for (int i = 0; i < n; i++) high[i] = fcntl(fds[i], F_DUPFD, 100);
    for (int i = 0; i < n; i++) close(fds[i]);
    for (int i = 0; i < n; i++) {
        dup2(high[i], 3 + i);
        close(high[i]);
    }
    char v[32];
    snprintf(v, sizeof v, "%d", n);
    setenv("LISTEN_FDS", v, 1);
    snprintf(v, sizeof v, "%d", (int)getpid() + pid_offset);
    setenv("LISTEN_PID", v, 1);
    if (names) setenv("LISTEN_FDNAMES", names, 1);
    else unsetenv("LISTEN_FDNAMES");
}

static int unix_socket_at(const char *path, bool do_listen) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sun;
    memset(&sun, 0, sizeof sun);
    sun.sun_family = AF_UNIX;
    snprintf(sun.sun_path, sizeof sun.sun_path, "%s", path);
    unlink(path);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sun, sizeof sun) != 0) return -1;
    if (do_listen && listen(fd, 4) != 0) return -1;
    return fd;
}

static int tcp_socket(const char *ip, int type, bool do_listen) {
    int fd = socket(AF_INET, type, 0);
    struct sockaddr_in sin;
    memset(&sin, 0, sizeof sin);
    sin.sin_family = AF_INET;
    inet_pton(AF_INET, ip, &sin.sin_addr);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sin, sizeof sin) != 0) return -1;
    if (do_listen && listen(fd, 4) != 0) return -1;
    return fd;
}

enum {
    ACT_VALID,
    ACT_OTHER_PID,
    ACT_NOT_LISTENING,
    ACT_REGULAR_FILE,
    ACT_WILDCARD_TCP,
    ACT_UDP,
    ACT_MALFORMED,
    ACT_NONE,
    ACT_OPEN_FROM_CONFIG,
};

static int child_activation(int scenario, char *msg, size_t size) {
    char upath[256];
    path_in_tmp(upath, sizeof upath, "activated.sock");
    ds41_listener *ls = NULL;
    size_t n = 99;
    ds41_error err = {{0}};
    int rc;
    switch (scenario) {
    case ACT_VALID: {
        int fds[2] = {unix_socket_at(upath, true), tcp_socket("127.0.0.1", SOCK_STREAM, true)};
        pass_fds(fds, 2, 0, "api:tcp");
        rc = ds41_sd_listen_fds(&ls, &n, &err);
        bool env_gone = !getenv("LISTEN_FDS") && !getenv("LISTEN_PID") && !getenv("LISTEN_FDNAMES");
        bool ok = rc == 0 && n == 2 && ls[0].fd == 3 && ls[0].family == AF_UNIX && ls[0].activated &&
                  !ls[0].owns_path && strcmp(ls[0].address, upath) == 0 && strcmp(ls[0].name, "api") == 0 &&
                  ls[1].fd == 4 && ls[1].family == AF_INET && strncmp(ls[1].address, "127.0.0.1:", 10) == 0 &&
                  strcmp(ls[1].name, "tcp") == 0 && env_gone && (fcntl(3, F_GETFD) & FD_CLOEXEC);
        snprintf(msg, size, "rc %d n %zu %s %s (%s)", rc, n, n == 2 ? ls[0].address : "", n == 2 ? ls[1].address : "",
                 err.msg);
        ds41_listeners_close(ls, n);
        struct stat st;
        /* closing a passed socket never removes its file: it is systemd's */
        ok = ok && stat(upath, &st) == 0 && fcntl(3, F_GETFD) == -1;
        return ok;
    }
    case ACT_OTHER_PID: {
        int fds[1] = {unix_socket_at(upath, true)};
        pass_fds(fds, 1, 1, NULL);
        rc = ds41_sd_listen_fds(&ls, &n, &err);
        snprintf(msg, size, "rc %d n %zu", rc, n);
        return rc == 0 && n == 0 && ls == NULL;
    }
    case ACT_NONE:
        unsetenv("LISTEN_FDS");
        unsetenv("LISTEN_PID");
        rc = ds41_sd_listen_fds(&ls, &n, &err);
        snprintf(msg, size, "rc %d n %zu", rc, n);
        return rc == 0 && n == 0 && ls == NULL;
    case ACT_NOT_LISTENING:
    case ACT_REGULAR_FILE:
    case ACT_WILDCARD_TCP:
    case ACT_UDP: {
        int fd = -1;
        const char *want = "";
        if (scenario == ACT_NOT_LISTENING) {
            fd = unix_socket_at(upath, false);
            want = "not a listening stream socket";
        } else if (scenario == ACT_REGULAR_FILE) {
            fd = open("/dev/null", O_RDONLY);
            want = "fd 4";
        } else if (scenario == ACT_WILDCARD_TCP) {
            fd = tcp_socket("0.0.0.0", SOCK_STREAM, true);
            want = "not loopback";
        } else {
            fd = tcp_socket("127.0.0.1", SOCK_DGRAM, false);
            want = "not a listening stream socket";
        }
        char good[256];
        path_in_tmp(good, sizeof good, "activated-good.sock");
        int fds[2] = {unix_socket_at(good, true), fd};
        pass_fds(fds, 2, 0, "good:bad");
        rc = ds41_sd_listen_fds(&ls, &n, &err);
        snprintf(msg, size, "rc %d: %s", rc, err.msg);
        return rc == -1 && ls == NULL && n == 0 && has(err.msg, "socket activation: fd 4 ('bad')") &&
               has(err.msg, want) && fcntl(4, F_GETFD) != -1;
    }
    case ACT_MALFORMED:
        setenv("LISTEN_FDS", "two", 1);
        snprintf(upath, sizeof upath, "%d", (int)getpid());
        setenv("LISTEN_PID", upath, 1);
        rc = ds41_sd_listen_fds(&ls, &n, &err);
        snprintf(msg, size, "rc %d: %s", rc, err.msg);
        return rc == -1 && has(err.msg, "LISTEN_FDS");
    case ACT_OPEN_FROM_CONFIG: {
        int fds[1] = {unix_socket_at(upath, true)};
        pass_fds(fds, 1, 0, NULL);
        ds41_daemon_config cfg;
        ds41_daemon_config_defaults(&cfg, &err);
        char own[256];
        path_in_tmp(own, sizeof own, "not-created.sock");
        ds41_daemon_config_set(&cfg, "listen.socket", own, &err);
        ds41_daemon_config_set(&cfg, "listen.tcp", "127.0.0.1:1", &err);
        rc = ds41_listeners_open(&cfg, &ls, &n, &err);
        struct stat st;
        bool ok = rc == 0 && n == 1 && ls[0].activated && ls[0].fd == 3 && stat(own, &st) != 0;
        snprintf(msg, size, "rc %d n %zu (%s)", rc, n, err.msg);
        ds41_listeners_close(ls, n);
        ds41_daemon_config_free(&cfg);
        return ok;
    }
    }
    return 0;
}

static void test_activation(void) {
    static const struct {
        int scenario;
        const char *what;
    } cases[] = {
        {ACT_VALID, "a passed AF_UNIX and a loopback TCP listener are taken with their names; the environment is "
                    "consumed; close leaves the socket file"},
        {ACT_OTHER_PID, "LISTEN_PID of another process: no sockets"},
        {ACT_NONE, "no LISTEN_FDS: no sockets"},
        {ACT_NOT_LISTENING, "a passed Unix socket that is not listening is refused, naming fd and name"},
        {ACT_REGULAR_FILE, "a passed non-socket descriptor is refused"},
        {ACT_WILDCARD_TCP, "a passed TCP listener on 0.0.0.0 is refused (not loopback)"},
        {ACT_UDP, "a passed UDP socket is refused"},
        {ACT_MALFORMED, "a malformed LISTEN_FDS is an error"},
        {ACT_OPEN_FROM_CONFIG, "listeners_open prefers the passed sockets over listen.socket and listen.tcp"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char msg[1024];
        bool ok = in_child(child_activation, cases[i].scenario, msg, sizeof msg);
        TAP_CHECK(ok, "%s (%s)", cases[i].what, msg);
    }
}

/* ---- the daemon's own sockets ---------------------------------------------------- */

static bool can_connect(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sun;
    memset(&sun, 0, sizeof sun);
    sun.sun_family = AF_UNIX;
    snprintf(sun.sun_path, sizeof sun.sun_path, "%s", path);
    bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&sun, sizeof sun) == 0;
    if (fd >= 0) close(fd);
    return ok;
}

/* A group to give sockets to: as root one that is not root's own, else our
 * primary group (a user may always chown to a group it belongs to). */
static const char *test_group(gid_t *gid) {
    if (geteuid() == 0) {
        static const char *const candidates[] = {"daemon", "nogroup", "bin"};
        for (size_t i = 0; i < 3; i++) {
            struct group *g = getgrnam(candidates[i]);
            if (g && g->gr_gid != getegid()) {
                *gid = g->gr_gid;
                return candidates[i];
            }
        }
    }
    struct group *g = getgrgid(getegid());
    if (!g) return NULL;
    *gid = g->gr_gid;
    static char name[64];
    snprintf(name, sizeof name, "%s", g->gr_name);
    return name;
}

static int child_not_member(int scenario, char *msg, size_t size) {
    (void)scenario;
    /* as nobody, in a directory nobody owns, giving the socket to 'daemon' */
    char dir[256], path[300];
    path_in_tmp(dir, sizeof dir, "nobody");
    snprintf(path, sizeof path, "%s/x.sock", dir);
    if (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0) {
        snprintf(msg, size, "cannot drop privileges");
        return 0;
    }
    ds41_listener l;
    ds41_error err = {{0}};
    int rc = ds41_listen_unix(path, 0660, "daemon", 8, &l, &err);
    struct stat st;
    snprintf(msg, size, "%s", err.msg);
    return rc == -1 && has(err.msg, "group 'daemon'") && has(err.msg, "member") && lstat(path, &st) != 0 && l.fd == -1;
}

static void test_unix_socket(void) {
    ds41_error err = {{0}};
    mode_t old_umask = umask(077);
    gid_t gid = 0;
    const char *group = test_group(&gid);
    char dir[256], path[300];
    path_in_tmp(dir, sizeof dir, "run/ds41d");
    snprintf(path, sizeof path, "%s/ds41d.sock", dir);
    char run[256];
    path_in_tmp(run, sizeof run, "run");
    mkdir(run, 0755);

    ds41_listener l;
    int rc = ds41_listen_unix(path, 0660, group, 16, &l, &err);
    struct stat st, dst;
    bool st_ok = stat(path, &st) == 0, dst_ok = stat(dir, &dst) == 0;
    TAP_CHECK(rc == 0 && l.fd >= 0 && l.family == AF_UNIX && l.owns_path && strcmp(l.address, path) == 0,
              "a Unix socket is created at %s (%s)", path, rc ? err.msg : "ok");
    TAP_CHECK(st_ok && S_ISSOCK(st.st_mode) && (st.st_mode & 07777) == 0660,
              "its mode is 0660 despite umask 077 (got %04o)", st_ok ? (unsigned)(st.st_mode & 07777) : 0u);
    TAP_CHECK(st_ok && group && st.st_gid == gid, "its group is '%s' (gid %u, got %u)", group ? group : "?",
              (unsigned)gid, st_ok ? (unsigned)st.st_gid : 0u);
    TAP_CHECK(dst_ok && S_ISDIR(dst.st_mode) && (dst.st_mode & 07777) == 0755,
              "the missing parent directory is created with mode 0755 (got %04o)",
              dst_ok ? (unsigned)(dst.st_mode & 07777) : 0u);
    TAP_CHECK(rc == 0 && can_connect(path) && (fcntl(l.fd, F_GETFD) & FD_CLOEXEC), "it accepts connections and is close-on-exec");

    ds41_listener second;
    rc = ds41_listen_unix(path, 0660, NULL, 16, &second, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "another process is listening") && second.fd == -1 && can_connect(path),
              "a second daemon on the same path is refused and the first keeps serving (%s)", err.msg);

    ds41_listener_close(&l);
    TAP_CHECK(l.fd == -1 && stat(path, &st) != 0, "closing removes the socket file");

    int stale = unix_socket_at(path, false);
    close(stale);
    rc = ds41_listen_unix(path, 0600, NULL, 16, &l, &err);
    TAP_CHECK(stale >= 0 && rc == 0 && stat(path, &st) == 0 && (st.st_mode & 0777) == 0600 && can_connect(path),
              "a stale socket of an earlier run is replaced (%s)", rc ? err.msg : "ok");
    /* someone replaced our socket: close must not remove their file */
    unlink(path);
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
    ds41_listener_close(&l);
    TAP_CHECK(stat(path, &st) == 0 && S_ISREG(st.st_mode), "closing leaves a file that replaced our socket");

    rc = ds41_listen_unix(path, 0660, NULL, 16, &l, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "not a socket") && stat(path, &st) == 0 && S_ISREG(st.st_mode),
              "a regular file at the path is refused and left alone (%s)", err.msg);
    unlink(path);
    if (symlink("/etc/passwd", path) == 0) {
        rc = ds41_listen_unix(path, 0660, NULL, 16, &l, &err);
        TAP_CHECK(rc == -1 && has(err.msg, "not a socket") && lstat(path, &st) == 0 && S_ISLNK(st.st_mode),
                  "a symlink at the path is refused and left alone (%s)", err.msg);
        unlink(path);
    } else {
        TAP_SKIP("cannot create a symlink");
    }

    rc = ds41_listen_unix(path, 0660, "no-such-group-ds41", 16, &l, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "'no-such-group-ds41' does not exist") && stat(path, &st) != 0,
              "a missing group is an error and leaves no file (%s)", err.msg);

    char open_dir[256], open_path[300];
    path_in_tmp(open_dir, sizeof open_dir, "open");
    mkdir(open_dir, 0777);
    chmod(open_dir, 0777);
    snprintf(open_path, sizeof open_path, "%s/x.sock", open_dir);
    rc = ds41_listen_unix(open_path, 0660, NULL, 16, &l, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "writable by other users") && stat(open_path, &st) != 0,
              "a world-writable non-sticky parent is refused (%s)", err.msg);
    chmod(open_dir, 01777);
    rc = ds41_listen_unix(open_path, 0660, NULL, 16, &l, &err);
    TAP_CHECK(rc == 0, "a sticky world-writable parent (like /tmp) is accepted (%s)", rc ? err.msg : "ok");
    ds41_listener_close(&l);

    char long_path[200];
    memset(long_path, 'a', sizeof long_path - 1);
    long_path[0] = '/';
    long_path[sizeof long_path - 1] = 0;
    rc = ds41_listen_unix(long_path, 0660, NULL, 16, &l, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "longer than 107"), "a path beyond sun_path is refused (%s)", err.msg);
    rc = ds41_listen_unix("relative.sock", 0660, NULL, 16, &l, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "absolute"), "a relative path is refused");

    if (geteuid() == 0 && getgrnam("daemon")) {
        char nobody_dir[256];
        path_in_tmp(nobody_dir, sizeof nobody_dir, "nobody");
        mkdir(nobody_dir, 0755);
        if (chown(nobody_dir, 65534, 65534) == 0) {
            char msg[1024];
            bool ok = in_child(child_not_member, 0, msg, sizeof msg);
            TAP_CHECK(ok, "a user outside the group cannot be given the socket: clear error, no file left (%s)", msg);
        } else {
            TAP_SKIP("cannot chown a directory to nobody");
        }
    } else {
        TAP_SKIP("needs root (to act as a user outside the socket's group)");
    }
    umask(old_umask);
}

static bool tcp_connect(const ds41_listener *l) {
    int fd = socket(l->family, SOCK_STREAM, 0);
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    bool ok = fd >= 0 && getsockname(l->fd, (struct sockaddr *)&ss, &len) == 0 &&
              connect(fd, (struct sockaddr *)&ss, len) == 0;
    if (fd >= 0) close(fd);
    return ok;
}

static void test_tcp(void) {
    ds41_error err = {{0}};
    ds41_listener l;
    int rc = ds41_listen_tcp("127.0.0.1:0", 16, true, &l, &err);
    TAP_CHECK(rc == 0 && l.family == AF_INET && strncmp(l.address, "127.0.0.1:", 10) == 0 &&
                  strcmp(l.address, "127.0.0.1:0") != 0 && tcp_connect(&l),
              "loopback TCP on an ephemeral port listens and reports its port (%s)", rc ? err.msg : l.address);
    ds41_listener_close(&l);
    rc = ds41_listen_tcp("0.0.0.0:0", 16, true, &l, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "not a loopback address") && l.fd == -1, "0.0.0.0 is refused (%s)", err.msg);
    rc = ds41_listen_tcp("127.0.0.1:0", 16, false, &l, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "port"), "port 0 only when allowed");
    rc = ds41_listen_tcp("[::1]:0", 16, true, &l, &err);
    if (rc == 0) {
        TAP_CHECK(l.family == AF_INET6 && strncmp(l.address, "[::1]:", 6) == 0 && tcp_connect(&l),
                  "IPv6 loopback TCP listens (%s)", l.address);
        ds41_listener_close(&l);
    } else {
        TAP_SKIP("no IPv6 loopback here (%s)", err.msg);
    }
}

static void test_open_from_config(void) {
    ds41_error err = {{0}};
    unsetenv("LISTEN_FDS");
    unsetenv("LISTEN_PID");
    /* a free port for listen.tcp (config ports are 1..65535) */
    ds41_listener probe;
    char port_addr[DS41_LISTENER_ADDR_MAX] = "127.0.0.1:1";
    if (ds41_listen_tcp("127.0.0.1:0", 1, true, &probe, &err) == 0) {
        snprintf(port_addr, sizeof port_addr, "%s", probe.address);
        ds41_listener_close(&probe);
    }
    ds41_daemon_config cfg;
    ds41_daemon_config_defaults(&cfg, &err);
    char path[256];
    path_in_tmp(path, sizeof path, "cfg/ds41d.sock");
    int rc = ds41_daemon_config_set(&cfg, "listen.socket", path, &err);
    rc = rc || ds41_daemon_config_set(&cfg, "listen.socket_group", "null", &err);
    rc = rc || ds41_daemon_config_set(&cfg, "listen.tcp", port_addr, &err);
    ds41_listener *ls = NULL;
    size_t n = 0;
    rc = rc || ds41_listeners_open(&cfg, &ls, &n, &err);
    struct stat st;
    TAP_CHECK(rc == 0 && n == 2 && ls[0].family == AF_UNIX && !ls[0].activated && strcmp(ls[0].address, path) == 0 &&
                  stat(path, &st) == 0 && (st.st_mode & 0777) == 0660 && ls[1].family == AF_INET &&
                  strcmp(ls[1].address, port_addr) == 0,
              "listeners_open without activation: the configured Unix socket and loopback TCP (%s)",
              rc ? err.msg : "ok");
    ds41_listeners_close(ls, n);
    TAP_CHECK(stat(path, &st) != 0, "listeners_close removes the daemon's socket file");

    ds41_daemon_config_set(&cfg, "listen.tcp", "null", &err);
    ds41_daemon_config_set(&cfg, "listen.socket_group", "no-such-group-ds41", &err);
    rc = ds41_listeners_open(&cfg, &ls, &n, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "listen.socket") && ls == NULL && n == 0,
              "listeners_open errors name the key (%s)", err.msg);
    ds41_daemon_config_free(&cfg);
}

static int rm_tree(const char *path) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    return system(cmd);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    if (!mkdtemp(tmpdir)) {
        TAP_CHECK(0, "mkdtemp: %s", strerror(errno));
        return tap_done();
    }
    chmod(tmpdir, 0755);
    test_notify();
    test_watchdog();
    test_activation();
    test_unix_socket();
    test_tcp();
    test_open_from_config();
    rm_tree(tmpdir);
    return tap_done();
}
