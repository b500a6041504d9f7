/* ds41_preflight: the checks of ds41d's start, shared with --check-config.  See preflight.h. */
#include "daemon/preflight.h"

#include "config/model_config.h"
#include "daemon/listen.h"
#include "daemon/log.h"
#include "storage/safetensors.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

bool ds41_preflight_socket_activated(void) {
    /* 0: leave the variables for ds41_sd_listen_fds, which takes the sockets later */
    return sd_listen_fds(0) > 0;
}

/* state_directory: writable, or creatable (mkdir -p) from its nearest existing ancestor. */
static int check_state_dir(const char *dir, ds41_error *err) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path)
        return ds41_fail(err, "%s: path too long", dir);
    for (;;) {
        struct stat st;
        if (stat(path, &st) == 0) {
            if (!S_ISDIR(st.st_mode)) {
                if (strcmp(path, dir) == 0) return ds41_fail(err, "%s: not a directory", dir);
                return ds41_fail(err, "%s: cannot create it: %s is not a directory", dir, path);
            }
            if (access(path, W_OK | X_OK) != 0) {
                if (strcmp(path, dir) == 0)
                    return ds41_fail(err, "%s: not writable: %s", dir, strerror(errno));
                return ds41_fail(err, "%s: cannot create it in %s: %s", dir, path, strerror(errno));
            }
            return 0;
        }
        /* ENOTDIR: a file on the way, reported when the walk reaches it */
        if (errno != ENOENT && errno != ENOTDIR)
            return ds41_fail(err, "%s: %s: %s", dir, path, strerror(errno));
        char *slash = strrchr(path, '/');
        if (!slash) return ds41_fail(err, "%s: not an absolute path", dir);
        if (slash == path)
            slash[1] = 0; /* "/" */
        else
            *slash = 0;
    }
}

/* A models[] entry: a checkpoint the loader can open. */
static int check_model(const ds41_daemon_model *m, ds41_error *err) {
    struct stat st;
    if (stat(m->path, &st) != 0) return ds41_fail(err, "%s: %s", m->path, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return ds41_fail(err, "%s: not a directory", m->path);
    ds41_model_config mc;
    if (ds41_model_config_load(m->path, &mc, err) != 0)
        return ds41_error_prefix(err, "%s is not a ds41 checkpoint", m->path);
    ds41_model_config_free(&mc);
    ds41_checkpoint *ck = ds41_checkpoint_open(m->path, err);
    if (!ck) return ds41_error_prefix(err, "%s: cannot open the checkpoint", m->path);
    ds41_checkpoint_close(ck);
    return 0;
}

int ds41_preflight(const ds41_daemon_config *cfg, bool own_socket, ds41_preflight_result *out,
                   ds41_error *err) {
    *out = (ds41_preflight_result){0};
    if (own_socket) {
        gid_t gid;
        if (cfg->listen.socket_group && ds41_listen_group_id(cfg->listen.socket_group, &gid, err) != 0)
            return ds41_error_prefix(err, "key 'listen.socket_group'");
        if (ds41_listen_unix_check(cfg->listen.socket, NULL, err) != 0)
            return ds41_error_prefix(err, "key 'listen.socket'");
    }
    if (check_state_dir(cfg->state_directory, err) != 0)
        return ds41_error_prefix(err, "key 'state_directory'");
    for (size_t i = 0; i < cfg->n_models; i++)
        if (check_model(&cfg->models[i], err) != 0)
            return ds41_error_prefix(err, "key 'models[%zu].path' (model %s)", i, cfg->models[i].name);
    if (cfg->auth.admin_group) {
        ds41_error e;
        if (ds41_listen_group_id(cfg->auth.admin_group, &out->admin_gid, &e) == 0)
            out->has_admin_gid = true;
        else
            ds41_log(DS41_LOG_WARNING, "auth.admin_group '%s' does not exist: admin routes are for root only",
                     cfg->auth.admin_group);
    }
    return 0;
}
