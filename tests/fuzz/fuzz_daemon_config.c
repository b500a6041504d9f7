/* Fuzz target: ds41_daemon_config_parse over arbitrary bytes.
 *
 * Oracles beyond "no crash, no leak, no UB":
 *  - a failure always names the file (the message starts with the label);
 *  - a config that parses passes validate(), has a consistent default model,
 *    and dumps (write_yaml) to YAML that parses back to an equal config;
 *  - the same bytes as a command-line value for a few keys of different
 *    kinds either fail naming the key or leave a config that dumps and
 *    re-parses equal whenever it validates;
 *  - size and loopback-address parsers accept only what they round-trip. */
#include "config/daemon_config.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define LABEL "fuzz.yaml"

static void check_round_trip(const ds41_daemon_config *cfg) {
    char *out = NULL;
    size_t out_len = 0;
    FILE *f = open_memstream(&out, &out_len);
    if (!f) return;
    ds41_error err;
    int rc = ds41_daemon_config_write_yaml(cfg, f, &err);
    fclose(f);
    if (rc != 0) {
        fprintf(stderr, "write_yaml failed: %s\n", err.msg);
        abort();
    }
    ds41_daemon_config back;
    if (ds41_daemon_config_parse(out, out_len, "dump", &back, &err) != 0) {
        fprintf(stderr, "dumped config does not parse: %s\n%s\n", err.msg, out);
        abort();
    }
    if (!ds41_daemon_config_equal(cfg, &back)) {
        fprintf(stderr, "dumped config parses to a different config:\n%s\n", out);
        abort();
    }
    ds41_daemon_config_free(&back);
    free(out);
}

static void check_config(const ds41_daemon_config *cfg) {
    ds41_error err;
    if (ds41_daemon_config_validate(cfg, &err) != 0) {
        fprintf(stderr, "a parsed config fails validate: %s\n", err.msg);
        abort();
    }
    const ds41_daemon_model *d = ds41_daemon_config_default_model(cfg);
    if ((cfg->n_models == 0) != (d == NULL)) abort();
    if (cfg->n_models == 0 && !cfg->embedded_model.enabled) abort();
    if (cfg->listen.socket_mode > 0777 || (cfg->listen.socket_mode & 02)) abort();
    if (cfg->listen.tcp) {
        struct sockaddr_storage ss;
        socklen_t len;
        if (ds41_loopback_address_parse(cfg->listen.tcp, false, &ss, &len, &err) != 0) abort();
    }
    for (size_t i = 0; i < cfg->n_models; i++)
        if (!cfg->models[i].name || !cfg->models[i].path || cfg->models[i].path[0] != '/') abort();
    char dir[8192];
    if (ds41_daemon_config_embedded_dir(cfg, dir, sizeof dir, &err) != 0) abort();
    check_round_trip(cfg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds41_daemon_config cfg;
    ds41_error err;
    memset(&err, 0, sizeof err);
    if (ds41_daemon_config_parse((const char *)data, size, LABEL, &cfg, &err) == 0) {
        check_config(&cfg);
    } else if (strncmp(err.msg, LABEL, strlen(LABEL)) != 0) {
        fprintf(stderr, "an error does not name the file: %s\n", err.msg);
        abort();
    }
    ds41_daemon_config_free(&cfg);

    /* the same bytes as a command-line value */
    char *value = malloc(size + 1);
    if (!value) return 0;
    memcpy(value, data, size);
    value[size] = 0;
    static const char *const keys[] = {"listen.socket", "listen.socket_mode", "listen.tcp",
                                       "memory.kv_cache_bytes", "engine.threads", "log.level",
                                       "embedded_model.name", "auth.admin_group"};
    const char *key = keys[size % (sizeof keys / sizeof keys[0])];
    if (ds41_daemon_config_defaults(&cfg, &err) == 0) {
        int rc = (size & 1) ? ds41_daemon_config_set_model(&cfg, NULL, value, &err)
                            : ds41_daemon_config_set(&cfg, key, value, &err);
        if (rc == 0) {
            if (ds41_daemon_config_validate(&cfg, &err) == 0) check_config(&cfg);
        } else if (strncmp(err.msg, "key '", 5) != 0) {
            fprintf(stderr, "an override error does not name the key: %s\n", err.msg);
            abort();
        }
        ds41_daemon_config_free(&cfg);
    }

    uint64_t bytes;
    if (ds41_size_parse(value, &bytes, &err) == 0) {
        char text[64];
        uint64_t again;
        ds41_size_format(bytes, text, sizeof text);
        if (ds41_size_parse(text, &again, &err) != 0 || again != bytes) abort();
    }
    struct sockaddr_storage ss;
    socklen_t len = 0;
    if (ds41_loopback_address_parse(value, true, &ss, &len, &err) == 0 &&
        (len == 0 || (ss.ss_family != AF_INET && ss.ss_family != AF_INET6)))
        abort();
    free(value);
    return 0;
}
