/* ds41_daemon_config: YAML config of the daemon.  See daemon_config.h.
 *
 * One table (keys[]) describes every key: where it lives in the struct, its
 * value kind and range.  The libyaml event parser walks the file against the
 * table; set(), write_yaml(), equal() and the key list are driven by the same
 * table, so a key cannot be documented in one place and missing in another. */
#include "config/daemon_config.h"
#include "config/utf8.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <yaml.h>

const char *ds41_cfg_backend_name(ds41_cfg_backend b) {
    static const char *const n[] = {"auto", "cpu", "cuda", "cuda-emu"};
    return (unsigned)b < sizeof n / sizeof n[0] ? n[b] : "?";
}

/* ---- the schema ---------------------------------------------------------- */

typedef enum value_kind {
    V_PATH,        /* absolute path, normalized */
    V_SOCKET_PATH, /* absolute path that fits sun_path */
    V_GROUP,       /* group name */
    V_MODE,        /* octal permission bits */
    V_TCP,         /* loopback ADDRESS:PORT */
    V_UINT,        /* decimal integer in [min, max] */
    V_SIZE,        /* bytes, with units; "auto" = 0 when auto_zero */
    V_BOOL,
    V_ENUM,        /* one of names[], stored as int */
    V_NAME,        /* served model id */
    V_EMBED_NAME,  /* served id of the embedded model (not "deepseek...") */
    V_PRESET,      /* one of presets[], stored as an owned string */
} value_kind;

typedef struct key_desc {
    const char *dotted;  /* "listen.socket", "models[].path" */
    const char *section; /* NULL: top level; "models[]": a models entry */
    const char *name;
    value_kind kind;
    size_t offset; /* into ds41_daemon_config, or ds41_daemon_model for models[] */
    size_t width;  /* sizeof the field */
    uint64_t min, max;
    bool nullable;  /* null accepted (string kinds store NULL) */
    bool auto_zero; /* V_SIZE: "auto" accepted, stored as 0 */
    const char *const *names;
} key_desc;

static const char *const engine_modes[] = {"fast", "reference", NULL};
static const char *const engine_backends[] = {"auto", "cpu", "cuda", "cuda-emu", NULL};
static const char *const log_levels[] = {"error", "warning", "info", "debug", NULL};
/* ds41-mkmodel's presets (engine/model/model_gen.h); the config layer cannot
 * include the engine, so the list is repeated here for line:column errors. */
static const char *const presets[] = {"tiny", "long", "bench", NULL};

#define MODELS_SECTION "models[]"
#define CFG(f) offsetof(ds41_daemon_config, f), sizeof(((ds41_daemon_config *)0)->f)
#define MDL(f) offsetof(ds41_daemon_model, f), sizeof(((ds41_daemon_model *)0)->f)

static const key_desc keys[] = {
    {"listen.socket", "listen", "socket", V_SOCKET_PATH, CFG(listen.socket), 0, 0, false, false, NULL},
    {"listen.socket_mode", "listen", "socket_mode", V_MODE, CFG(listen.socket_mode), 0, 0777, false, false, NULL},
    {"listen.socket_group", "listen", "socket_group", V_GROUP, CFG(listen.socket_group), 0, 0, true, false, NULL},
    {"listen.backlog", "listen", "backlog", V_UINT, CFG(listen.backlog), 1, 65535, false, false, NULL},
    {"listen.tcp", "listen", "tcp", V_TCP, CFG(listen.tcp), 0, 0, true, false, NULL},
    {"auth.admin_group", "auth", "admin_group", V_GROUP, CFG(auth.admin_group), 0, 0, true, false, NULL},
    {"state_directory", NULL, "state_directory", V_PATH, CFG(state_directory), 0, 0, false, false, NULL},
    {"models[].name", MODELS_SECTION, "name", V_NAME, MDL(name), 0, 0, false, false, NULL},
    {"models[].path", MODELS_SECTION, "path", V_PATH, MDL(path), 0, 0, false, false, NULL},
    {"models[].default", MODELS_SECTION, "default", V_BOOL, MDL(is_default), 0, 0, false, false, NULL},
    {"embedded_model.enabled", "embedded_model", "enabled", V_BOOL, CFG(embedded_model.enabled), 0, 0, false, false,
     NULL},
    {"embedded_model.name", "embedded_model", "name", V_EMBED_NAME, CFG(embedded_model.name), 0, 0, false, false,
     NULL},
    {"embedded_model.preset", "embedded_model", "preset", V_PRESET, CFG(embedded_model.preset), 0, 0, false, false,
     presets},
    {"embedded_model.seed", "embedded_model", "seed", V_UINT, CFG(embedded_model.seed), 0, UINT64_MAX, false, false,
     NULL},
    {"engine.threads", "engine", "threads", V_UINT, CFG(engine.threads), 0, 4096, false, false, NULL},
    {"engine.mode", "engine", "mode", V_ENUM, CFG(engine.mode), 0, 0, false, false, engine_modes},
    {"engine.backend", "engine", "backend", V_ENUM, CFG(engine.backend), 0, 0, false, false, engine_backends},
    {"engine.cuda_device", "engine", "cuda_device", V_UINT, CFG(engine.cuda_device), 0, 1023, false, false, NULL},
    {"engine.max_sequences", "engine", "max_sequences", V_UINT, CFG(engine.max_sequences), 1, 4096, false, false,
     NULL},
    {"engine.max_batch_tokens", "engine", "max_batch_tokens", V_UINT, CFG(engine.max_batch_tokens), 1, 1048576, false,
     false, NULL},
    {"engine.prefill_chunk", "engine", "prefill_chunk", V_UINT, CFG(engine.prefill_chunk), 1, 1048576, false, false,
     NULL},
    {"engine.speculative", "engine", "speculative", V_BOOL, CFG(engine.speculative), 0, 0, false, false, NULL},
    {"engine.speculative_max_draft", "engine", "speculative_max_draft", V_UINT, CFG(engine.speculative_max_draft), 1, 8,
     false, false, NULL},
    {"engine.speculative_min_confidence_pct", "engine", "speculative_min_confidence_pct", V_UINT,
     CFG(engine.speculative_min_confidence_pct), 0, 100, false, false, NULL},
    {"engine.test_forced_output", "engine", "test_forced_output", V_BOOL, CFG(engine.test_forced_output), 0, 0, false,
     false, NULL},
    {"engine.test_fault_expert_read", "engine", "test_fault_expert_read", V_UINT, CFG(engine.test_fault_expert_read), 0,
     UINT64_MAX, false, false, NULL},
    {"memory.kv_cache_bytes", "memory", "kv_cache_bytes", V_SIZE, CFG(memory.kv_cache_bytes), 0, UINT64_MAX, false,
     true, NULL},
    {"memory.expert_cache_bytes", "memory", "expert_cache_bytes", V_SIZE, CFG(memory.expert_cache_bytes), 0,
     UINT64_MAX, false, true, NULL},
    {"memory.engram_cache_bytes", "memory", "engram_cache_bytes", V_SIZE, CFG(memory.engram_cache_bytes), 0,
     UINT64_MAX, false, true, NULL},
    {"memory.host_expert_cache_bytes", "memory", "host_expert_cache_bytes", V_SIZE,
     CFG(memory.host_expert_cache_bytes), 0, UINT64_MAX, false, false, NULL},
    {"limits.max_body_bytes", "limits", "max_body_bytes", V_SIZE, CFG(limits.max_body_bytes), 1024, 1u << 30, false,
     false, NULL},
    {"limits.max_queue", "limits", "max_queue", V_UINT, CFG(limits.max_queue), 1, 1000000, false, false, NULL},
    {"limits.max_tokens_default", "limits", "max_tokens_default", V_UINT, CFG(limits.max_tokens_default), 1,
     16777216, false, false, NULL},
    {"limits.max_context", "limits", "max_context", V_UINT, CFG(limits.max_context), 0, 16777216, false, false,
     NULL},
    {"limits.request_timeout_s", "limits", "request_timeout_s", V_UINT, CFG(limits.request_timeout_s), 0, 604800,
     false, false, NULL},
    {"limits.idle_timeout_s", "limits", "idle_timeout_s", V_UINT, CFG(limits.idle_timeout_s), 1, 86400, false, false,
     NULL},
    {"limits.stream_stall_timeout_s", "limits", "stream_stall_timeout_s", V_UINT,
     CFG(limits.stream_stall_timeout_s), 1, 86400, false, false, NULL},
    {"limits.drain_timeout_s", "limits", "drain_timeout_s", V_UINT, CFG(limits.drain_timeout_s), 0, 3600, false,
     false, NULL},
    {"prefix_cache.enabled", "prefix_cache", "enabled", V_BOOL, CFG(prefix_cache.enabled), 0, 0, false, false, NULL},
    {"prefix_cache.max_bytes", "prefix_cache", "max_bytes", V_SIZE, CFG(prefix_cache.max_bytes), 0, UINT64_MAX, false,
     true, NULL},
    {"prefix_cache.share_across_users", "prefix_cache", "share_across_users", V_BOOL,
     CFG(prefix_cache.share_across_users), 0, 0, false, false, NULL},
    {"snapshots.enabled", "snapshots", "enabled", V_BOOL, CFG(snapshots.enabled), 0, 0, false, false, NULL},
    {"snapshots.max_bytes", "snapshots", "max_bytes", V_SIZE, CFG(snapshots.max_bytes), 0, UINT64_MAX, false, false,
     NULL},
    {"snapshots.test_save_delay_ms", "snapshots", "test_save_delay_ms", V_UINT, CFG(snapshots.test_save_delay_ms), 0,
     600000, false, false, NULL},
    {"responses.max_bytes", "responses", "max_bytes", V_SIZE, CFG(responses.max_bytes), 0, UINT64_MAX, false, false,
     NULL},
    {"responses.max_age_s", "responses", "max_age_s", V_UINT, CFG(responses.max_age_s), 0, 315360000, false, false,
     NULL},
    {"log.level", "log", "level", V_ENUM, CFG(log.level), 0, 0, false, false, log_levels},
};
#define N_KEYS (sizeof keys / sizeof keys[0])

