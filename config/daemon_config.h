/* ds41_daemon_config: the daemon's YAML configuration (/etc/ds41d/ds41d.yaml),
 * parsed with libyaml, validated, with defaults, command-line overrides and a
 * dump of the effective configuration (`ds41d --check-config`).
 *
 * The schema (every key, its default and its rules; the same list is in
 * packaging/ds41d.yaml and ds41d.yaml(5)).  A key that is absent keeps its
 * default; a whole section may be absent or empty (`engine:`).
 *
 *   listen.socket            /run/ds41d/ds41d.sock  absolute path of the Unix socket the
 *                            daemon creates (at most 107 bytes, the sun_path limit).
 *                            Ignored when systemd passes sockets (socket activation).
 *   listen.socket_mode       "0660"   octal permission bits given to the socket (3 or 4
 *                            octal digits, "0o660" also accepted, at most 0777).  Modes that
 *                            let every local user connect (others-write, 0002) are refused:
 *                            grant access through socket_group.
 *   listen.socket_group      ds41     group the socket is given (by name); members may use
 *                            the inference routes.  null: the daemon's own group.
 *   listen.backlog           128      listen(2) backlog, 1..65535.
 *   listen.tcp               null     optional loopback TCP listener "127.0.0.1:PORT" (any
 *                            127.0.0.0/8 address) or "[::1]:PORT"; any other address is
 *                            refused (host names are not resolved).  TCP peers cannot be
 *                            identified with SO_PEERCRED, so they never get admin routes.
 *   auth.admin_group         ds41-admin  members (and root) may use the admin routes; null:
 *                            root only.  Admins also need socket access (socket_group).
 *   state_directory          /var/lib/ds41d  absolute; holds the embedded model and state.
 *   models                   []       the model directories the daemon may load; no route
 *                            reads any other path.  Each entry is a mapping:
 *   models[].name            deepseek-v4.1-flash  served model id: 1..128 characters of
 *                            [A-Za-z0-9._:-], starting with a letter or digit; unique.
 *   models[].path            (required) absolute directory of a Hugging Face checkpoint;
 *                            unique; "." and ".." components are refused (the path is a
 *                            security boundary), repeated and trailing slashes are dropped.
 *   models[].default         false    the model loaded at start and served when a request
 *                            names none; at most one entry; none marked: the first entry.
 *   embedded_model.enabled   true     serve the embedded model when `models` is empty
 *                            (empty models with enabled false is an error: nothing to serve).
 *   embedded_model.name      ds41-tiny  its served id (same rules as models[].name; it may
 *                            not start with "deepseek", so it never poses as the real model,
 *                            and may not equal any models[].name).
 *   embedded_model.preset    tiny     ds41-mkmodel preset: tiny, long or bench.
 *   embedded_model.seed      1        generation seed, 0..2^64-1.  The checkpoint is generated
 *                            on first start into ds41_daemon_config_embedded_dir().
 *   engine.threads           0        CPU worker threads, 0 = one per online CPU; 0..4096.
 *   engine.mode              fast     fast | reference (the slow exact reference path).
 *   engine.backend           auto     what runs the fast mode (cuda/backend_select.h): auto (the
 *                            CUDA backend when a usable GPU is present, else cpu) | cpu |
 *                            cuda (no usable GPU fails the load, naming why) | cuda-emu (test
 *                            mode: the CUDA backend with its kernels emulated on the host;
 *                            slow, never for production).  Ignored with mode reference.
 *   engine.cuda_device       0        CUDA device ordinal for auto and cuda, 0..1023.
 *   engine.max_sequences     64       sequences decoded together per step, 1..4096.
 *   engine.max_batch_tokens  8192     tokens in one forward step (prefill chunks plus one per
 *                            decoding sequence), 1..1048576; >= max_sequences and >=
 *                            prefill_chunk.
 *   engine.prefill_chunk     512      prompt tokens per prefill chunk, 1..1048576.
 *   engine.speculative       false    speculative decoding (engine/serve/speculative.h) with the
 *                            model's DSpark draft head; a model without one
 *                            (dspark_block_size 0) fails to load with it on.
 *   engine.speculative_max_draft 5    drafts per block at most, 1..8 (and <= the model's
 *                            dspark_block_size, checked at load).
 *   engine.speculative_min_confidence_pct 0  a block stops at the first draft whose
 *                            confidence (percent) is below this, 0..100.
 *   engine.test_forced_output false   test hook: accept the request field "ds41_forced_output"
 *                            (text whose tokens replace the samples, so tests can make a
 *                            random-weight model emit </think> and tool calls).  Never on
 *                            in production: it lets a client dictate the output.
 *   engine.test_fault_expert_read 0   test hook: when N > 0, the Nth read of streamed routed
 *                            experts after each model load fails with EIO (once), so tests
 *                            see a request fail cleanly (expert prediction is off then, so
 *                            that read is one a request waits for); 0..2^64-1.  Never on in
 *                            production.
 *   memory.kv_cache_bytes    auto     KV cache budget; sizes are integers (bytes) or strings
 *   memory.expert_cache_bytes auto    with a unit: B, KB/MB/GB/TB/PB (powers of 1000),
 *   memory.engram_cache_bytes auto    KiB/MiB/GiB/TiB/PiB (powers of 1024), units case-
 *                            insensitive, an optional space, an optional decimal fraction
 *                            that must give whole bytes ("1.5GiB").  "auto" (or 0): the
 *                            KV cache is a quarter of the memory the process may use;
 *                            the expert and Engram budgets are decided at load from
 *                            that memory (engine/serve/auto_budget.h: everything resident
 *                            when it fits, else the Engram rows streamed first, then
 *                            the experts; see ds41d.yaml(5)).  A size covering a tier
 *                            keeps it resident (used in place from the mapping).
 *   memory.host_expert_cache_bytes 0  with a GPU backend: the pinned host tier of routed
 *                            experts between the device slots (expert_cache_bytes) and
 *                            the shards (storage/expert_cache.h); a size as above, at
 *                            least memory.expert_cache_bytes when both are given; 0: no
 *                            tier of its own (host staging as large as the device tier).
 *                            Ignored by the CPU backends.
 *   limits.max_body_bytes    8MiB     largest request body (413 beyond), 1KiB..1GiB.
 *   limits.max_queue         256      requests waiting for a decode slot (429 beyond),
 *                            1..1000000.
 *   limits.max_tokens_default 4096    max_tokens of a request that gives none, 1..16777216.
 *   limits.max_context       0        prompt + completion tokens per sequence, 0 = the
 *                            model's max_seq_len; 0..16777216; when set, >=
 *                            max_tokens_default.
 *   limits.request_timeout_s 600      whole-request limit in seconds, 0 = none; 0..604800.
 *   limits.idle_timeout_s    30       a connection idle (or dripping a request) this long is
 *                            closed, 1..86400.
 *   limits.stream_stall_timeout_s 30  a streaming client that stops reading this long is cut
 *                            off, 1..86400.
 *   limits.drain_timeout_s   30       graceful drain on SIGTERM before in-flight requests are
 *                            cancelled, 0..3600 (keep below the unit's TimeoutStopSec).
 *   prefix_cache.enabled     true     keep KV pages of finished sessions for prompt reuse.
 *   prefix_cache.max_bytes   auto     their budget ("auto"/0: any KV page no live session
 *                            needs); when both are set, <= memory.kv_cache_bytes.
 *   prefix_cache.share_across_users false  whether requests of different peer uids reuse each
 *                            other's cached prefixes (memory and snapshots).  false: each uid
 *                            (and each cache_salt) is its own partition, so cached_tokens never
 *                            tells one user what another sent; true: only cache_salt separates.
 *   snapshots.enabled        true     session snapshots on disk (the disk tier of the prefix
 *                            cache) under <state_directory>/snapshots/<model>/: finished
 *                            conversations leaving the prefix cache and at shutdown, and on
 *                            request (admin routes); a prompt that misses the prefix cache
 *                            restores the longest stored prefix.  Needs prefix_cache.enabled.
 *   snapshots.max_bytes      4GiB     their total file size per model, least recently used
 *                            deleted first; 0 = no cap.
 *   snapshots.test_save_delay_ms 0    TEST ONLY: pause every snapshot write half-way for this
 *                            many ms (so a test can kill the daemon mid-save); 0..600000.
 *   responses.max_bytes      1GiB     stored responses of POST /v1/responses ("store": true) under
 *                            <state_directory>/responses/: their total size, oldest deleted
 *                            first; 0 = no cap.
 *   responses.max_age_s      2592000  a stored response older than this many seconds (30 days)
 *                            is deleted; 0 = kept until the cap needs room; 0..315360000.
 *   log.level                info     error | warning | info | debug.
 *
 * Value rules: booleans are exactly `true` or `false` (YAML 1.1's yes/no/on/off
 * are refused, they are a classic source of surprises); integers are plain
 * decimal digits (no sign, no hex, no leading zeros, which YAML 1.1 reads as
 * octal); null is `null`, `~` or an empty value (unquoted); a quoted scalar is
 * read by the key's type like an unquoted one, except that a quoted "null" is a
 * string.  Anchors, aliases and tags are refused, as are duplicate keys, keys
 * that are not scalars, a value of the wrong node kind (a mapping where a
 * scalar is expected, ...), a second YAML document, NUL bytes in scalars, and
 * files over DS41_DAEMON_CONFIG_MAX_BYTES.  An empty file (or one with only
 * comments) is all defaults.
 *
 * Errors: every message names the file, the position and the key, e.g.
 *   "/etc/ds41d/ds41d.yaml:12:18: key 'engine.threads': expected a decimal
 *    integer, got 'many'"
 * (lines and columns 1-based, pointing at the offending key or value; a
 * rule linking two keys points at the later one).  YAML syntax errors are
 * "FILE:LINE:COLUMN: YAML syntax error: PROBLEM".  Errors of overrides and of
 * ds41_daemon_config_validate() after overrides have no position:
 * "key 'listen.socket': ...".
 *
 * Ownership: a ds41_daemon_config owns all its strings and its models array;
 * ds41_daemon_config_free() releases them.  The functions keep no state and
 * are thread-safe on distinct configs. */
