/* ds41_preflight: every check ds41d's start makes before it binds a socket or
 * touches the state directory.  `ds41d --check-config` runs this same
 * function, so a configuration the check accepts does not then fail the start
 * on something the check could have seen (and the two cannot drift apart).
 *
 * Checked, in this order (the first failure is the error, naming the key and
 * the path or group):
 *  - listen.socket and listen.socket_group (only when ds41d creates its own
 *    socket, i.e. systemd passes none): ds41_listen_unix_check -- the group
 *    exists, the socket directory exists and is safe or can be created,
 *    nothing but a socket is at the path;
 *  - state_directory: a directory this process may write, or missing with a
 *    nearest existing ancestor it may create it in;
 *  - every models[] entry: its path is a checkpoint ds41d can open (its
 *    inference/config.json parses and validates, its safetensors shards open
 *    and their headers parse; ds41_model_config_load, ds41_checkpoint_open).
 * auth.admin_group naming no group is not an error (the start serves the
 * admin routes to root only); it is logged as a warning.
 *
 * Not checked: binding (a live daemon on the socket), the state directory's
 * lock (daemon/state_lock.h; a running daemon holds it while its successor's
 * configuration is checked), memory budgets decided at load. */
#ifndef DS41_DAEMON_PREFLIGHT_H
#define DS41_DAEMON_PREFLIGHT_H

#include "config/daemon_config.h"
#include "config/error.h"

#include <stdbool.h>
#include <sys/types.h>

typedef struct ds41_preflight_result {
    bool has_admin_gid; /* auth.admin_group exists: its gid below */
    gid_t admin_gid;
} ds41_preflight_result;

/* Whether systemd passes listening sockets to this process (LISTEN_PID is
 * this process and LISTEN_FDS is set): then listen.socket is not used. */
bool ds41_preflight_socket_activated(void);

/* Run the checks above on cfg (own_socket: check listen.socket and
 * listen.socket_group).  0 and *out filled, or -1 with err naming the key. */
int ds41_preflight(const ds41_daemon_config *cfg, bool own_socket, ds41_preflight_result *out,
                   ds41_error *err);

#endif