/* get_uint/put_uint tell field types apart by width. */
_Static_assert(sizeof(ds41_engine_mode) == sizeof(uint32_t) && sizeof(ds41_cfg_backend) == sizeof(uint32_t) &&
                   sizeof(ds41_log_level) == sizeof(uint32_t),
               "enum fields are 4 bytes");
_Static_assert(sizeof(bool) == 1, "bool fields are 1 byte");

/* Top-level keys in schema order: sections, the scalar state_directory and
 * the models sequence. */
static const char *const root_keys[] = {"listen", "auth",   "state_directory", "models",       "embedded_model",
                                        "engine", "memory", "limits",          "prefix_cache", "snapshots", "responses", "log"};
#define N_ROOT (sizeof root_keys / sizeof root_keys[0])

/* Most entries `models` may have. */
#define MAX_MODELS 1024
#define MAX_NAME_LEN 128
#define MAX_GROUP_LEN 32
#define MAX_PATH_LEN 4095

static int key_index(const char *section, const char *name, size_t name_len) {
    for (size_t i = 0; i < N_KEYS; i++) {
        bool same_section = section ? (keys[i].section && strcmp(keys[i].section, section) == 0) : !keys[i].section;
        if (same_section && strlen(keys[i].name) == name_len && memcmp(keys[i].name, name, name_len) == 0)
            return (int)i;
    }
    return -1;
}

static int key_index_dotted(const char *dotted) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (strcmp(keys[i].dotted, dotted) == 0) return (int)i;
    return -1;
}

size_t ds41_daemon_config_key_count(void) {
    return N_KEYS;
}

const char *ds41_daemon_config_key_name(size_t index) {
    return index < N_KEYS ? keys[index].dotted : NULL;
}

/* ---- field access -------------------------------------------------------- */

static char **str_field(void *base, const key_desc *d) {
    return (char **)((char *)base + d->offset);
}

