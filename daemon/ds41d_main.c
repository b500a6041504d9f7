/* ds41d: the inference daemon (see ds41d(8)).  Foreground, systemd style: configuration, the
 * listening sockets (created, or passed by socket activation), the HTTP API (ipc/) over the
 * engine service (daemon/engine_service.h), sd_notify, signals. */
#include "config/daemon_config.h"
#include "daemon/engine_service.h"
#include "daemon/listen.h"
#include "daemon/log.h"
#include "daemon/preflight.h"
#include "daemon/state_lock.h"
#include "daemon/systemd.h"
#include "ds41_version.h"
#include "ipc/api.h"
#include "ipc/http_server.h"

#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: ds41d [--config FILE] [--socket PATH] [--model DIR [--name ID]] [--state-dir DIR]\n"
            "             [--check-config] | --help | --version\n"
            "\n"
            "The ds41 inference daemon: DeepSeek-V4.1-Flash with an OpenAI-compatible API over\n"
            "HTTP on a Unix socket.  Runs in the foreground; logs to stderr.\n"
            "  --config FILE    configuration (default %s)\n"
            "  --socket PATH    the Unix socket to create (overrides listen.socket)\n"
            "  --model DIR      serve this checkpoint (replaces `models`)\n"
            "  --name ID        the model id --model is served as (default %s)\n"
            "  --state-dir DIR  the state directory (overrides state_directory)\n"
            "  --check-config   print the effective configuration as YAML, then run every check\n"
            "                   a start runs except binding; exit 0 only when all pass\n"
            "  --version        print the version and exit\n"
            "Run by hand (no --config and no %s): built-in defaults with\n"
            "the socket private to you (mode 0600, no group) and, unless you are root, the\n"
            "state in $XDG_STATE_HOME/ds41d (else ~/.local/state/ds41d).  One daemon per state\n"
            "directory (a second one exits naming the first's pid).\n"
            "Signals: SIGHUP re-reads the configuration, SIGTERM/SIGINT drain and exit 0.\n"
            "See ds41d(8) and ds41d.yaml(5).\n",
            DS41_DAEMON_CONFIG_DEFAULT_PATH, DS41_DAEMON_CONFIG_REAL_MODEL_NAME,
            DS41_DAEMON_CONFIG_DEFAULT_PATH);
}

typedef struct options {
    const char *config;
    bool config_given;
    const char *socket;
    const char *model;
    const char *name; /* --name: the id --model is served as */
    const char *state_dir;
    bool check;
} options;

/* Read the configuration the way the options say (also on SIGHUP).  Run by hand (no --config and
 * no default file; the service always passes --config) the by-hand defaults apply: a private
 * socket, no group (ds41_daemon_config_defaults_by_hand).  *by_hand says which. */
static int load_config(const options *o, ds41_daemon_config *cfg, bool *by_hand, ds41_error *err) {
    struct stat st;
    *by_hand = !o->config_given && stat(o->config, &st) != 0 && errno == ENOENT;
    if (*by_hand) {
        if (ds41_daemon_config_defaults_by_hand(cfg, err) != 0) return -1;
    } else if (ds41_daemon_config_load(o->config, cfg, err) != 0) {
        return -1;
    }
    if (o->socket && ds41_daemon_config_set(cfg, "listen.socket", o->socket, err) != 0) goto fail;
    if (o->state_dir && ds41_daemon_config_set(cfg, "state_directory", o->state_dir, err) != 0) goto fail;
    if (o->model && ds41_daemon_config_set_model(cfg, o->name, o->model, err) != 0) goto fail;
    if (ds41_daemon_config_validate(cfg, err) != 0) goto fail;
    return 0;
fail:
    ds41_daemon_config_free(cfg);
    return -1;
}

static void on_progress(void *ctx, const char *model, ds41_model_state state, const char *detail) {
    (void)ctx;
    ds41_error e;
    if (state == DS41_MODEL_LOADING) {
        ds41_log(DS41_LOG_INFO, "model %s: %s", model, detail);
        if (ds41_sd_status(&e, "model %s: %s", model, detail) != 0) ds41_log(DS41_LOG_WARNING, "%s", e.msg);
    }
}

