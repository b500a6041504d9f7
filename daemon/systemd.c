/* ds41_sd: systemd notify, watchdog and socket activation.  See systemd.h. */
#include "daemon/systemd.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#define STATUS_MAX 1024

bool ds41_sd_notify_enabled(void) {
    const char *s = getenv("NOTIFY_SOCKET");
    return s && s[0];
}

int ds41_sd_notify(const char *state, ds41_error *err) {
    if (!state) return ds41_fail(err, "sd_notify: no state");
    if (!ds41_sd_notify_enabled()) return 0;
    int r = sd_notify(0, state);
    if (r < 0)
        return ds41_fail(err, "sd_notify to NOTIFY_SOCKET=%s failed: %s", getenv("NOTIFY_SOCKET"), strerror(-r));
    return 0;
}

/* Replace control characters so a status stays one assignment. */
static void one_line(char *s) {
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f) *s = ' ';
}

int ds41_sd_status(ds41_error *err, const char *fmt, ...) {
    char buf[STATUS_MAX + 8];
    memcpy(buf, "STATUS=", 7);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + 7, STATUS_MAX + 1, fmt, ap);
    va_end(ap);
    one_line(buf + 7);
    return ds41_sd_notify(buf, err);
}

int ds41_sd_ready(const char *status, ds41_error *err) {
    if (!status) return ds41_sd_notify("READY=1", err);
    char buf[STATUS_MAX + 32];
    snprintf(buf, sizeof buf, "READY=1\nSTATUS=%.*s", STATUS_MAX, status);
    one_line(buf + strlen("READY=1\nSTATUS="));
    return ds41_sd_notify(buf, err);
}

int ds41_sd_reloading(ds41_error *err) {
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) return ds41_fail(err, "clock_gettime: %s", strerror(errno));
    char buf[96];
    snprintf(buf, sizeof buf, "RELOADING=1\nMONOTONIC_USEC=%llu",
             (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull);
    return ds41_sd_notify(buf, err);
}

int ds41_sd_stopping(ds41_error *err) {
    return ds41_sd_notify("STOPPING=1", err);
}

int ds41_sd_watchdog_ping(ds41_error *err) {
    return ds41_sd_notify("WATCHDOG=1", err);
}

int ds41_sd_extend_timeout(uint64_t usec, ds41_error *err) {
    char buf[64];
    snprintf(buf, sizeof buf, "EXTEND_TIMEOUT_USEC=%llu", (unsigned long long)usec);
    return ds41_sd_notify(buf, err);
}

int ds41_sd_watchdog_usec(uint64_t *usec, ds41_error *err) {
    *usec = 0;
    uint64_t u = 0;
    int r = sd_watchdog_enabled(0, &u);
    if (r < 0)
        return ds41_fail(err, "malformed watchdog environment (WATCHDOG_USEC=%s, WATCHDOG_PID=%s): %s",
                         getenv("WATCHDOG_USEC") ? getenv("WATCHDOG_USEC") : "",
                         getenv("WATCHDOG_PID") ? getenv("WATCHDOG_PID") : "", strerror(-r));
    if (r > 0) *usec = u;
    return 0;
}

/* Fill l->family/address from getsockname and check that the socket may be
 * served: AF_UNIX, or TCP bound to a loopback address. */
static int describe_passed(int fd, ds41_listener *l, ds41_error *err) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    memset(&ss, 0, sizeof ss);
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0)
        return ds41_fail(err, "getsockname: %s", strerror(errno));
    l->family = ss.ss_family;
    if (ss.ss_family == AF_UNIX) {
        const struct sockaddr_un *sun = (const struct sockaddr_un *)&ss;
        size_t plen = len > offsetof(struct sockaddr_un, sun_path) ? len - offsetof(struct sockaddr_un, sun_path) : 0;
        if (plen > sizeof sun->sun_path) plen = sizeof sun->sun_path;
        if (plen > 0 && sun->sun_path[0] == 0) { /* abstract: shown as @name */
            snprintf(l->address, sizeof l->address, "@%.*s", (int)(plen - 1), sun->sun_path + 1);
        } else {
            snprintf(l->address, sizeof l->address, "%.*s", (int)strnlen(sun->sun_path, plen), sun->sun_path);
        }
        return 0;
    }
    char host[INET6_ADDRSTRLEN];
    if (ss.ss_family == AF_INET) {
        const struct sockaddr_in *sin = (const struct sockaddr_in *)&ss;
        inet_ntop(AF_INET, &sin->sin_addr, host, sizeof host);
        snprintf(l->address, sizeof l->address, "%s:%u", host, ntohs(sin->sin_port));
        if ((ntohl(sin->sin_addr.s_addr) >> 24) != 127)
            return ds41_fail(err, "TCP socket on %s is not loopback; ds41d serves TCP only on 127.0.0.0/8 and ::1",
                             l->address);
        return 0;
    }
    if (ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *sin6 = (const struct sockaddr_in6 *)&ss;
        inet_ntop(AF_INET6, &sin6->sin6_addr, host, sizeof host);
        snprintf(l->address, sizeof l->address, "[%s]:%u", host, ntohs(sin6->sin6_port));
        bool mapped_loopback = IN6_IS_ADDR_V4MAPPED(&sin6->sin6_addr) && sin6->sin6_addr.s6_addr[12] == 127;
        if (!IN6_IS_ADDR_LOOPBACK(&sin6->sin6_addr) && !mapped_loopback)
            return ds41_fail(err, "TCP socket on %s is not loopback; ds41d serves TCP only on 127.0.0.0/8 and ::1",
                             l->address);
        return 0;
    }
    return ds41_fail(err, "socket of address family %d; ds41d serves AF_UNIX and loopback TCP only", ss.ss_family);
}

int ds41_sd_listen_fds(ds41_listener **out, size_t *n, ds41_error *err) {
    *out = NULL;
    *n = 0;
    char **names = NULL;
    int count = sd_listen_fds_with_names(1, &names);
    if (count < 0)
        return ds41_fail(err, "socket activation: malformed LISTEN_FDS/LISTEN_PID: %s", strerror(-count));
    int rc = 0;
    ds41_listener *ls = count > 0 ? calloc((size_t)count, sizeof *ls) : NULL;
    if (count > 0 && !ls) rc = ds41_fail(err, "socket activation: out of memory");
    for (int i = 0; rc == 0 && i < count; i++) {
        int fd = SD_LISTEN_FDS_START + i;
        ds41_listener *l = &ls[i];
        l->fd = fd;
        l->activated = true;
        if (names && names[i]) snprintf(l->name, sizeof l->name, "%s", names[i]);
        int r = sd_is_socket(fd, AF_UNSPEC, SOCK_STREAM, 1);
        if (r < 0) rc = ds41_fail(err, "%s", strerror(-r));
        else if (r == 0) rc = ds41_fail(err, "not a listening stream socket");
        else rc = describe_passed(fd, l, err);
        if (rc != 0)
            ds41_error_prefix(err, "socket activation: fd %d%s%s%s", fd, l->name[0] ? " ('" : "", l->name,
                              l->name[0] ? "')" : "");
    }
    if (names) {
        for (int i = 0; names[i]; i++) free(names[i]);
        free(names);
    }
    if (rc != 0) {
        free(ls); /* descriptors stay open: they are systemd's */
        return -1;
    }
    *out = ls;
    *n = (size_t)(count > 0 ? count : 0);
    return 0;
}