static uint64_t get_uint(const void *base, const key_desc *d) {
    const char *p = (const char *)base + d->offset;
    if (d->width == sizeof(uint64_t)) {
        uint64_t v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    if (d->width == sizeof(uint32_t)) { /* uint32_t fields and enums (int, never negative) */
        uint32_t v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    bool v;
    memcpy(&v, p, sizeof v);
    return v;
}

static void put_uint(void *base, const key_desc *d, uint64_t v) {
    char *p = (char *)base + d->offset;
    if (d->width == sizeof(uint64_t)) {
        memcpy(p, &v, sizeof v);
    } else if (d->width == sizeof(uint32_t) && (d->kind == V_UINT || d->kind == V_MODE)) {
        uint32_t w = (uint32_t)v;
        memcpy(p, &w, sizeof w);
    } else if (d->width == sizeof(bool)) {
        bool b = v != 0;
        memcpy(p, &b, sizeof b);
    } else {
        int e = (int)v;
        memcpy(p, &e, sizeof e);
    }
}

static bool is_string_kind(value_kind k) {
    return k == V_PATH || k == V_SOCKET_PATH || k == V_GROUP || k == V_TCP || k == V_NAME || k == V_EMBED_NAME ||
           k == V_PRESET;
}

/* ---- scalar values --------------------------------------------------------- */

/* A converted scalar, not yet stored: either a number or an owned string. */
typedef struct value {
    bool is_null;
    uint64_t num;
    char *str;
} value;

/* Printable, truncated rendering of a scalar for messages. */
static void show(const char *text, size_t len, char *out, size_t size) {
    size_t o = 0;
    for (size_t i = 0; i < len && o + 5 < size; i++) {
        unsigned char c = (unsigned char)text[i];
        if (i == 48) {
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        if (c < 0x20 || c == 0x7f) o += (size_t)snprintf(out + o, size - o, "\\x%02x", c);
        else out[o++] = (char)c;
    }
    out[o] = 0;
}

static bool is_null_text(const char *t, size_t len) {
    return len == 0 || (len == 1 && t[0] == '~') || (len == 4 && (!memcmp(t, "null", 4) || !memcmp(t, "Null", 4) ||
                                                                  !memcmp(t, "NULL", 4)));
}

/* Plain decimal digits, no leading zero (YAML 1.1 would read 010 as octal). */
static int parse_decimal(const char *t, size_t len, uint64_t *out, ds41_error *err) {
    char shown[80];
    show(t, len, shown, sizeof shown);
    if (len == 0) return ds41_fail(err, "expected a decimal integer, got an empty value");
    uint64_t v = 0;
    for (size_t i = 0; i < len; i++) {
        if (t[i] < '0' || t[i] > '9') return ds41_fail(err, "expected a decimal integer, got '%s'", shown);
        unsigned d = (unsigned)(t[i] - '0');
        if (v > (UINT64_MAX - d) / 10) return ds41_fail(err, "'%s' is too large", shown);
        v = v * 10 + d;
    }
    if (len > 1 && t[0] == '0')
        return ds41_fail(err, "'%s' has a leading zero, which YAML 1.1 reads as octal; write it without", shown);
    *out = v;
    return 0;
}

typedef struct size_unit {
    const char *name;
    uint64_t mult;
} size_unit;

static const size_unit size_units[] = {
    {"b", 1},
    {"kb", 1000ull},
    {"mb", 1000ull * 1000},
    {"gb", 1000ull * 1000 * 1000},
    {"tb", 1000ull * 1000 * 1000 * 1000},
    {"pb", 1000ull * 1000 * 1000 * 1000 * 1000},
    {"kib", 1ull << 10},
    {"mib", 1ull << 20},
    {"gib", 1ull << 30},
    {"tib", 1ull << 40},
    {"pib", 1ull << 50},
};

static int size_parse_n(const char *t, size_t len, uint64_t *bytes, ds41_error *err) {
    char shown[80];
    show(t, len, shown, sizeof shown);
    size_t i = 0;
    uint64_t whole = 0;
    size_t whole_start = i;
    while (i < len && t[i] >= '0' && t[i] <= '9') {
        unsigned d = (unsigned)(t[i] - '0');
        if (whole > (UINT64_MAX - d) / 10) return ds41_fail(err, "size '%s' is too large", shown);
        whole = whole * 10 + d;
        i++;
    }
    size_t whole_len = i - whole_start;
    if (whole_len == 0)
        return ds41_fail(err, "expected a size (bytes, or a number with a unit such as 512MiB or 8GB), got '%s'",
                         shown);
    if (whole_len > 1 && t[whole_start] == '0')
        return ds41_fail(err, "size '%s' has a leading zero; write it without", shown);
    uint64_t frac = 0, frac_scale = 1;
    if (i < len && t[i] == '.') {
        i++;
        size_t fs = i;
        while (i < len && t[i] >= '0' && t[i] <= '9') {
            if (i - fs >= 18) return ds41_fail(err, "size '%s' has too many decimals", shown);
            frac = frac * 10 + (uint64_t)(t[i] - '0');
            frac_scale *= 10;
            i++;
        }
        if (i == fs) return ds41_fail(err, "size '%s' has no digits after the decimal point", shown);
    }
    while (i < len && t[i] == ' ') i++;
    size_t unit_len = len - i;
    uint64_t mult = 1;
    if (unit_len > 0) {
        bool found = false;
        for (size_t u = 0; u < sizeof size_units / sizeof size_units[0] && !found; u++) {
            if (strlen(size_units[u].name) == unit_len && strncasecmp(t + i, size_units[u].name, unit_len) == 0) {
                mult = size_units[u].mult;
                found = true;
            }
        }
        if (!found)
            return ds41_fail(err,
                             "size '%s' has an unknown unit (use B, KB, MB, GB, TB, PB for powers of 1000 or "
                             "KiB, MiB, GiB, TiB, PiB for powers of 1024)",
                             shown);
    }
    unsigned __int128 total = (unsigned __int128)whole * mult;
    unsigned __int128 frac_bytes = (unsigned __int128)frac * mult;
    if (frac_bytes % frac_scale != 0) return ds41_fail(err, "size '%s' is not a whole number of bytes", shown);
    total += frac_bytes / frac_scale;
    if (total > UINT64_MAX) return ds41_fail(err, "size '%s' is too large", shown);
    *bytes = (uint64_t)total;
    return 0;
}

int ds41_size_parse(const char *text, uint64_t *bytes, ds41_error *err) {
    if (!text) return ds41_fail(err, "expected a size, got nothing");
    return size_parse_n(text, strlen(text), bytes, err);
}

void ds41_size_format(uint64_t bytes, char *buf, size_t size) {
    static const char *const names[] = {"PiB", "TiB", "GiB", "MiB", "KiB"};
    static const unsigned shifts[] = {50, 40, 30, 20, 10};
    for (size_t u = 0; bytes != 0 && u < 5; u++) {
        uint64_t m = 1ull << shifts[u];
        if (bytes % m == 0) {
            snprintf(buf, size, "%llu%s", (unsigned long long)(bytes / m), names[u]);
            return;
        }
    }
    snprintf(buf, size, "%llu", (unsigned long long)bytes);
}

static void size_show(uint64_t v, char *buf, size_t size) {
    ds41_size_format(v, buf, size);
}

static bool has_control(const char *t, size_t len) {
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)t[i] < 0x20 || t[i] == 0x7f) return true;
    return false;
}

/* Absolute path -> "/a/b/c" (single slashes, no trailing slash).  "." and
 * ".." are refused rather than resolved: these paths bound what clients can
 * make the daemon read. */
static int normalize_path(const char *t, size_t len, size_t max_len, char **out, ds41_error *err) {
    char shown[80];
    show(t, len, shown, sizeof shown);
    if (len == 0 || t[0] != '/') return ds41_fail(err, "expected an absolute path, got '%s'", shown);
    if (has_control(t, len)) return ds41_fail(err, "path '%s' contains control characters", shown);
    char *p = malloc(len + 1);
    if (!p) return ds41_fail(err, "out of memory");
    size_t o = 0, i = 0;
    while (i < len) {
        while (i < len && t[i] == '/') i++;
        size_t s = i;
        while (i < len && t[i] != '/') i++;
        size_t n = i - s;
        if (n == 0) break;
        if ((n == 1 && t[s] == '.') || (n == 2 && t[s] == '.' && t[s + 1] == '.')) {
            free(p);
            return ds41_fail(err, "path '%s' has a '.' or '..' component; write the path without them", shown);
        }
        p[o++] = '/';
        memcpy(p + o, t + s, n);
        o += n;
    }
    if (o == 0) {
        free(p);
        return ds41_fail(err, "the root directory '/' is not allowed here");
    }
    p[o] = 0;
    if (o > max_len) {
        free(p);
        return ds41_fail(err, "path '%s' is %zu bytes long; the limit is %zu", shown, o, max_len);
    }
    *out = p;
    return 0;
}

static int check_group(const char *t, size_t len, ds41_error *err) {
    char shown[80];
    show(t, len, shown, sizeof shown);
    bool ok = len >= 1 && len <= MAX_GROUP_LEN && (isalpha((unsigned char)t[0]) || t[0] == '_');
    for (size_t i = 1; ok && i < len; i++) {
        unsigned char c = (unsigned char)t[i];
        bool last_dollar = c == '$' && i == len - 1;
        ok = isalnum(c) || c == '_' || c == '.' || c == '-' || last_dollar;
    }
    if (!ok)
        return ds41_fail(err,
                         "expected a group name (a letter or '_', then letters, digits, '_', '.', '-'; at most %d), "
                         "got '%s'",
                         MAX_GROUP_LEN, shown);
    return 0;
}

static int check_name(const char *t, size_t len, bool embedded, ds41_error *err) {
    char shown[80];
    show(t, len, shown, sizeof shown);
    bool ok = len >= 1 && len <= MAX_NAME_LEN && isalnum((unsigned char)t[0]);
    for (size_t i = 1; ok && i < len; i++) {
        unsigned char c = (unsigned char)t[i];
        ok = isalnum(c) || c == '.' || c == '_' || c == ':' || c == '-';
    }
    if (!ok)
        return ds41_fail(err,
                         "expected a model name (1-%d of A-Z a-z 0-9 . _ : -, starting with a letter or digit), "
                         "got '%s'",
                         MAX_NAME_LEN, shown);
    if (embedded && len >= 8 && strncasecmp(t, "deepseek", 8) == 0)
        return ds41_fail(err, "'%s': the embedded model must not be served under a DeepSeek name", shown);
    return 0;
}

static int parse_mode(const char *t, size_t len, uint64_t *out, ds41_error *err) {
    char shown[80];
    show(t, len, shown, sizeof shown);
    size_t s = 0;
    if (len >= 2 && t[0] == '0' && (t[1] == 'o' || t[1] == 'O')) s = 2;
    size_t n = len - s;
    bool ok = n == 3 || (n == 4 && t[s] == '0');
    uint64_t v = 0;
    for (size_t i = s; ok && i < len; i++) {
        ok = t[i] >= '0' && t[i] <= '7';
        v = v * 8 + (uint64_t)(t[i] - '0');
    }
    if (!ok) return ds41_fail(err, "expected an octal mode such as \"0660\", got '%s'", shown);
    if (v & 02)
        return ds41_fail(err,
                         "mode %04llo lets every local user connect; grant access through listen.socket_group instead",
                         (unsigned long long)v);
    *out = v;
    return 0;
}

int ds41_loopback_address_parse(const char *text, bool allow_port_0, struct sockaddr_storage *addr,
                                socklen_t *addr_len, ds41_error *err) {
    if (!text) return ds41_fail(err, "expected ADDRESS:PORT, got nothing");
    char shown[80];
    size_t len = strlen(text);
    show(text, len, shown, sizeof shown);
    char host[64];
    const char *port;
    if (text[0] == '[') {
        const char *close = strchr(text, ']');
        if (!close || close[1] != ':') return ds41_fail(err, "expected [IPV6]:PORT, got '%s'", shown);
        size_t hl = (size_t)(close - text - 1);
        if (hl >= sizeof host) return ds41_fail(err, "'%s' is not an IP address", shown);
        memcpy(host, text + 1, hl);
        host[hl] = 0;
        port = close + 2;
    } else {
        const char *colon = strrchr(text, ':');
        if (!colon) return ds41_fail(err, "expected ADDRESS:PORT (e.g. 127.0.0.1:8080), got '%s'", shown);
        size_t hl = (size_t)(colon - text);
        if (memchr(text, ':', hl)) return ds41_fail(err, "IPv6 addresses need brackets ([::1]:PORT), got '%s'", shown);
        if (hl >= sizeof host) return ds41_fail(err, "'%s' is not an IP address", shown);
        memcpy(host, text, hl);
        host[hl] = 0;
        port = colon + 1;
    }
    size_t plen = strlen(port);
    uint64_t pv = 0;
    bool port_ok = plen >= 1 && plen <= 5;
    for (size_t i = 0; port_ok && i < plen; i++) {
        port_ok = port[i] >= '0' && port[i] <= '9';
        pv = pv * 10 + (uint64_t)(port[i] - '0');
    }
    if (!port_ok || pv > 65535 || (pv == 0 && !allow_port_0) || (plen > 1 && port[0] == '0'))
        return ds41_fail(err, "'%s': the port must be a decimal number from 1 to 65535", shown);

    memset(addr, 0, sizeof *addr);
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1) {
        if ((ntohl(a4.s_addr) >> 24) != 127)
            return ds41_fail(err,
                             "'%s' is not a loopback address: only 127.0.0.0/8 and [::1] are allowed (TCP peers "
                             "cannot be authenticated; use the Unix socket for remote access through a proxy)",
                             shown);
        struct sockaddr_in *sin = (struct sockaddr_in *)addr;
        sin->sin_family = AF_INET;
        sin->sin_port = htons((uint16_t)pv);
        sin->sin_addr = a4;
        *addr_len = sizeof *sin;
        return 0;
    }
    if (inet_pton(AF_INET6, host, &a6) == 1) {
        bool mapped_loopback = IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127;
        if (!IN6_IS_ADDR_LOOPBACK(&a6) && !mapped_loopback)
            return ds41_fail(err,
                             "'%s' is not a loopback address: only 127.0.0.0/8 and [::1] are allowed (TCP peers "
                             "cannot be authenticated; use the Unix socket for remote access through a proxy)",
                             shown);
        struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)addr;
        sin6->sin6_family = AF_INET6;
        sin6->sin6_port = htons((uint16_t)pv);
        sin6->sin6_addr = a6;
        *addr_len = sizeof *sin6;
        return 0;
    }
    return ds41_fail(err, "'%s' is not an IP address (host names are not resolved: use 127.0.0.1 or [::1])", shown);
}