#ifndef DS41_CONFIG_DAEMON_CONFIG_H
#define DS41_CONFIG_DAEMON_CONFIG_H

#include "config/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>

/* Where the packaging installs the default file (whatever the build prefix). */
#define DS41_DAEMON_CONFIG_DEFAULT_PATH "/etc/ds41d/ds41d.yaml"
/* Largest configuration file accepted. */
#define DS41_DAEMON_CONFIG_MAX_BYTES (1u << 20)
/* The served id of the real model (DESIGN §7), the default models[].name. */
#define DS41_DAEMON_CONFIG_REAL_MODEL_NAME "deepseek-v4.1-flash"

typedef enum ds41_engine_mode {
    DS41_ENGINE_MODE_FAST = 0,      /* "fast" */
    DS41_ENGINE_MODE_REFERENCE = 1, /* "reference" */
} ds41_engine_mode;

typedef enum ds41_cfg_backend {
    DS41_CFG_BACKEND_AUTO = 0,     /* "auto" */
    DS41_CFG_BACKEND_CPU = 1,      /* "cpu" */
    DS41_CFG_BACKEND_CUDA = 2,     /* "cuda" */
    DS41_CFG_BACKEND_CUDA_EMU = 3, /* "cuda-emu" (test mode) */
} ds41_cfg_backend;

