/* ds41_listen: the daemon's listening sockets, everything short of HTTP.
 *
 * ds41d listens on either
 *  - the sockets systemd passes (socket activation, ds41d.socket): each must
 *    be a listening stream socket, AF_UNIX or loopback TCP
 *    (ds41_sd_listen_fds in daemon/systemd.h checks them), or
 *  - its own Unix socket (listen.socket, mode listen.socket_mode, group
 *    listen.socket_group) plus, only when listen.tcp is configured, one
 *    loopback TCP socket.
 * ds41_listeners_open() makes that choice from the config.
 *
 * Creating the Unix socket safely:
 *  - the parent directory is created (mode 0755) when missing; an existing
 *    parent that others may write to without the sticky bit is refused, since
 *    another user could then swap the socket file between bind and chmod;
 *  - a file already at the path is removed only when it is a socket nobody
 *    listens on (a stale socket of an earlier run: connect() is refused); a
 *    socket that accepts connections ("another ds41d is running") or any
 *    other kind of file is an error and is left alone;
 *  - bind, then chmod to the mode and chown to the group (by name, getgrnam)
 *    BEFORE listen(), so no client can connect while the socket still has
 *    the umask's permissions;
 *  - the socket file's device and inode are recorded, and closing the
 *    listener unlinks the path only when it still is that same file.
 *
 * All descriptors are close-on-exec and blocking (the HTTP layer sets the
 * flags it needs).  No function logs: errors name the path, address or file
 * descriptor at fault, and the daemon logs them. */
#ifndef DS41_DAEMON_LISTEN_H
#define DS41_DAEMON_LISTEN_H

#include "config/daemon_config.h"
#include "config/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Room for a sun_path or "[IPv6]:port". */
#define DS41_LISTENER_ADDR_MAX 112

typedef struct ds41_listener {
    int fd;                            /* listening socket, -1 when closed */
    int family;                        /* AF_UNIX, AF_INET or AF_INET6 */
    bool activated;                    /* passed by systemd (not created by us) */
    char name[64];                     /* LISTEN_FDNAMES entry ("" when none) */
    char address[DS41_LISTENER_ADDR_MAX]; /* socket path ("" for an unnamed or
                                        * abstract one: "@name"), or
                                        * "127.0.0.1:8080" / "[::1]:8080" */
    bool owns_path;                    /* we created address's socket file */
    dev_t dev;                         /* ... its identity, for safe removal */
    ino_t ino;
} ds41_listener;

/* Create, bind and listen on a Unix stream socket at `path` as described
 * above.  mode: permission bits (<= 0777); group: group name, or NULL to keep
 * the creating process's group; backlog: listen(2) backlog (>= 1).  On success
 * *out describes the socket (owns_path true).  On failure nothing is left
 * behind (no descriptor, no new socket file). */
int ds41_listen_unix(const char *path, uint32_t mode, const char *group, int backlog, ds41_listener *out,
                     ds41_error *err);

/* The checks ds41_listen_unix makes before it creates anything, creating
 * nothing: the path is absolute and fits sun_path, the group (unless NULL)
 * exists, the parent directory exists, is safe as above and lets this process
 * create the socket -- or is missing and this process may create it (its own
 * parent is a directory it may write; one level, as ds41_listen_unix creates
 * one) -- and nothing but a socket is at the path.  A socket already there is
 * not probed: whether someone listens on it is a question of bind time.
 * ds41d's start and --check-config run it (daemon/preflight.h). */
int ds41_listen_unix_check(const char *path, const char *group, ds41_error *err);

/* The gid of a group name; fails naming the group when it does not exist. */
int ds41_listen_group_id(const char *group, gid_t *gid, ds41_error *err);

/* Create, bind and listen on a loopback TCP socket at `address`
 * ("127.0.0.1:8080", "[::1]:8080"; anything not loopback is refused, see
 * ds41_loopback_address_parse).  allow_port_0: accept port 0 (an ephemeral
 * port; tests use it) — out->address then holds the port actually bound.
 * SO_REUSEADDR is set; IPv6 sockets are IPv6-only. */
int ds41_listen_tcp(const char *address, int backlog, bool allow_port_0, ds41_listener *out, ds41_error *err);

/* Close the listener's descriptor and, when we created its socket file and
 * the path still is that file, unlink it.  Safe on a closed listener. */
void ds41_listener_close(ds41_listener *l);

/* The daemon's listeners for cfg: the sockets passed by systemd when there
 * are any (then listen.socket and listen.tcp are not used), else the Unix
 * socket of listen.* and, when listen.tcp is set, the loopback TCP socket.
 * On success *out is a malloc'ed array of *n >= 1 listeners (free with
 * ds41_listeners_close).  On failure nothing is left open except passed
 * sockets, which are systemd's (the caller exits). */
int ds41_listeners_open(const ds41_daemon_config *cfg, ds41_listener **out, size_t *n, ds41_error *err);

/* Close every listener (ds41_listener_close) and free the array. */
void ds41_listeners_close(ds41_listener *listeners, size_t n);

#endif