static char *dup_n(const char *t, size_t len) {
    char *s = malloc(len + 1);
    if (s) {
        memcpy(s, t, len);
        s[len] = 0;
    }
    return s;
}

/* Convert one scalar for key d.  `plain`: the scalar was unquoted (only then
 * can it be null).  On success *v holds the value (v->str owned). */
static int convert(const key_desc *d, const char *t, size_t len, bool plain, value *v, ds41_error *err) {
    memset(v, 0, sizeof *v);
    char shown[80];
    show(t, len, shown, sizeof shown);
    if (memchr(t, 0, len)) return ds41_fail(err, "the value contains a NUL byte");
    /* YAML files are always valid UTF-8 by the time libyaml hands out a scalar; command-line
     * values need the check, and the YAML emitter of --check-config refuses anything else. */
    if (!ds41_utf8_valid(t, len, NULL)) return ds41_fail(err, "the value '%s' is not valid UTF-8", shown);
    if (plain && is_null_text(t, len)) {
        if (d->nullable) {
            v->is_null = true;
            return 0;
        }
        return ds41_fail(err, "a value is required here (null is not allowed)");
    }
    switch (d->kind) {
    case V_PATH:
    case V_SOCKET_PATH: {
        size_t max = d->kind == V_SOCKET_PATH ? sizeof(((struct sockaddr_un *)0)->sun_path) - 1 : MAX_PATH_LEN;
        return normalize_path(t, len, max, &v->str, err);
    }
    case V_GROUP:
        if (check_group(t, len, err) != 0) return -1;
        break;
    case V_NAME:
    case V_EMBED_NAME:
        if (check_name(t, len, d->kind == V_EMBED_NAME, err) != 0) return -1;
        break;
    case V_TCP: {
        if (has_control(t, len) || len > 64) return ds41_fail(err, "'%s' is not an ADDRESS:PORT", shown);
        char buf[80];
        memcpy(buf, t, len);
        buf[len] = 0;
        struct sockaddr_storage ss;
        socklen_t sl;
        if (ds41_loopback_address_parse(buf, false, &ss, &sl, err) != 0) return -1;
        break;
    }
    case V_PRESET: {
        for (size_t i = 0; d->names[i]; i++)
            if (strlen(d->names[i]) == len && memcmp(d->names[i], t, len) == 0) {
                v->str = dup_n(t, len);
                return v->str ? 0 : ds41_fail(err, "out of memory");
            }
        return ds41_fail(err, "expected one of tiny, long, bench, got '%s'", shown);
    }
    case V_ENUM: {
        char list[128] = "";
        for (size_t i = 0; d->names[i]; i++) {
            if (strlen(d->names[i]) == len && memcmp(d->names[i], t, len) == 0) {
                v->num = i;
                return 0;
            }
            size_t l = strlen(list);
            snprintf(list + l, sizeof list - l, "%s%s", i ? ", " : "", d->names[i]);
        }
        return ds41_fail(err, "expected one of %s, got '%s'", list, shown);
    }
    case V_BOOL:
        if (len == 4 && memcmp(t, "true", 4) == 0) v->num = 1;
        else if (len == 5 && memcmp(t, "false", 5) == 0) v->num = 0;
        else
            return ds41_fail(err, "expected true or false, got '%s' (yes/no/on/off and other YAML 1.1 forms are "
                                  "not accepted)",
                             shown);
        return 0;
    case V_MODE:
        return parse_mode(t, len, &v->num, err);
    case V_UINT:
        if (parse_decimal(t, len, &v->num, err) != 0) return -1;
        if (v->num < d->min || v->num > d->max)
            return ds41_fail(err, "%llu is out of range %llu..%llu", (unsigned long long)v->num,
                             (unsigned long long)d->min, (unsigned long long)d->max);
        return 0;
    case V_SIZE: {
        if (d->auto_zero && len == 4 && memcmp(t, "auto", 4) == 0) {
            v->num = 0;
            return 0;
        }
        if (size_parse_n(t, len, &v->num, err) != 0) return -1;
        if (v->num < d->min || v->num > d->max) {
            char lo[32], hi[32];
            size_show(d->min, lo, sizeof lo);
            size_show(d->max, hi, sizeof hi);
            return ds41_fail(err, "size '%s' is out of range %s..%s", shown, lo, hi);
        }
        return 0;
    }
    }
    /* string kinds validated above */
    v->str = dup_n(t, len);
    return v->str ? 0 : ds41_fail(err, "out of memory");
}

/* Store a converted value into base (the config or a model entry). */
static void store(void *base, const key_desc *d, value *v) {
    if (is_string_kind(d->kind)) {
        char **f = str_field(base, d);
        free(*f);
        *f = v->is_null ? NULL : v->str;
        v->str = NULL;
    } else {
        put_uint(base, d, v->num);
    }
}

/* ---- defaults, free ------------------------------------------------------ */

void ds41_daemon_config_free(ds41_daemon_config *cfg) {
    if (!cfg) return;
    for (size_t i = 0; i < N_KEYS; i++) {
        bool in_model = keys[i].section && strcmp(keys[i].section, MODELS_SECTION) == 0;
        if (is_string_kind(keys[i].kind) && !in_model) free(*str_field(cfg, &keys[i]));
    }
    for (size_t m = 0; m < cfg->n_models; m++) {
        free(cfg->models[m].name);
        free(cfg->models[m].path);
    }
    free(cfg->models);
    free(cfg->source);
    memset(cfg, 0, sizeof *cfg);
}

int ds41_daemon_config_defaults(ds41_daemon_config *cfg, ds41_error *err) {
    memset(cfg, 0, sizeof *cfg);
    cfg->listen.socket = strdup("/run/ds41d/ds41d.sock");
    cfg->listen.socket_mode = 0660;
    cfg->listen.socket_group = strdup("ds41");
    cfg->listen.backlog = 128;
    cfg->listen.tcp = NULL;
    cfg->auth.admin_group = strdup("ds41-admin");
    cfg->state_directory = strdup("/var/lib/ds41d");
    cfg->embedded_model.enabled = true;
    cfg->embedded_model.name = strdup("ds41-tiny");
    cfg->embedded_model.preset = strdup("tiny");
    cfg->embedded_model.seed = 1;
    cfg->engine.threads = 0;
    cfg->engine.mode = DS41_ENGINE_MODE_FAST;
    cfg->engine.backend = DS41_CFG_BACKEND_AUTO;
    cfg->engine.cuda_device = 0;
    cfg->engine.max_sequences = 64;
    cfg->engine.max_batch_tokens = 8192;
    cfg->engine.prefill_chunk = 512;
    cfg->engine.speculative = false;
    cfg->engine.speculative_max_draft = 5;
    cfg->engine.speculative_min_confidence_pct = 0;
    cfg->engine.test_forced_output = false;
    cfg->engine.test_fault_expert_read = 0;
    cfg->limits.max_body_bytes = 8u << 20;
    cfg->limits.max_queue = 256;
    cfg->limits.max_tokens_default = 4096;
    cfg->limits.max_context = 0;
    cfg->limits.request_timeout_s = 600;
    cfg->limits.idle_timeout_s = 30;
    cfg->limits.stream_stall_timeout_s = 30;
    cfg->limits.drain_timeout_s = 30;
    cfg->prefix_cache.enabled = true;
    cfg->prefix_cache.max_bytes = 0;
    cfg->prefix_cache.share_across_users = false;
    cfg->snapshots.enabled = true;
    cfg->snapshots.max_bytes = 4ull << 30;
    cfg->snapshots.test_save_delay_ms = 0;
    cfg->responses.max_bytes = 1ull << 30;
    cfg->responses.max_age_s = 30u * 86400u;
    cfg->log.level = DS41_LOG_INFO;
    if (!cfg->listen.socket || !cfg->listen.socket_group || !cfg->auth.admin_group || !cfg->state_directory ||
        !cfg->embedded_model.name || !cfg->embedded_model.preset) {
        ds41_daemon_config_free(cfg);
        return ds41_fail(err, "out of memory");
    }
    return 0;
}