/* "auto", "cpu", "cuda", "cuda-emu". */
const char *ds41_cfg_backend_name(ds41_cfg_backend b);

typedef enum ds41_log_level {
    DS41_LOG_ERROR = 0,   /* "error" */
    DS41_LOG_WARNING = 1, /* "warning" */
    DS41_LOG_INFO = 2,    /* "info" */
    DS41_LOG_DEBUG = 3,   /* "debug" */
} ds41_log_level;

/* One entry of `models`. */
typedef struct ds41_daemon_model {
    char *name;      /* served id */
    char *path;      /* normalized absolute directory */
    bool is_default; /* the `default` key as written */
} ds41_daemon_model;

/* The effective configuration.  Sizes are bytes; 0 where the schema says
 * "auto"/"none"/"model's". */
typedef struct ds41_daemon_config {
    char *source; /* the label of the file it came from; NULL = built-in defaults */
    struct {
        char *socket;
        uint32_t socket_mode; /* permission bits, <= 0777 */
        char *socket_group;   /* NULL: the daemon's own group */
        uint32_t backlog;
        char *tcp; /* NULL: no TCP listener */
    } listen;
    struct {
        char *admin_group; /* NULL: root only */
    } auth;
    char *state_directory;
    ds41_daemon_model *models;
    size_t n_models;
    struct {
        bool enabled;
        char *name;
        char *preset;
        uint64_t seed;
    } embedded_model;
    struct {
        uint32_t threads;
        ds41_engine_mode mode;
        ds41_cfg_backend backend;
        uint32_t cuda_device;
        uint32_t max_sequences;
        uint32_t max_batch_tokens;
        uint32_t prefill_chunk;
        bool speculative;
        uint32_t speculative_max_draft;
        uint32_t speculative_min_confidence_pct;
        bool test_forced_output;
        uint64_t test_fault_expert_read;
    } engine;
    struct {
        uint64_t kv_cache_bytes;
        uint64_t expert_cache_bytes;
        uint64_t engram_cache_bytes;
        uint64_t host_expert_cache_bytes;
    } memory;
    struct {
        uint64_t max_body_bytes;
        uint32_t max_queue;
        uint32_t max_tokens_default;
        uint32_t max_context;
        uint32_t request_timeout_s;
        uint32_t idle_timeout_s;
        uint32_t stream_stall_timeout_s;
        uint32_t drain_timeout_s;
    } limits;
    struct {
        bool enabled;
        uint64_t max_bytes;
        bool share_across_users; /* issue 13: false = partition by peer uid */
    } prefix_cache;
    struct {
        bool enabled;
        uint64_t max_bytes;          /* 0 = no cap */
        uint32_t test_save_delay_ms; /* TEST ONLY */
    } snapshots;
    struct {
        uint64_t max_bytes; /* 0 = no cap */
        uint32_t max_age_s; /* 0 = no limit */
    } responses;
    struct {
        ds41_log_level level;
    } log;
} ds41_daemon_config;

