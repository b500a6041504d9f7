#include "ipc/unix_socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* Is something accepting connections on the socket file at path? */
static int socket_is_live(const struct sockaddr_un *addr) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int rc = connect(fd, (const struct sockaddr *)addr, sizeof *addr);
    int e = errno;
    close(fd);
    if (rc == 0) return 1;
    return e == ECONNREFUSED ? 0 : -1;
}

int ds41_unix_listen(const char *path, mode_t mode, gid_t group, int backlog, ds41_error *err) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    size_t len = path ? strlen(path) : 0;
    if (len == 0 || len >= sizeof addr.sun_path)
        return ds41_fail(err, "%s: a socket path needs 1..%zu bytes", path ? path : "(null)",
                         sizeof addr.sun_path - 1);
    memcpy(addr.sun_path, path, len + 1);

    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) return ds41_fail(err, "%s: exists and is not a socket (left alone)", path);
        int live = socket_is_live(&addr);
        if (live == 1) return ds41_fail(err, "%s: another server is accepting on this socket", path);
        if (live < 0)
            return ds41_fail(err, "%s: cannot tell whether the socket is in use: %s", path, strerror(errno));
        if (unlink(path) != 0)
            return ds41_fail(err, "%s: cannot remove the stale socket: %s", path, strerror(errno));
    } else if (errno != ENOENT) {
        return ds41_fail(err, "%s: %s", path, strerror(errno));
    }

    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ds41_fail(err, "%s: socket: %s", path, strerror(errno));
    /* Linux creates the socket file with the socket inode's mode (minus the
     * umask): owner-only until the group and final mode are set. */
    (void)fchmod(fd, 0600);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int e = errno;
        close(fd);
        return ds41_fail(err, "%s: bind: %s", path, strerror(e));
    }
    if (chmod(path, 0600) != 0 || (group != (gid_t)-1 && chown(path, (uid_t)-1, group) != 0) ||
        chmod(path, mode & 07777) != 0) {
        int e = errno;
        unlink(path);
        close(fd);
        return ds41_fail(err, "%s: setting mode %04o / group %ld: %s", path, (unsigned)(mode & 07777),
                         group == (gid_t)-1 ? -1L : (long)group, strerror(e));
    }
    if (listen(fd, backlog > 0 ? backlog : 128) != 0) {
        int e = errno;
        unlink(path);
        close(fd);
        return ds41_fail(err, "%s: listen: %s", path, strerror(e));
    }
    return fd;
}

int ds41_tcp_listen_loopback(const char *host, uint16_t port, int backlog, ds41_error *err) {
    struct sockaddr_storage ss = {0};
    socklen_t sl;
    if (!host) host = "127.0.0.1";
    if (strcmp(host, "localhost") == 0) host = "127.0.0.1";
    struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
        if ((ntohl(a4->sin_addr.s_addr) >> 24) != 127)
            return ds41_fail(err, "tcp listen %s: only loopback addresses (127.0.0.0/8, ::1) are allowed",
                             host);
        a4->sin_family = AF_INET;
        a4->sin_port = htons(port);
        sl = sizeof *a4;
    } else if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
        if (!IN6_IS_ADDR_LOOPBACK(&a6->sin6_addr))
            return ds41_fail(err, "tcp listen %s: only loopback addresses (127.0.0.0/8, ::1) are allowed",
                             host);
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons(port);
        sl = sizeof *a6;
    } else {
        return ds41_fail(err, "tcp listen '%s': not an IP address literal (or 'localhost')", host);
    }
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ds41_fail(err, "tcp listen %s:%u: socket: %s", host, port, strerror(errno));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&ss, sl) != 0 || listen(fd, backlog > 0 ? backlog : 128) != 0) {
        int e = errno;
        close(fd);
        return ds41_fail(err, "tcp listen %s:%u: %s", host, port, strerror(e));
    }
    return fd;
}