int ds41_daemon_config_defaults_by_hand(ds41_daemon_config *cfg, ds41_error *err) {
    if (ds41_daemon_config_defaults(cfg, err) != 0) return -1;
    char state[PATH_MAX];
    const char *xdg = getenv("XDG_STATE_HOME"), *home = getenv("HOME");
    state[0] = 0;
    if (geteuid() == 0) {
        /* root keeps the service's directory */
    } else if (xdg && xdg[0] == '/') {
        snprintf(state, sizeof state, "%s/ds41d", xdg);
    } else if (home && home[0] == '/') {
        snprintf(state, sizeof state, "%s/.local/state/ds41d", home);
    }
    cfg->listen.socket_mode = 0600;
    if (ds41_daemon_config_set(cfg, "listen.socket_group", "null", err) != 0 ||
        ds41_daemon_config_set(cfg, "auth.admin_group", "null", err) != 0 ||
        (state[0] && ds41_daemon_config_set(cfg, "state_directory", state, err) != 0)) {
        ds41_daemon_config_free(cfg);
        return ds41_error_prefix(err, "the defaults for a run by hand");
    }
    return 0;
}

/* ---- cross-key rules ------------------------------------------------------- */

/* Where each key was written (for positioned errors of cross-key rules). */
typedef struct key_marks {
    bool have[N_KEYS];
    yaml_mark_t mark[N_KEYS];
} key_marks;

typedef struct rule_ctx {
    const char *label;            /* NULL: no positions */
    const key_marks *global;      /* NULL: no positions */
    const key_marks *model_marks; /* array, one per model, or NULL */
} rule_ctx;

static const yaml_mark_t *mark_of(const rule_ctx *rc, int key, long model) {
    if (!rc->label || key < 0) return NULL;
    const key_marks *km = model >= 0 ? (rc->model_marks ? &rc->model_marks[model] : NULL) : rc->global;
    return km && km->have[key] ? &km->mark[key] : NULL;
}

static bool mark_after(const yaml_mark_t *a, const yaml_mark_t *b) {
    return a->line > b->line || (a->line == b->line && a->column > b->column);
}

/* Fail naming the later written of (key_a, model_a) and (key_b, model_b)
 * (key_a when neither is written). */
__attribute__((format(printf, 7, 8))) static int rule_fail(const rule_ctx *rc, ds41_error *err, int key_a,
                                                           long model_a, int key_b, long model_b, const char *fmt,
                                                           ...) {
    const yaml_mark_t *ma = mark_of(rc, key_a, model_a), *mb = mark_of(rc, key_b, model_b);
    int key = key_a;
    long model = model_a;
    const yaml_mark_t *m = ma;
    if (mb && (!ma || mark_after(mb, ma))) {
        key = key_b;
        model = model_b;
        m = mb;
    }
    va_list ap;
    va_start(ap, fmt);
    ds41_vfail(err, fmt, ap);
    va_end(ap);
    char name[96];
    if (model >= 0) snprintf(name, sizeof name, "models[%ld].%s", model, keys[key].name);
    else snprintf(name, sizeof name, "%s", keys[key].dotted);
    if (m)
        return ds41_error_prefix(err, "%s:%lu:%lu: key '%s'", rc->label, (unsigned long)m->line + 1,
                                 (unsigned long)m->column + 1, name);
    return ds41_error_prefix(err, "key '%s'", name);
}

/* A rule between two size keys: "KEY_A (SIZE) relation KEY_B (SIZE): why". */
static int sizes_rule_fail(const rule_ctx *rc, ds41_error *err, int key_a, uint64_t a, const char *relation,
                           int key_b, uint64_t b, const char *why) {
    char sa[32], sb[32];
    ds41_size_format(a, sa, sizeof sa);
    ds41_size_format(b, sb, sizeof sb);
    return rule_fail(rc, err, key_a, -1, key_b, -1, "%s (%s) %s %s (%s): %s", keys[key_a].dotted, sa, relation,
                     keys[key_b].dotted, sb, why);
}

static int validate_impl(const ds41_daemon_config *cfg, const rule_ctx *rc, ds41_error *err) {
    const int k_seq = key_index_dotted("engine.max_sequences"), k_mbt = key_index_dotted("engine.max_batch_tokens"),
              k_chunk = key_index_dotted("engine.prefill_chunk"), k_ctx = key_index_dotted("limits.max_context"),
              k_mtd = key_index_dotted("limits.max_tokens_default"), k_kv = key_index_dotted("memory.kv_cache_bytes"),
              k_pmax = key_index_dotted("prefix_cache.max_bytes"), k_mname = key_index_dotted("models[].name"),
              k_mpath = key_index_dotted("models[].path"), k_mdef = key_index_dotted("models[].default"),
              k_ename = key_index_dotted("embedded_model.name"), k_een = key_index_dotted("embedded_model.enabled"),
              k_xc = key_index_dotted("memory.expert_cache_bytes"),
              k_hxc = key_index_dotted("memory.host_expert_cache_bytes");
    if (cfg->engine.max_batch_tokens < cfg->engine.max_sequences)
        return rule_fail(rc, err, k_mbt, -1, k_seq, -1,
                         "engine.max_batch_tokens (%u) must be at least engine.max_sequences (%u): every decoding "
                         "sequence takes one token of a step",
                         cfg->engine.max_batch_tokens, cfg->engine.max_sequences);
    if (cfg->engine.max_batch_tokens < cfg->engine.prefill_chunk)
        return rule_fail(rc, err, k_mbt, -1, k_chunk, -1,
                         "engine.max_batch_tokens (%u) must be at least engine.prefill_chunk (%u)",
                         cfg->engine.max_batch_tokens, cfg->engine.prefill_chunk);
    if (cfg->limits.max_context != 0 && cfg->limits.max_context < cfg->limits.max_tokens_default)
        return rule_fail(rc, err, k_ctx, -1, k_mtd, -1,
                         "limits.max_context (%u) must be 0 or at least limits.max_tokens_default (%u)",
                         cfg->limits.max_context, cfg->limits.max_tokens_default);
    if (cfg->memory.kv_cache_bytes != 0 && cfg->prefix_cache.max_bytes > cfg->memory.kv_cache_bytes)
        return sizes_rule_fail(rc, err, k_pmax, cfg->prefix_cache.max_bytes, "exceeds", k_kv,
                               cfg->memory.kv_cache_bytes, "cached prefixes live in the KV cache");
    if (cfg->memory.host_expert_cache_bytes != 0 && cfg->memory.expert_cache_bytes != 0 &&
        cfg->memory.host_expert_cache_bytes < cfg->memory.expert_cache_bytes)
        return sizes_rule_fail(rc, err, k_hxc, cfg->memory.host_expert_cache_bytes, "is below", k_xc,
                               cfg->memory.expert_cache_bytes,
                               "the host tier stages every expert the device tier loads");
    long first_default = -1;
    for (size_t m = 0; m < cfg->n_models; m++) {
        const ds41_daemon_model *md = &cfg->models[m];
        if (!md->name || !md->path) return rule_fail(rc, err, k_mpath, (long)m, -1, -1, "missing name or path");
        for (size_t o = 0; o < m; o++) {
            if (strcmp(cfg->models[o].name, md->name) == 0)
                return rule_fail(rc, err, k_mname, (long)m, -1, -1, "model name '%s' is already used by models[%zu]",
                                 md->name, o);
            if (strcmp(cfg->models[o].path, md->path) == 0)
                return rule_fail(rc, err, k_mpath, (long)m, -1, -1, "path '%s' is already used by models[%zu]",
                                 md->path, o);
        }
        if (md->is_default) {
            if (first_default >= 0)
                return rule_fail(rc, err, k_mdef, (long)m, -1, -1,
                                 "only one model may be the default; models[%ld] already is", first_default);
            first_default = (long)m;
        }
        if (strcmp(md->name, cfg->embedded_model.name) == 0)
            return rule_fail(rc, err, k_mname, (long)m, k_ename, -1,
                             "model name '%s' is also embedded_model.name; the embedded model must have its own name",
                             md->name);
    }
    if (cfg->n_models == 0 && !cfg->embedded_model.enabled)
        return rule_fail(rc, err, k_een, -1, -1, -1,
                         "nothing to serve: models is empty and embedded_model.enabled is false");
    return 0;
}

int ds41_daemon_config_validate(const ds41_daemon_config *cfg, ds41_error *err) {
    rule_ctx rc = {NULL, NULL, NULL};
    return validate_impl(cfg, &rc, err);
}

/* ---- the YAML walker ------------------------------------------------------- */

typedef struct parser {
    yaml_parser_t yp;
    const char *buf;
    size_t len;
    const char *label;
    ds41_error *err;
    ds41_daemon_config *cfg;
    key_marks marks;
    key_marks *model_marks; /* one per cfg->models entry */
} parser;

__attribute__((format(printf, 4, 5))) static int fail_at(parser *p, const yaml_mark_t *m, const char *key,
                                                         const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ds41_vfail(p->err, fmt, ap);
    va_end(ap);
    if (key)
        return ds41_error_prefix(p->err, "%s:%lu:%lu: key '%s'", p->label, (unsigned long)m->line + 1,
                                 (unsigned long)m->column + 1, key);
    return ds41_error_prefix(p->err, "%s:%lu:%lu", p->label, (unsigned long)m->line + 1,
                             (unsigned long)m->column + 1);
}