/* Fill cfg with the built-in defaults (overwriting it without freeing).
 * Returns -1 only when memory runs out; cfg is then empty (free is safe). */
int ds41_daemon_config_defaults(ds41_daemon_config *cfg, ds41_error *err);

/* The defaults of ds41d run by hand: no --config given and no file at
 * DS41_DAEMON_CONFIG_DEFAULT_PATH (the service always names its file, see
 * ds41d.service).  The built-in defaults, except that the socket is private
 * to the invoking user and needs no group: listen.socket_mode 0600,
 * listen.socket_group null, auth.admin_group null (admin routes for root);
 * and for a user other than root state_directory is $XDG_STATE_HOME/ds41d
 * when XDG_STATE_HOME is an absolute path, else $HOME/.local/state/ds41d
 * (/var/lib/ds41d, the service's directory, when neither is set and for
 * root).  Same contract as ds41_daemon_config_defaults; an environment
 * value that is not a valid state_directory is an error naming it. */
int ds41_daemon_config_defaults_by_hand(ds41_daemon_config *cfg, ds41_error *err);

/* Release everything cfg owns and zero it.  Safe on a zeroed or freed config. */
void ds41_daemon_config_free(ds41_daemon_config *cfg);

/* Parse `len` bytes of YAML (need not be NUL-terminated; label names the
 * source in errors and is copied to cfg->source; NULL = "config") on top of
 * the defaults, then validate.  On success cfg owns a complete config; on
 * failure cfg is zeroed (free is safe) and err holds one positioned message. */
int ds41_daemon_config_parse(const char *buf, size_t len, const char *label, ds41_daemon_config *cfg,
                             ds41_error *err);

