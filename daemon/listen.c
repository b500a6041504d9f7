/* ds41_listen: listening sockets of the daemon.  See listen.h. */
#include "daemon/listen.h"

#include "daemon/systemd.h"

#include <arpa/inet.h>
#include <errno.h>
#include <grp.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

static void listener_reset(ds41_listener *l) {
    memset(l, 0, sizeof *l);
    l->fd = -1;
}

int ds41_listen_group_id(const char *group, gid_t *gid, ds41_error *err) {
    size_t size = 1024;
    for (;;) {
        char *buf = malloc(size);
        if (!buf) return ds41_fail(err, "out of memory");
        struct group gr, *res = NULL;
        int r = getgrnam_r(group, &gr, buf, size, &res);
        if (r == ERANGE && size < (1u << 20)) {
            free(buf);
            size *= 4;
            continue;
        }
        if (r == 0 && res) *gid = gr.gr_gid;
        free(buf);
        if (r != 0) return ds41_fail(err, "cannot look up group '%s': %s", group, strerror(r));
        if (!res)
            return ds41_fail(err,
                             "group '%s' does not exist (systemd-sysusers creates it from ds41d's sysusers.d file; "
                             "or set listen.socket_group: null)",
                             group);
        return 0;
    }
}

/* The socket's directory: it must exist and not be writable by others (unless sticky, where
 * others cannot rename or remove our entries), or be missing with a parent directory this process
 * may create it in.  create: make a missing one (mode 0755); else only check that mkdir could. */
static int check_parent(const char *path, bool create, ds41_error *err) {
    char parent[sizeof(((struct sockaddr_un *)0)->sun_path)];
    const char *slash = strrchr(path, '/');
    if (!slash) return ds41_fail(err, "%s: the socket path must be absolute", path);
    size_t plen = slash == path ? 1 : (size_t)(slash - path);
    memcpy(parent, path, plen);
    parent[plen] = 0;
    struct stat st;
    if (stat(parent, &st) != 0) {
        if (errno != ENOENT) return ds41_fail(err, "%s: %s", parent, strerror(errno));
        if (!create) {
            /* mkdir(parent) needs write and search permission in the parent's own directory
             * (one level: the start does not create missing ancestors either) */
            char up[sizeof parent];
            const char *s2 = strrchr(parent, '/');
            size_t ulen = s2 == parent ? 1 : (size_t)(s2 - parent);
            memcpy(up, parent, ulen);
            up[ulen] = 0;
            struct stat ust;
            if (stat(up, &ust) != 0)
                return ds41_fail(err, "cannot create the socket directory %s: %s: %s", parent, up,
                                 strerror(errno));
            if (!S_ISDIR(ust.st_mode))
                return ds41_fail(err, "cannot create the socket directory %s: %s is not a directory", parent,
                                 up);
            if (access(up, W_OK | X_OK) != 0)
                return ds41_fail(err, "cannot create the socket directory %s: %s", parent, strerror(errno));
            return 0;
        }
        if (mkdir(parent, 0755) != 0 && errno != EEXIST)
            return ds41_fail(err, "cannot create the socket directory %s: %s", parent, strerror(errno));
        /* mkdir's mode went through the umask; make it exactly 0755 */
        if (chmod(parent, 0755) != 0) return ds41_fail(err, "%s: chmod: %s", parent, strerror(errno));
        if (stat(parent, &st) != 0) return ds41_fail(err, "%s: %s", parent, strerror(errno));
    }
    if (!S_ISDIR(st.st_mode)) return ds41_fail(err, "%s: not a directory", parent);
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX))
        return ds41_fail(err,
                         "the socket directory %s (mode %04o) is writable by other users and not sticky; another "
                         "user could replace the socket",
                         parent, (unsigned)(st.st_mode & 07777));
    if (!create && access(parent, W_OK | X_OK) != 0)
        return ds41_fail(err, "cannot create a socket in %s: %s", parent, strerror(errno));
    return 0;
}

/* Path and mode rules of ds41_listen_unix. */
static int check_path(const char *path, ds41_error *err) {
    if (!path || path[0] != '/')
        return ds41_fail(err, "%s: the socket path must be absolute", path ? path : "(null)");
    if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path))
        return ds41_fail(err, "%s: the socket path is longer than %zu bytes", path,
                         sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
    return 0;
}