/* 1-based line and column of a byte offset (for libyaml reader errors, which
 * carry an offset instead of a mark). */
static void offset_position(const parser *p, size_t offset, yaml_mark_t *m) {
    memset(m, 0, sizeof *m);
    if (offset > p->len) offset = p->len;
    for (size_t i = 0; i < offset; i++) {
        if (p->buf[i] == '\n') {
            m->line++;
            m->column = 0;
        } else if (((unsigned char)p->buf[i] & 0xc0) != 0x80) {
            m->column++;
        }
    }
}

static int next_event(parser *p, yaml_event_t *ev) {
    if (yaml_parser_parse(&p->yp, ev)) return 0;
    memset(ev, 0, sizeof *ev);
    yaml_mark_t m = p->yp.problem_mark;
    if (p->yp.error == YAML_READER_ERROR) offset_position(p, p->yp.problem_offset, &m);
    const char *problem = p->yp.problem ? p->yp.problem : "out of memory";
    if (p->yp.error == YAML_MEMORY_ERROR) problem = "out of memory";
    /* libyaml's message for a tab in indentation does not say "tab" */
    const char *hint = "";
    if (p->yp.error == YAML_SCANNER_ERROR && m.index < p->len && p->buf[m.index] == '\t')
        hint = " (a tab: YAML indents with spaces only)";
    if (p->yp.context)
        return fail_at(p, &m, NULL, "YAML syntax error: %s%s (%s, line %lu)", problem, hint, p->yp.context,
                       (unsigned long)p->yp.context_mark.line + 1);
    return fail_at(p, &m, NULL, "YAML syntax error: %s%s", problem, hint);
}

static const char *node_kind_name(yaml_event_type_t t) {
    switch (t) {
    case YAML_MAPPING_START_EVENT:
        return "a mapping";
    case YAML_SEQUENCE_START_EVENT:
        return "a sequence";
    case YAML_SCALAR_EVENT:
        return "a scalar";
    case YAML_ALIAS_EVENT:
        return "an alias";
    default:
        return "something else";
    }
}

/* Refuse anchors, aliases and tags on a node event. */
static int check_node_props(parser *p, const yaml_event_t *ev, const char *key) {
    const yaml_char_t *anchor = NULL, *tag = NULL;
    if (ev->type == YAML_ALIAS_EVENT)
        return fail_at(p, &ev->start_mark, key, "aliases are not supported; write the value out");
    if (ev->type == YAML_SCALAR_EVENT) {
        anchor = ev->data.scalar.anchor;
        tag = ev->data.scalar.tag;
    } else if (ev->type == YAML_MAPPING_START_EVENT) {
        anchor = ev->data.mapping_start.anchor;
        tag = ev->data.mapping_start.tag;
    } else if (ev->type == YAML_SEQUENCE_START_EVENT) {
        anchor = ev->data.sequence_start.anchor;
        tag = ev->data.sequence_start.tag;
    }
    if (anchor) return fail_at(p, &ev->start_mark, key, "anchors (&name) are not supported");
    if (tag) return fail_at(p, &ev->start_mark, key, "tags (!tag) are not supported");
    return 0;
}

static bool scalar_is_null(const yaml_event_t *ev) {
    return ev->type == YAML_SCALAR_EVENT && ev->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
           is_null_text((const char *)ev->data.scalar.value, ev->data.scalar.length);
}

/* Read the value of key d (a scalar) and store it into base. */
static int parse_scalar_value(parser *p, const key_desc *d, void *base, const char *key, key_marks *km) {
    yaml_event_t ev;
    if (next_event(p, &ev) != 0) return -1;
    int rc = check_node_props(p, &ev, key);
    if (rc == 0 && ev.type != YAML_SCALAR_EVENT)
        rc = fail_at(p, &ev.start_mark, key, "expected a scalar value, got %s", node_kind_name(ev.type));
    if (rc == 0) {
        value v;
        bool plain = ev.data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
        if (convert(d, (const char *)ev.data.scalar.value, ev.data.scalar.length, plain, &v, p->err) != 0) {
            rc = ds41_error_prefix(p->err, "%s:%lu:%lu: key '%s'", p->label, (unsigned long)ev.start_mark.line + 1,
                                   (unsigned long)ev.start_mark.column + 1, key);
        } else {
            store(base, d, &v);
            int idx = (int)(d - keys);
            km->have[idx] = true;
            km->mark[idx] = ev.start_mark;
        }
    }
    yaml_event_delete(&ev);
    return rc;
}

/* Names of the keys of a section, for "unknown key" messages. */
static void known_keys(const char *section, char *buf, size_t size) {
    buf[0] = 0;
    size_t o = 0;
    for (size_t i = 0; i < N_KEYS && o < size; i++)
        if (keys[i].section && strcmp(keys[i].section, section) == 0)
            o += (size_t)snprintf(buf + o, size - o, "%s%s", o ? ", " : "", keys[i].name);
}

/* Read one key event of a mapping: 1 = got a key (its text in *name), 0 =
 * mapping end, -1 = error. */
static int next_key(parser *p, yaml_event_t *ev, const char *where) {
    if (next_event(p, ev) != 0) return -1;
    if (ev->type == YAML_MAPPING_END_EVENT) return 0;
    if (check_node_props(p, ev, where) != 0) return -1;
    if (ev->type != YAML_SCALAR_EVENT)
        return fail_at(p, &ev->start_mark, where, "mapping keys must be names, got %s", node_kind_name(ev->type));
    if (memchr(ev->data.scalar.value, 0, ev->data.scalar.length))
        return fail_at(p, &ev->start_mark, where, "a key contains a NUL byte");
    return 1;
}

/* The keys of one mapping of `section` ("listen", ..., or MODELS_SECTION for
 * a models entry); prefix is the dotted path of the mapping for messages. */
static int parse_keys(parser *p, const char *section, const char *prefix, void *base, key_marks *km) {
    yaml_mark_t first[N_KEYS];
    bool seen[N_KEYS] = {false};
    for (;;) {
        yaml_event_t ev;
        int got = next_key(p, &ev, prefix);
        if (got <= 0) {
            yaml_event_delete(&ev);
            return got;
        }
        const char *name = (const char *)ev.data.scalar.value;
        size_t name_len = ev.data.scalar.length;
        char shown[80], key[160];
        show(name, name_len, shown, sizeof shown);
        snprintf(key, sizeof key, "%s.%s", prefix, shown);
        int idx = key_index(section, name, name_len);
        int rc = 0;
        if (idx < 0) {
            char known[512];
            known_keys(section, known, sizeof known);
            rc = fail_at(p, &ev.start_mark, key, "unknown key (%s has: %s)", prefix, known);
        } else if (seen[idx]) {
            rc = fail_at(p, &ev.start_mark, key, "duplicate key (first at line %lu)",
                         (unsigned long)first[idx].line + 1);
        } else {
            seen[idx] = true;
            first[idx] = ev.start_mark;
            km->have[idx] = true;
            km->mark[idx] = ev.start_mark;
        }
        yaml_event_delete(&ev);
        if (rc != 0) return rc;
        if (parse_scalar_value(p, &keys[idx], base, key, km) != 0) return -1;
    }
}

/* A section value: a mapping of its keys, or null (all defaults). */
static int parse_section(parser *p, const char *section) {
    yaml_event_t ev;
    if (next_event(p, &ev) != 0) return -1;
    int rc = check_node_props(p, &ev, section);
    if (rc == 0 && ev.type == YAML_MAPPING_START_EVENT) {
        rc = parse_keys(p, section, section, p->cfg, &p->marks);
    } else if (rc == 0 && !scalar_is_null(&ev)) {
        char known[512];
        known_keys(section, known, sizeof known);
        rc = fail_at(p, &ev.start_mark, section, "expected a mapping of keys (%s), got %s", known,
                     node_kind_name(ev.type));
    }
    yaml_event_delete(&ev);
    return rc;
}