static void http_log(void *ctx, const char *message) {
    (void)ctx;
    ds41_log(DS41_LOG_DEBUG, "http: %s", message);
}

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void notify_or_log(int rc, const ds41_error *e) {
    if (rc != 0) ds41_log(DS41_LOG_WARNING, "sd_notify: %s", e->msg);
}

int main(int argc, char **argv) {
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'}, {"socket", required_argument, NULL, 's'},
        {"model", required_argument, NULL, 'm'},  {"check-config", no_argument, NULL, 'k'},
        {"help", no_argument, NULL, 'h'},         {"version", no_argument, NULL, 'V'},
        {"name", required_argument, NULL, 'n'},   {"state-dir", required_argument, NULL, 'd'},
        {NULL, 0, NULL, 0},
    };
    options o = {.config = DS41_DAEMON_CONFIG_DEFAULT_PATH};
    int c;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'c': o.config = optarg, o.config_given = true; break;
        case 's': o.socket = optarg; break;
        case 'm': o.model = optarg; break;
        case 'n': o.name = optarg; break;
        case 'd': o.state_dir = optarg; break;
        case 'k': o.check = true; break;
        case 'h': usage(stdout); return 0;
        case 'V': puts("ds41d " DS41_VERSION); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc) {
        usage(stderr);
        return 2;
    }
    if (o.name && !o.model) {
        fprintf(stderr, "ds41d: --name names the model of --model; give --model DIR too\n");
        return 2;
    }

    ds41_daemon_config cfg;
    ds41_error err = {{0}};
    bool by_hand;
    if (load_config(&o, &cfg, &by_hand, &err) != 0) {
        ds41_log(DS41_LOG_ERROR, "%s", err.msg);
        return 1;
    }
    /* The checks of a start (except binding): --check-config runs the same function. */
    ds41_preflight_result pre;
    if (o.check) {
        int rc = ds41_daemon_config_write_yaml(&cfg, stdout, &err);
        if (rc != 0) ds41_log(DS41_LOG_ERROR, "%s", err.msg);
        fflush(stdout);
        if (rc == 0 && (rc = ds41_preflight(&cfg, !ds41_preflight_socket_activated(), &pre, &err)) != 0)
            ds41_log(DS41_LOG_ERROR, "%s", err.msg);
        ds41_daemon_config_free(&cfg);
        return rc == 0 ? 0 : 1;
    }
    ds41_log_set_level(cfg.log.level);
    const char *source = by_hand ? "built-in defaults for a run by hand" : "built-in defaults";
    ds41_log(DS41_LOG_INFO, "starting (configuration: %s)", cfg.source ? cfg.source : source);
    if (ds41_preflight(&cfg, !ds41_preflight_socket_activated(), &pre, &err) != 0) {
        ds41_log(DS41_LOG_ERROR, "%s", err.msg);
        ds41_daemon_config_free(&cfg);
        return 1;
    }
    /* Before anything in the state directory is touched (the embedded model, snapshot clean-up),
     * and held until exit, reloads included. */
    int state_lock = ds41_state_lock_acquire(cfg.state_directory, &err);
    if (state_lock < 0) {
        ds41_log(DS41_LOG_ERROR, "%s", err.msg);
        ds41_daemon_config_free(&cfg);
        return 1;
    }

    /* Signals are taken synchronously by the main thread: block them before any thread exists
     * so every thread inherits the mask. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGHUP);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    int status = 1;
    ds41_listener *ls = NULL;
    size_t n_ls = 0;
    ds41_engine_service *svc = NULL;
    ds41_http_metrics *metrics = NULL;
    ds41_api *api = NULL;
    ds41_http_server *server = NULL;
    ds41_http_listener hl[8];

    notify_or_log(ds41_sd_status(&err, "starting"), &err);
    if (ds41_listeners_open(&cfg, &ls, &n_ls, &err) != 0) {
        ds41_log(DS41_LOG_ERROR, "%s", err.msg);
        goto out;
    }
    for (size_t i = 0; i < n_ls; i++)
        ds41_log(DS41_LOG_INFO, "listening on %s%s", ls[i].address[0] ? ls[i].address : "(unnamed socket)",
                 ls[i].activated ? " (socket activation)" : "");
    if (n_ls > 8) {
        ds41_log(DS41_LOG_ERROR, "%zu listening sockets: at most 8 are served", n_ls);
        goto out;
    }
    if (ds41_engine_service_new(&cfg, on_progress, NULL, &svc, &err) != 0) {
        ds41_log(DS41_LOG_ERROR, "%s", err.msg);
        goto out;
    }
    metrics = ds41_http_metrics_new();
    char responses_dir[4096];
    snprintf(responses_dir, sizeof responses_dir, "%s/responses", cfg.state_directory);
    ds41_api_options ao = {.max_body_bytes = (size_t)cfg.limits.max_body_bytes,
                           .responses_dir = responses_dir,
                           .responses_max_bytes = cfg.responses.max_bytes,
                           .responses_max_age_s = cfg.responses.max_age_s};
    if (!metrics || ds41_api_new(ds41_engine_service_iface(svc), metrics, &ao, &api, &err) != 0) {
        ds41_log(DS41_LOG_ERROR, "%s", metrics ? err.msg : "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n_ls; i++) hl[i] = (ds41_http_listener){.fd = ls[i].fd, .credless_class = DS41_AUTH_INFERENCE};
    ds41_http_config hc = {.listeners = hl,
                           .n_listeners = n_ls,
                           .has_admin_gid = pre.has_admin_gid,
                           .admin_gid = pre.admin_gid,
                           .request_timeout_ms = cfg.limits.idle_timeout_s * 1000u,
                           .idle_timeout_s = cfg.limits.stream_stall_timeout_s > cfg.limits.idle_timeout_s
                                                 ? cfg.limits.stream_stall_timeout_s
                                                 : cfg.limits.idle_timeout_s,
                           .log = http_log};
    if (ds41_http_server_start(&hc, ds41_api_router(api), &server, &err) != 0) {
        ds41_log(DS41_LOG_ERROR, "%s", err.msg);
        goto out;
    }
    if (ds41_engine_service_load(svc, NULL, &err) != 0) {
        ds41_log(DS41_LOG_ERROR, "%s", err.msg);
        goto out;
    }

    uint64_t wd_usec = 0;
    if (ds41_sd_watchdog_usec(&wd_usec, &err) != 0) ds41_log(DS41_LOG_WARNING, "%s", err.msg);
    const double wd_every = wd_usec ? (double)wd_usec / 2e6 : 0;
    double last_wd = 0, last_tick = mono_s(), last_extend = 0;
    bool ready = false;
    /* Once serving, nothing but SIGTERM/SIGINT ends the daemon: a default model that fails later
     * (a reload, a lost shard) is logged once while the other models keep serving. */
    bool served = false, failure_noted = false;
    unsigned drain_ms = cfg.limits.drain_timeout_s * 1000u;
    for (;;) {
        struct timespec wait = {.tv_sec = 0, .tv_nsec = 100 * 1000 * 1000};
        int sig = sigtimedwait(&sigs, NULL, &wait);
        double now = mono_s();
        if (wd_every > 0 && now - last_wd >= wd_every) {
            notify_or_log(ds41_sd_watchdog_ping(&err), &err);
            last_wd = now;
        }
        if (now - last_tick >= 1.0) {
            ds41_engine_service_tick(svc);
            last_tick = now;
        }
        char detail[256];
        ds41_model_state st = ds41_engine_service_default_state(svc, detail, sizeof detail);
        if (!ready && st == DS41_MODEL_READY) {
            ready = served = true;
            failure_noted = false;
            char line[320];
            snprintf(line, sizeof line, "serving on %s", ls[0].address[0] ? ls[0].address : "a passed socket");
            notify_or_log(ds41_sd_ready(line, &err), &err);
            ds41_log(DS41_LOG_INFO, "ready: %s", line);
        } else if (!ready && st == DS41_MODEL_FAILED && !served) {
            ds41_log(DS41_LOG_ERROR, "the default model failed to load: %s", detail);
            notify_or_log(ds41_sd_status(&err, "failed: %s", detail), &err);
            goto out;
        } else if (!ready && st == DS41_MODEL_FAILED) {
            if (!failure_noted)
                ds41_log(DS41_LOG_ERROR,
                         "the default model failed to load: %s (still serving the other models)", detail);
            if (!failure_noted) notify_or_log(ds41_sd_status(&err, "default model failed: %s", detail), &err);
            failure_noted = true;
        } else if (!ready && !served && now - last_extend >= 20.0) {
            /* a long load keeps asking for more start time */
            notify_or_log(ds41_sd_extend_timeout(60ull * 1000000ull, &err), &err);
            last_extend = now;
        }
        if (sig == SIGHUP) {
            notify_or_log(ds41_sd_reloading(&err), &err);
            ds41_log(DS41_LOG_INFO, "SIGHUP: reloading the configuration");
            ds41_daemon_config ncfg;
            char outcome[200] = "configuration reloaded";
            bool nby_hand;
            if (load_config(&o, &ncfg, &nby_hand, &err) != 0) {
                ds41_log(DS41_LOG_ERROR, "reload: %s (keeping the running configuration)", err.msg);
                snprintf(outcome, sizeof outcome, "reload failed, configuration kept: %.150s", err.msg);
            } else {
                if (strcmp(ncfg.listen.socket, cfg.listen.socket) != 0 ||
                    ncfg.listen.socket_mode != cfg.listen.socket_mode ||
                    (ncfg.listen.tcp == NULL) != (cfg.listen.tcp == NULL) ||
                    (ncfg.listen.tcp && strcmp(ncfg.listen.tcp, cfg.listen.tcp) != 0))
                    ds41_log(DS41_LOG_WARNING, "reload: listen.* changes take effect at the next start");
                /* the lock is on the directory of the start: a reload never moves the state */
                if (strcmp(ncfg.state_directory, cfg.state_directory) != 0) {
                    ds41_log(DS41_LOG_WARNING,
                             "reload: state_directory changes take effect at the next start");
                    if (ds41_daemon_config_set(&ncfg, "state_directory", cfg.state_directory, &err) != 0)
                        ds41_log(DS41_LOG_ERROR, "reload: %s", err.msg);
                }
                if (ds41_engine_service_reconfigure(svc, &ncfg, &err) != 0) {
                    ds41_log(
                        DS41_LOG_ERROR,
                        "reload: %s (keeping the running configuration: every model, request and socket)",
                        err.msg);
                    snprintf(outcome, sizeof outcome, "reload failed, configuration kept: %.150s", err.msg);
                    ds41_daemon_config_free(&ncfg);
                } else {
                    ds41_log_set_level(ncfg.log.level);
                    drain_ms = ncfg.limits.drain_timeout_s * 1000u;
                    ds41_daemon_config_free(&cfg);
                    cfg = ncfg;
                    ds41_log(DS41_LOG_INFO, "configuration reloaded");
                }
            }
            st = ds41_engine_service_default_state(svc, detail, sizeof detail);
            ready = st == DS41_MODEL_READY;
            failure_noted = false;
            char line[256];
            if (ready)
                snprintf(line, sizeof line, "serving (%s)", outcome);
            else
                snprintf(line, sizeof line, "%s; loading the default model", outcome);
            /* READY=1 ends the reload for systemd whatever its outcome: the daemon serves on */
            if (served)
                notify_or_log(ds41_sd_ready(line, &err), &err);
            else
                notify_or_log(ds41_sd_status(&err, "%s", line), &err);
        } else if (sig == SIGTERM || sig == SIGINT) {
            ds41_log(DS41_LOG_INFO, "%s: stopping (drain up to %u s)", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                     drain_ms / 1000);
            notify_or_log(ds41_sd_stopping(&err), &err);
            unsigned aborted = ds41_http_server_stop(server, drain_ms);
            server = NULL;
            if (aborted) ds41_log(DS41_LOG_WARNING, "%u requests were still running at the drain deadline", aborted);
            status = 0;
            break;
        }
    }
out:
    ds41_http_server_stop(server, 0);
    /* every accepted generation gets its terminal event (the api frees its state with it) */
    ds41_engine_service_free(svc, 0);
    ds41_api_free(api);
    ds41_http_metrics_free(metrics);
    ds41_listeners_close(ls, n_ls);
    ds41_daemon_config_free(&cfg);
    ds41_state_lock_release(state_lock);
    ds41_log(status == 0 ? DS41_LOG_INFO : DS41_LOG_ERROR, "exiting with status %d", status);
    return status;
}