/* Read and parse the file at path (a regular file of at most
 * DS41_DAEMON_CONFIG_MAX_BYTES); the path is the label.  Same contract as
 * parse; errors also cover open/read failures ("PATH: cannot open: ..."). */
int ds41_daemon_config_load(const char *path, ds41_daemon_config *cfg, ds41_error *err);

/* Cross-key rules (see the schema: max_batch_tokens >= max_sequences and >=
 * prefill_chunk, max_context >= max_tokens_default, prefix_cache.max_bytes <=
 * kv_cache_bytes, one default model, unique model names and paths, the
 * embedded model's name, something to serve).  parse/load run it; call it
 * again after command-line overrides.  Errors name the key, no position. */
int ds41_daemon_config_validate(const ds41_daemon_config *cfg, ds41_error *err);

/* Command-line override of one scalar key by its dotted name (as in the
 * schema, e.g. "listen.socket", "engine.threads", "memory.kv_cache_bytes"),
 * value read with the same rules as a plain YAML scalar ("null" or "" is
 * null).  `models` entries are set with ds41_daemon_config_set_model.
 * Only the key's own rules are checked: call validate after all overrides.
 * On failure cfg is unchanged. */
int ds41_daemon_config_set(ds41_daemon_config *cfg, const char *key, const char *value, ds41_error *err);

/* `--model DIR`: replace the models list by one default entry with the given
 * path and name (NULL: DS41_DAEMON_CONFIG_REAL_MODEL_NAME).  Both are checked
 * like models[].path / models[].name.  On failure cfg is unchanged. */
int ds41_daemon_config_set_model(ds41_daemon_config *cfg, const char *name, const char *path, ds41_error *err);

/* Write cfg as YAML (every key, effective values, sizes with binary units
 * where exact, "auto" for automatic sizes) that parses back to an equal
 * config.  Returns -1 on an emitter or write error. */
int ds41_daemon_config_write_yaml(const ds41_daemon_config *cfg, FILE *f, ds41_error *err);

/* Whether two configs have the same effective values (source is ignored). */
bool ds41_daemon_config_equal(const ds41_daemon_config *a, const ds41_daemon_config *b);

/* The model served when a request names none: the entry marked default, else
 * the first; NULL when `models` is empty (the embedded model is served). */
const ds41_daemon_model *ds41_daemon_config_default_model(const ds41_daemon_config *cfg);

/* Directory the embedded checkpoint lives in:
 * "<state_directory>/embedded/<preset>-seed<seed>" (a different preset or seed
 * is a different directory, so it is regenerated, never mixed).  Fails when
 * it does not fit in `size` bytes. */
int ds41_daemon_config_embedded_dir(const ds41_daemon_config *cfg, char *buf, size_t size, ds41_error *err);

/* The documented keys in schema order, dotted ("listen.socket", ...,
 * "models[].path", ...): for --help texts and for tests that check the
 * documentation.  Index >= count gives NULL. */
size_t ds41_daemon_config_key_count(void);
const char *ds41_daemon_config_key_name(size_t index);

/* Parse a listen.tcp address ("127.0.0.1:8080", "[::1]:8080") into a socket
 * address, refusing anything that is not loopback (127.0.0.0/8 or ::1), a
 * host name, or a port outside 1..65535 (0 too unless allow_port_0, which
 * tests use for an ephemeral port).  The error is a bare message without key. */
int ds41_loopback_address_parse(const char *text, bool allow_port_0, struct sockaddr_storage *addr,
                                socklen_t *addr_len, ds41_error *err);

/* Parse a size as in the schema ("8GiB", "512 MB", "1.5GiB", "4096"); "auto"
 * is not accepted here.  Bare message on error. */
int ds41_size_parse(const char *text, uint64_t *bytes, ds41_error *err);

/* Format a size the way write_yaml does: "<n><unit>" with the largest binary
 * unit that divides it exactly, else plain bytes. */
void ds41_size_format(uint64_t bytes, char *buf, size_t size);

#endif