static int parse_models(parser *p) {
    yaml_event_t ev;
    if (next_event(p, &ev) != 0) return -1;
    int rc = check_node_props(p, &ev, "models");
    if (rc == 0 && ev.type != YAML_SEQUENCE_START_EVENT && !scalar_is_null(&ev))
        rc = fail_at(p, &ev.start_mark, "models", "expected a sequence of model entries (- name: ..., path: ...), got %s",
                     node_kind_name(ev.type));
    bool is_seq = ev.type == YAML_SEQUENCE_START_EVENT;
    yaml_event_delete(&ev);
    if (rc != 0 || !is_seq) return rc;
    for (;;) {
        if (next_event(p, &ev) != 0) return -1;
        if (ev.type == YAML_SEQUENCE_END_EVENT) {
            yaml_event_delete(&ev);
            return 0;
        }
        char where[48];
        size_t m = p->cfg->n_models;
        snprintf(where, sizeof where, "models[%zu]", m);
        rc = check_node_props(p, &ev, where);
        if (rc == 0 && ev.type != YAML_MAPPING_START_EVENT)
            rc = fail_at(p, &ev.start_mark, where, "expected a mapping with name, path and default, got %s",
                         node_kind_name(ev.type));
        if (rc == 0 && m >= MAX_MODELS) rc = fail_at(p, &ev.start_mark, where, "at most %d models", MAX_MODELS);
        yaml_mark_t entry_mark = ev.start_mark;
        yaml_event_delete(&ev);
        if (rc != 0) return rc;
        ds41_daemon_model *nm = realloc(p->cfg->models, (m + 1) * sizeof *nm);
        if (!nm) return fail_at(p, &entry_mark, where, "out of memory");
        p->cfg->models = nm;
        key_marks *nk = realloc(p->model_marks, (m + 1) * sizeof *nk);
        if (!nk) return fail_at(p, &entry_mark, where, "out of memory");
        p->model_marks = nk;
        memset(&nm[m], 0, sizeof nm[m]);
        memset(&nk[m], 0, sizeof nk[m]);
        p->cfg->n_models = m + 1;
        if (parse_keys(p, MODELS_SECTION, where, &nm[m], &nk[m]) != 0) return -1;
        if (!nm[m].path)
            return fail_at(p, &entry_mark, where, "missing required key 'path' (the model directory)");
        if (!nm[m].name) {
            nm[m].name = strdup(DS41_DAEMON_CONFIG_REAL_MODEL_NAME);
            if (!nm[m].name) return fail_at(p, &entry_mark, where, "out of memory");
            /* rules about the defaulted name point at the entry */
            int k_name = key_index_dotted("models[].name");
            nk[m].have[k_name] = true;
            nk[m].mark[k_name] = entry_mark;
        }
    }
}

static int parse_root(parser *p) {
    yaml_mark_t first[N_ROOT];
    bool seen[N_ROOT] = {false};
    for (;;) {
        yaml_event_t ev;
        int got = next_key(p, &ev, "(top level)");
        if (got <= 0) {
            yaml_event_delete(&ev);
            return got;
        }
        const char *name = (const char *)ev.data.scalar.value;
        size_t name_len = ev.data.scalar.length;
        char shown[80];
        show(name, name_len, shown, sizeof shown);
        int idx = -1;
        for (size_t i = 0; i < N_ROOT; i++)
            if (strlen(root_keys[i]) == name_len && memcmp(root_keys[i], name, name_len) == 0) idx = (int)i;
        int rc = 0;
        if (idx < 0) {
            char known[256] = "";
            size_t o = 0;
            for (size_t i = 0; i < N_ROOT; i++)
                o += (size_t)snprintf(known + o, sizeof known - o, "%s%s", i ? ", " : "", root_keys[i]);
            rc = fail_at(p, &ev.start_mark, shown, "unknown key (the top level has: %s)", known);
        } else if (seen[idx]) {
            rc = fail_at(p, &ev.start_mark, shown, "duplicate key (first at line %lu)",
                         (unsigned long)first[idx].line + 1);
        } else {
            seen[idx] = true;
            first[idx] = ev.start_mark;
        }
        yaml_event_delete(&ev);
        if (rc != 0) return rc;
        const char *k = root_keys[idx];
        if (strcmp(k, "models") == 0) rc = parse_models(p);
        else if (key_index(NULL, k, strlen(k)) >= 0) {
            int ki = key_index(NULL, k, strlen(k));
            rc = parse_scalar_value(p, &keys[ki], p->cfg, k, &p->marks);
        } else rc = parse_section(p, k);
        if (rc != 0) return rc;
    }
}

static int parse_stream(parser *p) {
    yaml_event_t ev;
    if (next_event(p, &ev) != 0) return -1; /* stream start */
    yaml_event_delete(&ev);
    if (next_event(p, &ev) != 0) return -1;
    if (ev.type == YAML_STREAM_END_EVENT) { /* no document at all: defaults */
        yaml_event_delete(&ev);
        return 0;
    }
    yaml_event_delete(&ev); /* document start */
    if (next_event(p, &ev) != 0) return -1;
    int rc = check_node_props(p, &ev, "(top level)");
    bool is_map = ev.type == YAML_MAPPING_START_EVENT;
    if (rc == 0 && !is_map && !scalar_is_null(&ev))
        rc = fail_at(p, &ev.start_mark, NULL, "the top level must be a mapping of keys (listen:, engine:, ...), got %s",
                     node_kind_name(ev.type));
    yaml_event_delete(&ev);
    if (rc != 0) return rc;
    if (is_map && parse_root(p) != 0) return -1;
    if (next_event(p, &ev) != 0) return -1; /* document end */
    yaml_event_delete(&ev);
    if (next_event(p, &ev) != 0) return -1;
    if (ev.type != YAML_STREAM_END_EVENT) rc = fail_at(p, &ev.start_mark, NULL, "only one YAML document is allowed");
    yaml_event_delete(&ev);
    return rc;
}

int ds41_daemon_config_parse(const char *buf, size_t len, const char *label, ds41_daemon_config *cfg,
                             ds41_error *err) {
    if (!label) label = "config";
    memset(cfg, 0, sizeof *cfg);
    if (!buf && len) return ds41_fail(err, "%s: no buffer", label);
    if (len > DS41_DAEMON_CONFIG_MAX_BYTES)
        return ds41_fail(err, "%s: the file is %zu bytes; the limit is %u", label, len, DS41_DAEMON_CONFIG_MAX_BYTES);
    if (ds41_daemon_config_defaults(cfg, err) != 0) return ds41_error_prefix(err, "%s", label);
    parser *p = calloc(1, sizeof *p);
    if (!p) {
        ds41_daemon_config_free(cfg);
        return ds41_fail(err, "%s: out of memory", label);
    }
    p->buf = buf;
    p->len = len;
    p->label = label;
    p->err = err;
    p->cfg = cfg;
    int rc = -1;
    if (!yaml_parser_initialize(&p->yp)) {
        ds41_fail(err, "%s: out of memory", label);
    } else {
        yaml_parser_set_input_string(&p->yp, (const unsigned char *)(buf ? buf : ""), len);
        rc = parse_stream(p);
        yaml_parser_delete(&p->yp);
    }
    if (rc == 0) {
        rule_ctx rctx = {label, &p->marks, p->model_marks};
        rc = validate_impl(cfg, &rctx, err);
    }
    if (rc == 0) {
        cfg->source = strdup(label);
        if (!cfg->source) rc = ds41_fail(err, "%s: out of memory", label);
    }
    free(p->model_marks);
    free(p);
    if (rc != 0) ds41_daemon_config_free(cfg);
    return rc;
}

int ds41_daemon_config_load(const char *path, ds41_daemon_config *cfg, ds41_error *err) {
    memset(cfg, 0, sizeof *cfg);
    if (!path) return ds41_fail(err, "no configuration file given");
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) return ds41_fail(err, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return ds41_fail(err, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return ds41_fail(err, "%s: not a regular file", path);
    }
    if ((uint64_t)st.st_size > DS41_DAEMON_CONFIG_MAX_BYTES) {
        close(fd);
        return ds41_fail(err, "%s: the file is %lld bytes; the limit is %u", path, (long long)st.st_size,
                         DS41_DAEMON_CONFIG_MAX_BYTES);
    }
    /* Read up to one byte past the cap so a file that grew is caught too. */
    size_t cap = DS41_DAEMON_CONFIG_MAX_BYTES + 1;
    char *buf = malloc(cap);
    if (!buf) {
        close(fd);
        return ds41_fail(err, "%s: out of memory", path);
    }
    size_t len = 0;
    for (;;) {
        ssize_t got = read(fd, buf + len, cap - len);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            int e = errno;
            free(buf);
            close(fd);
            return ds41_fail(err, "%s: read error: %s", path, strerror(e));
        }
        if (got == 0) break;
        len += (size_t)got;
        if (len == cap) break;
    }
    close(fd);
    int rc = ds41_daemon_config_parse(buf, len, path, cfg, err);
    free(buf);
    return rc;
}

/* ---- overrides ------------------------------------------------------------ */

int ds41_daemon_config_set(ds41_daemon_config *cfg, const char *key, const char *val, ds41_error *err) {
    if (!key) return ds41_fail(err, "no key given");
    if (!val) val = "";
    if (strncmp(key, "models", 6) == 0)
        return ds41_fail(err, "key '%s': models entries are set with --model DIR (or in the file)", key);
    int idx = key_index_dotted(key);
    if (idx < 0) return ds41_fail(err, "key '%s': unknown key", key);
    value v;
    if (convert(&keys[idx], val, strlen(val), true, &v, err) != 0) return ds41_error_prefix(err, "key '%s'", key);
    store(cfg, &keys[idx], &v);
    return 0;
}