int ds41_listen_unix_check(const char *path, const char *group, ds41_error *err) {
    gid_t gid;
    if (check_path(path, err) != 0) return -1;
    if (group && ds41_listen_group_id(group, &gid, err) != 0) return ds41_error_prefix(err, "%s", path);
    if (check_parent(path, false, err) != 0) return -1;
    struct stat st;
    if (lstat(path, &st) == 0 && !S_ISSOCK(st.st_mode))
        return ds41_fail(err, "%s exists and is not a socket; not removing it", path);
    return 0;
}

/* Remove a stale socket at path; refuse a live one or any other file. */
static int clear_stale(const char *path, ds41_error *err) {
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno == ENOENT) return 0;
        return ds41_fail(err, "%s: %s", path, strerror(errno));
    }
    if (!S_ISSOCK(st.st_mode)) return ds41_fail(err, "%s exists and is not a socket; not removing it", path);
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (probe < 0) return ds41_fail(err, "socket: %s", strerror(errno));
    struct sockaddr_un sun;
    memset(&sun, 0, sizeof sun);
    sun.sun_family = AF_UNIX;
    memcpy(sun.sun_path, path, strlen(path));
    int r = connect(probe, (struct sockaddr *)&sun, sizeof sun);
    int e = errno;
    close(probe);
    if (r == 0) return ds41_fail(err, "%s: another process is listening on this socket (is ds41d already running?)", path);
    if (e != ECONNREFUSED) return ds41_fail(err, "%s: cannot tell whether the socket is stale: %s", path, strerror(e));
    if (unlink(path) != 0 && errno != ENOENT)
        return ds41_fail(err, "%s: cannot remove the stale socket: %s", path, strerror(errno));
    return 0;
}

/* Unlink path only if it still is the file (dev, ino). */
static void unlink_if_same(const char *path, dev_t dev, ino_t ino) {
    struct stat st;
    if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_dev == dev && st.st_ino == ino) unlink(path);
}

int ds41_listen_unix(const char *path, uint32_t mode, const char *group, int backlog, ds41_listener *out,
                     ds41_error *err) {
    listener_reset(out);
    struct sockaddr_un sun;
    if (check_path(path, err) != 0) return -1;
    if (mode > 0777) return ds41_fail(err, "%s: mode %o has bits beyond 0777", path, mode);
    if (backlog < 1) return ds41_fail(err, "%s: backlog %d is below 1", path, backlog);
    gid_t gid = (gid_t)-1;
    if (group && ds41_listen_group_id(group, &gid, err) != 0) return ds41_error_prefix(err, "%s", path);
    if (check_parent(path, true, err) != 0 || clear_stale(path, err) != 0) return -1;

    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ds41_fail(err, "%s: socket: %s", path, strerror(errno));
    memset(&sun, 0, sizeof sun);
    sun.sun_family = AF_UNIX;
    memcpy(sun.sun_path, path, strlen(path));
    if (bind(fd, (struct sockaddr *)&sun, sizeof sun) != 0) {
        int e = errno;
        close(fd);
        return ds41_fail(err, "%s: bind: %s", path, strerror(e));
    }
    struct stat st;
    int rc = 0;
    if (lstat(path, &st) != 0 || !S_ISSOCK(st.st_mode)) {
        close(fd);
        return ds41_fail(err, "%s: the socket file vanished after bind", path);
    }
    /* Permissions and group before listen(): until listen, connects fail. */
    if (chmod(path, mode) != 0) rc = ds41_fail(err, "%s: chmod %04o: %s", path, mode, strerror(errno));
    if (rc == 0 && group && lchown(path, (uid_t)-1, gid) != 0) {
        int e = errno;
        rc = ds41_fail(err, "%s: cannot give the socket to group '%s': %s%s", path, group, strerror(e),
                       e == EPERM ? " (the daemon's user must be root or a member of the group)" : "");
    }
    if (rc == 0 && listen(fd, backlog) != 0) rc = ds41_fail(err, "%s: listen: %s", path, strerror(errno));
    if (rc != 0) {
        unlink_if_same(path, st.st_dev, st.st_ino);
        close(fd);
        return -1;
    }
    out->fd = fd;
    out->family = AF_UNIX;
    out->owns_path = true;
    out->dev = st.st_dev;
    out->ino = st.st_ino;
    snprintf(out->address, sizeof out->address, "%s", path);
    return 0;
}

