/* ds41_sd: ds41d's side of the systemd service protocols, on libsystemd.
 *
 *  - Notifications (sd_notify(3)) to $NOTIFY_SOCKET, for Type=notify:
 *    STATUS= progress while loading and serving, READY=1 only once the model
 *    is loaded and the socket accepts connections, WATCHDOG=1 pings,
 *    RELOADING=1 on SIGHUP (with MONOTONIC_USEC=, which systemd >= 253 wants
 *    for Type=notify-reload; older systemd ignores it) followed by READY=1
 *    when done, STOPPING=1 on SIGTERM, EXTEND_TIMEOUT_USEC= while a long load
 *    keeps going.  Without $NOTIFY_SOCKET (not started by systemd) every
 *    notification is a successful no-op, so the daemon calls them
 *    unconditionally.
 *  - The watchdog interval (sd_watchdog_enabled(3)) from WatchdogSec=: ping
 *    at half of it, also while loading.
 *  - Socket activation (sd_listen_fds(3)): the listening sockets systemd
 *    passes, each checked to be a listening stream socket that is AF_UNIX or
 *    loopback TCP (127.0.0.0/8, ::1) — ds41d never serves a wider address,
 *    whatever a unit says.
 *
 * STATUS texts are single lines: control characters (a newline could smuggle
 * another assignment such as READY=1) are replaced by spaces.
 *
 * Functions return 0 / -1 and fill a ds41_error like the rest of ds41. */
#ifndef DS41_DAEMON_SYSTEMD_H
#define DS41_DAEMON_SYSTEMD_H

#include "config/error.h"
#include "daemon/listen.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Whether $NOTIFY_SOCKET is set (the daemon runs under a notify-type unit or
 * a test that listens). */
bool ds41_sd_notify_enabled(void);

/* Send `state` (newline-separated VAR=VALUE lines, sent as given) as one
 * notification.  0 when sent or when there is no $NOTIFY_SOCKET; -1 when
 * sending fails (the message names NOTIFY_SOCKET and the errno text). */
int ds41_sd_notify(const char *state, ds41_error *err);

/* "STATUS=<text>" (printf format, sanitized to one line, at most 1 KiB). */
int ds41_sd_status(ds41_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* "READY=1", plus "STATUS=<status>" when status is not NULL. */
int ds41_sd_ready(const char *status, ds41_error *err);

/* "RELOADING=1\nMONOTONIC_USEC=<CLOCK_MONOTONIC now, microseconds>". */
int ds41_sd_reloading(ds41_error *err);

/* "STOPPING=1". */
int ds41_sd_stopping(ds41_error *err);

/* "WATCHDOG=1". */
int ds41_sd_watchdog_ping(ds41_error *err);

/* "EXTEND_TIMEOUT_USEC=<usec>": ask for that much more start (or stop) time. */
int ds41_sd_extend_timeout(uint64_t usec, ds41_error *err);

/* The watchdog interval in microseconds from $WATCHDOG_USEC (and
 * $WATCHDOG_PID, which must name this process), 0 when the watchdog is off.
 * -1 when the variables are malformed. */
int ds41_sd_watchdog_usec(uint64_t *usec, ds41_error *err);

/* Take the sockets systemd passed (LISTEN_FDS / LISTEN_PID / LISTEN_FDNAMES;
 * the variables are unset afterwards so no child inherits them).  *n = 0 and
 * *out = NULL when there are none (or LISTEN_PID names another process).
 * Otherwise *out is a malloc'ed array of *n listeners (activated true, names
 * from LISTEN_FDNAMES, address from getsockname); free it with
 * ds41_listeners_close.  Fails, naming the descriptor, when one is not a
 * listening stream socket or is TCP on a non-loopback address; the passed
 * descriptors are then left open (they are systemd's; the caller exits). */
int ds41_sd_listen_fds(ds41_listener **out, size_t *n, ds41_error *err);

#endif