int ds41_daemon_config_set_model(ds41_daemon_config *cfg, const char *name, const char *path, ds41_error *err) {
    if (!name) name = DS41_DAEMON_CONFIG_REAL_MODEL_NAME;
    if (!path) return ds41_fail(err, "key 'models[0].path': no path given");
    value vn, vp;
    if (convert(&keys[key_index_dotted("models[].name")], name, strlen(name), false, &vn, err) != 0)
        return ds41_error_prefix(err, "key 'models[0].name'");
    if (convert(&keys[key_index_dotted("models[].path")], path, strlen(path), false, &vp, err) != 0) {
        free(vn.str);
        return ds41_error_prefix(err, "key 'models[0].path'");
    }
    ds41_daemon_model *m = calloc(1, sizeof *m);
    if (!m) {
        free(vn.str);
        free(vp.str);
        return ds41_fail(err, "out of memory");
    }
    m->name = vn.str;
    m->path = vp.str;
    m->is_default = true;
    for (size_t i = 0; i < cfg->n_models; i++) {
        free(cfg->models[i].name);
        free(cfg->models[i].path);
    }
    free(cfg->models);
    cfg->models = m;
    cfg->n_models = 1;
    return 0;
}

/* ---- queries ---------------------------------------------------------------- */

const ds41_daemon_model *ds41_daemon_config_default_model(const ds41_daemon_config *cfg) {
    if (!cfg || cfg->n_models == 0) return NULL;
    for (size_t i = 0; i < cfg->n_models; i++)
        if (cfg->models[i].is_default) return &cfg->models[i];
    return &cfg->models[0];
}

int ds41_daemon_config_embedded_dir(const ds41_daemon_config *cfg, char *buf, size_t size, ds41_error *err) {
    if (!cfg->state_directory || !cfg->embedded_model.preset)
        return ds41_fail(err, "key 'state_directory': not set");
    int n = snprintf(buf, size, "%s/embedded/%s-seed%llu", cfg->state_directory, cfg->embedded_model.preset,
                     (unsigned long long)cfg->embedded_model.seed);
    if (n < 0 || (size_t)n >= size)
        return ds41_fail(err, "key 'state_directory': the embedded model's directory does not fit in %zu bytes", size);
    return 0;
}

static bool str_eq(const char *a, const char *b) {
    return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

bool ds41_daemon_config_equal(const ds41_daemon_config *a, const ds41_daemon_config *b) {
    for (size_t i = 0; i < N_KEYS; i++) {
        const key_desc *d = &keys[i];
        if (d->section && strcmp(d->section, MODELS_SECTION) == 0) continue;
        if (is_string_kind(d->kind)) {
            if (!str_eq(*str_field((void *)a, d), *str_field((void *)b, d))) return false;
        } else if (get_uint(a, d) != get_uint(b, d)) {
            return false;
        }
    }
    if (a->n_models != b->n_models) return false;
    for (size_t m = 0; m < a->n_models; m++)
        if (!str_eq(a->models[m].name, b->models[m].name) || !str_eq(a->models[m].path, b->models[m].path) ||
            a->models[m].is_default != b->models[m].is_default)
            return false;
    return true;
}

/* ---- dump ------------------------------------------------------------------ */

static int write_handler(void *data, unsigned char *buffer, size_t size) {
    return fwrite(buffer, 1, size, (FILE *)data) == size;
}

static int emit(yaml_emitter_t *em, yaml_event_t *ev, int ok) {
    return ok && yaml_emitter_emit(em, ev);
}

static int emit_scalar(yaml_emitter_t *em, const char *text, yaml_scalar_style_t style) {
    yaml_event_t ev;
    int ok = yaml_scalar_event_initialize(&ev, NULL, NULL, (yaml_char_t *)text, (int)strlen(text), 1, 1, style);
    return emit(em, &ev, ok);
}

static int emit_value(yaml_emitter_t *em, const void *base, const key_desc *d) {
    char buf[64];
    if (is_string_kind(d->kind)) {
        const char *s = *str_field((void *)base, d);
        if (!s) return emit_scalar(em, "null", YAML_PLAIN_SCALAR_STYLE);
        /* A string that reads as null when plain must be quoted to survive. */
        yaml_scalar_style_t st = is_null_text(s, strlen(s)) ? YAML_DOUBLE_QUOTED_SCALAR_STYLE : YAML_ANY_SCALAR_STYLE;
        return emit_scalar(em, s, st);
    }
    uint64_t v = get_uint(base, d);
    switch (d->kind) {
    case V_MODE:
        snprintf(buf, sizeof buf, "%04llo", (unsigned long long)v);
        return emit_scalar(em, buf, YAML_DOUBLE_QUOTED_SCALAR_STYLE);
    case V_BOOL:
        return emit_scalar(em, v ? "true" : "false", YAML_PLAIN_SCALAR_STYLE);
    case V_ENUM:
        return emit_scalar(em, d->names[v], YAML_PLAIN_SCALAR_STYLE);
    case V_SIZE:
        if (d->auto_zero && v == 0) return emit_scalar(em, "auto", YAML_PLAIN_SCALAR_STYLE);
        ds41_size_format(v, buf, sizeof buf);
        return emit_scalar(em, buf, YAML_PLAIN_SCALAR_STYLE);
    default:
        snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
        return emit_scalar(em, buf, YAML_PLAIN_SCALAR_STYLE);
    }
}

static int emit_mapping_start(yaml_emitter_t *em) {
    yaml_event_t ev;
    int ok = yaml_mapping_start_event_initialize(&ev, NULL, NULL, 1, YAML_BLOCK_MAPPING_STYLE);
    return emit(em, &ev, ok);
}

static int emit_mapping_end(yaml_emitter_t *em) {
    yaml_event_t ev;
    int ok = yaml_mapping_end_event_initialize(&ev);
    return emit(em, &ev, ok);
}

static int emit_section(yaml_emitter_t *em, const void *base, const char *section) {
    if (!emit_mapping_start(em)) return 0;
    for (size_t i = 0; i < N_KEYS; i++)
        if (keys[i].section && strcmp(keys[i].section, section) == 0)
            if (!emit_scalar(em, keys[i].name, YAML_PLAIN_SCALAR_STYLE) || !emit_value(em, base, &keys[i])) return 0;
    return emit_mapping_end(em);
}

static int emit_config(yaml_emitter_t *em, const ds41_daemon_config *cfg) {
    yaml_event_t ev;
    int ok = yaml_stream_start_event_initialize(&ev, YAML_UTF8_ENCODING);
    ok = emit(em, &ev, ok);
    ok = ok && yaml_document_start_event_initialize(&ev, NULL, NULL, NULL, 1);
    ok = emit(em, &ev, ok);
    ok = ok && emit_mapping_start(em);
    for (size_t r = 0; ok && r < N_ROOT; r++) {
        const char *k = root_keys[r];
        ok = emit_scalar(em, k, YAML_PLAIN_SCALAR_STYLE);
        int ki = key_index(NULL, k, strlen(k));
        if (!ok) break;
        if (strcmp(k, "models") == 0) {
            ok = yaml_sequence_start_event_initialize(&ev, NULL, NULL, 1,
                                                      cfg->n_models ? YAML_BLOCK_SEQUENCE_STYLE
                                                                    : YAML_FLOW_SEQUENCE_STYLE);
            ok = emit(em, &ev, ok);
            for (size_t m = 0; ok && m < cfg->n_models; m++) ok = emit_section(em, &cfg->models[m], MODELS_SECTION);
            ok = ok && yaml_sequence_end_event_initialize(&ev);
            ok = emit(em, &ev, ok);
        } else if (ki >= 0) {
            ok = emit_value(em, cfg, &keys[ki]);
        } else {
            ok = emit_section(em, cfg, k);
        }
    }
    ok = ok && emit_mapping_end(em);
    ok = ok && yaml_document_end_event_initialize(&ev, 1);
    ok = emit(em, &ev, ok);
    ok = ok && yaml_stream_end_event_initialize(&ev);
    ok = emit(em, &ev, ok);
    return ok;
}

int ds41_daemon_config_write_yaml(const ds41_daemon_config *cfg, FILE *f, ds41_error *err) {
    yaml_emitter_t em;
    if (!yaml_emitter_initialize(&em)) return ds41_fail(err, "YAML emitter: out of memory");
    yaml_emitter_set_output(&em, write_handler, f);
    yaml_emitter_set_unicode(&em, 1);
    yaml_emitter_set_width(&em, -1);
    yaml_emitter_set_indent(&em, 2);
    int ok = emit_config(&em, cfg);
    if (!ok) {
        const char *problem = em.problem ? em.problem : "write error";
        ds41_fail(err, "cannot write the configuration: %s", problem);
    }
    yaml_emitter_delete(&em);
    return ok ? 0 : -1;
}
