/* Listening sockets for the HTTP server: the Unix socket (the normal way in)
 * and an optional loopback TCP socket.  The daemon uses these when systemd
 * does not pass sockets; tests use them to stand up a server. */
#ifndef DS41_IPC_UNIX_SOCKET_H
#define DS41_IPC_UNIX_SOCKET_H

#include <stdint.h>
#include <sys/types.h>

#include "config/error.h"

/* Create, bind and listen on a Unix stream socket at path (shorter than 108
 * bytes).  The file gets exactly `mode` (e.g. 0660) and, unless group is
 * (gid_t)-1, that group; until then it is accessible to its owner only, so
 * no client ever sees looser permissions.  A stale socket file at path (no
 * server accepts on it) is replaced; a live one ("another server is
 * running") or a file that is not a socket is an error and left alone.
 * Returns the fd (close-on-exec, blocking) or -1 with err filled. */
int ds41_unix_listen(const char *path, mode_t mode, gid_t group, int backlog, ds41_error *err);

/* Listen on host:port over TCP, where host must be a loopback address
 * ("127.0.0.1" or any 127.x.y.z, "::1", or "localhost" = 127.0.0.1); any
 * other host is refused, so the API is never exposed on the network by
 * accident.  port 0 picks a free port (read it with getsockname).  Returns
 * the fd or -1 with err filled. */
int ds41_tcp_listen_loopback(const char *host, uint16_t port, int backlog, ds41_error *err);

#endif