int ds41_listen_tcp(const char *address, int backlog, bool allow_port_0, ds41_listener *out, ds41_error *err) {
    listener_reset(out);
    struct sockaddr_storage ss;
    socklen_t len = 0;
    if (ds41_loopback_address_parse(address, allow_port_0, &ss, &len, err) != 0)
        return ds41_error_prefix(err, "listen.tcp");
    if (backlog < 1) return ds41_fail(err, "%s: backlog %d is below 1", address, backlog);
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ds41_fail(err, "%s: socket: %s", address, strerror(errno));
    int one = 1;
    int rc = 0;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0)
        rc = ds41_fail(err, "%s: SO_REUSEADDR: %s", address, strerror(errno));
    if (rc == 0 && ss.ss_family == AF_INET6 && setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one) != 0)
        rc = ds41_fail(err, "%s: IPV6_V6ONLY: %s", address, strerror(errno));
    if (rc == 0 && bind(fd, (struct sockaddr *)&ss, len) != 0)
        rc = ds41_fail(err, "%s: bind: %s", address, strerror(errno));
    if (rc == 0 && listen(fd, backlog) != 0) rc = ds41_fail(err, "%s: listen: %s", address, strerror(errno));
    struct sockaddr_storage bound;
    socklen_t blen = sizeof bound;
    if (rc == 0 && getsockname(fd, (struct sockaddr *)&bound, &blen) != 0)
        rc = ds41_fail(err, "%s: getsockname: %s", address, strerror(errno));
    if (rc != 0) {
        close(fd);
        return -1;
    }
    char host[INET6_ADDRSTRLEN];
    if (bound.ss_family == AF_INET) {
        const struct sockaddr_in *sin = (const struct sockaddr_in *)&bound;
        inet_ntop(AF_INET, &sin->sin_addr, host, sizeof host);
        snprintf(out->address, sizeof out->address, "%s:%u", host, ntohs(sin->sin_port));
    } else {
        const struct sockaddr_in6 *sin6 = (const struct sockaddr_in6 *)&bound;
        inet_ntop(AF_INET6, &sin6->sin6_addr, host, sizeof host);
        snprintf(out->address, sizeof out->address, "[%s]:%u", host, ntohs(sin6->sin6_port));
    }
    out->fd = fd;
    out->family = bound.ss_family;
    return 0;
}

void ds41_listener_close(ds41_listener *l) {
    if (!l) return;
    if (l->fd >= 0) close(l->fd);
    if (l->owns_path && l->address[0] == '/') unlink_if_same(l->address, l->dev, l->ino);
    listener_reset(l);
}

void ds41_listeners_close(ds41_listener *listeners, size_t n) {
    if (!listeners) return;
    for (size_t i = 0; i < n; i++) ds41_listener_close(&listeners[i]);
    free(listeners);
}

int ds41_listeners_open(const ds41_daemon_config *cfg, ds41_listener **out, size_t *n, ds41_error *err) {
    *out = NULL;
    *n = 0;
    if (ds41_sd_listen_fds(out, n, err) != 0) return -1;
    if (*n > 0) return 0;
    size_t want = cfg->listen.tcp ? 2 : 1;
    ds41_listener *ls = calloc(want, sizeof *ls);
    if (!ls) return ds41_fail(err, "out of memory");
    for (size_t i = 0; i < want; i++) listener_reset(&ls[i]);
    int backlog = (int)cfg->listen.backlog;
    if (ds41_listen_unix(cfg->listen.socket, cfg->listen.socket_mode, cfg->listen.socket_group, backlog, &ls[0],
                         err) != 0) {
        free(ls);
        return ds41_error_prefix(err, "listen.socket");
    }
    if (cfg->listen.tcp && ds41_listen_tcp(cfg->listen.tcp, backlog, false, &ls[1], err) != 0) {
        ds41_listeners_close(ls, want);
        return -1;
    }
    *out = ls;
    *n = want;
    return 0;
}
