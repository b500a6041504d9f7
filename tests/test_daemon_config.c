/* Tests for config/daemon_config: the packaged default file, every key's bad
 * values (FILE:LINE:COLUMN: key 'x.y': ...), unknown and duplicate keys, node
 * kinds, sizes, modes, loopback addresses, the models list, cross-key rules,
 * overrides, the dump round trip, and that every key is documented in the
 * header, the default file and the man page. */
#include "config/daemon_config.h"
#include "tests/tap.h"
#include "tests/test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DEFAULT_FILE "packaging/ds41d.yaml"
#define MAN_PAGE "packaging/ds41d.yaml.5"
#define HEADER "config/daemon_config.h"
#define FUZZ_SEED "tests/fuzz/corpus/daemon_config/default.yaml"

static bool has(const char *s, const char *needle) {
    return s && strstr(s, needle) != NULL;
}

static bool starts(const char *s, const char *prefix) {
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* Parse text labelled t.yaml; returns rc, fills err. */
static int parse(const char *text, ds41_daemon_config *cfg, ds41_error *err) {
    memset(err, 0, sizeof *err);
    return ds41_daemon_config_parse(text, strlen(text), "t.yaml", cfg, err);
}

/* Expect text to fail with a message starting with `prefix` and containing `want`. */
static bool fails_with(const char *text, const char *prefix, const char *want, char *got, size_t got_size) {
    ds41_daemon_config cfg;
    ds41_error err;
    int rc = parse(text, &cfg, &err);
    snprintf(got, got_size, "%s", rc == 0 ? "(parsed)" : err.msg);
    ds41_daemon_config_free(&cfg);
    return rc == -1 && starts(err.msg, prefix) && (!want || has(err.msg, want));
}

static void expect_error(const char *text, const char *prefix, const char *want, const char *what) {
    char got[DS41_ERROR_MAX];
    TAP_CHECK(fails_with(text, prefix, want, got, sizeof got), "%s -> '%s...%s' (got: %s)", what, prefix,
              want ? want : "", got);
}

/* ---- the default file and the documentation ------------------------------ */

static void test_default_file(void) {
    ds41_daemon_config def, file;
    ds41_error err = {{0}};
    TAP_CHECK(ds41_daemon_config_defaults(&def, &err) == 0, "built-in defaults initialise");
    int rc = ds41_daemon_config_load(DEFAULT_FILE, &file, &err);
    TAP_CHECK(rc == 0, "the packaged %s parses (%s)", DEFAULT_FILE, rc ? err.msg : "ok");
    TAP_CHECK(rc == 0 && ds41_daemon_config_equal(&def, &file), "the packaged file equals the built-in defaults");
    TAP_CHECK(rc == 0 && file.source && strcmp(file.source, DEFAULT_FILE) == 0, "source names the file");
    size_t a_len = 0, b_len = 0;
    char *a = slurp(DEFAULT_FILE, &a_len), *b = slurp(FUZZ_SEED, &b_len);
    TAP_CHECK(a && b && a_len == b_len && memcmp(a, b, a_len) == 0, "the fuzz seed %s is the packaged file", FUZZ_SEED);
    free(a);
    free(b);
    TAP_CHECK(ds41_daemon_config_validate(&def, &err) == 0, "the defaults pass validation");
    TAP_CHECK(ds41_daemon_config_default_model(&def) == NULL && def.embedded_model.enabled,
              "by default no model is configured and the embedded model is served");
    TAP_CHECK(def.listen.socket_mode == 0660 && strcmp(def.listen.socket, "/run/ds41d/ds41d.sock") == 0 &&
                  def.listen.tcp == NULL && strcmp(def.state_directory, "/var/lib/ds41d") == 0 &&
                  strcmp(def.embedded_model.name, "ds41-tiny") == 0 && def.limits.max_body_bytes == 8u << 20,
              "defaults match the issue: /run/ds41d/ds41d.sock 0660, no TCP, /var/lib/ds41d, ds41-tiny, 8MiB");
    ds41_daemon_config_free(&def);
    ds41_daemon_config_free(&file);
}

/* The text of one section of the default file: from "\nSECTION:" to the next
 * line starting in column 1 with a letter. */
static char *section_text(const char *file, const char *section) {
    char head[80];
    snprintf(head, sizeof head, "\n%.60s:", section);
    const char *s = strstr(file, head);
    if (!s) return NULL;
    s += strlen(head);
    const char *e = s;
    while ((e = strchr(e, '\n')) != NULL) {
        e++;
        if ((*e >= 'a' && *e <= 'z') || (*e >= 'A' && *e <= 'Z')) break;
    }
    size_t n = e ? (size_t)(e - s) : strlen(s);
    char *out = malloc(n + 1);
    memcpy(out, s, n);
    out[n] = 0;
    return out;
}

static void test_documentation(void) {
    char *yaml = slurp(DEFAULT_FILE, NULL), *man = slurp(MAN_PAGE, NULL), *hdr = slurp(HEADER, NULL);
    TAP_CHECK(yaml && man && hdr, "default file, man page and header are readable");
    size_t n = ds41_daemon_config_key_count();
    TAP_CHECK(n >= 30 && ds41_daemon_config_key_name(n) == NULL, "%zu keys listed, the list ends with NULL", n);
    const char *missing_yaml = NULL, *missing_man = NULL, *missing_hdr = NULL;
    for (size_t i = 0; i < n; i++) {
        const char *k = ds41_daemon_config_key_name(i);
        const char *dot = strchr(k, '.');
        if (starts(k, "models[].")) {
            /* the commented example entry shows every models key */
            char want[80];
            snprintf(want, sizeof want, "%.60s:", dot + 1);
            if (!missing_yaml && !has(yaml, want)) missing_yaml = k;
        } else if (dot) {
            char section[64], want[80];
            snprintf(section, sizeof section, "%.*s", (int)(dot - k), k);
            snprintf(want, sizeof want, "\n  %.60s: ", dot + 1);
            char *sec = yaml ? section_text(yaml, section) : NULL;
            if (!missing_yaml && !has(sec, want)) missing_yaml = k;
            free(sec);
        } else {
            char want[80];
            snprintf(want, sizeof want, "\n%.60s: ", k);
            if (!missing_yaml && !has(yaml, want)) missing_yaml = k;
        }
        /* the man page writes keys as .B/.TP items; groff escapes nothing in them */
        if (!missing_man && !has(man, k)) missing_man = k;
        if (!missing_hdr && !has(hdr, k)) missing_hdr = k;
    }
    TAP_CHECK(!missing_yaml, "every key is present in %s (missing: %s)", DEFAULT_FILE,
              missing_yaml ? missing_yaml : "none");
    TAP_CHECK(!missing_man, "every key is documented in %s (missing: %s)", MAN_PAGE,
              missing_man ? missing_man : "none");
    TAP_CHECK(!missing_hdr, "every key is documented in %s (missing: %s)", HEADER, missing_hdr ? missing_hdr : "none");
    free(yaml);
    free(man);
    free(hdr);
}

/* ---- bad values, one case per key ------------------------------------------ */

typedef struct bad_case {
    const char *key;           /* dotted */
    const char *const *values; /* NULL-terminated */
    const char *want;          /* substring of every message */
} bad_case;

#define V(...) ((const char *const[]){__VA_ARGS__, NULL})

static const bad_case bad_cases[] = {
    {"listen.socket", V("run/x", "/", "/run/../x", "/run/./x", "null", "\"/run/\\x01x\"",
                        "/run/ds41d/a-socket-path-that-is-far-too-long-for-the-sun-path-field-of-struct-sockaddr-un-"
                        "which-holds-108-bytes-including-its-terminating-nul"),
     NULL},
    {"listen.socket_mode", V("\"0666\"", "\"0777\"", "\"0668\"", "\"660 \"", "\"10660\"", "\"1660\"", "rw", "null"),
     NULL},
    {"listen.socket_group", V("\"9ds41\"", "\"a b\"", "\"ds41$x\"", "\"abcdefghijklmnopqrstuvwxyz0123456\""), NULL},
    {"listen.backlog", V("0", "65536", "-1", "1e3", "0x10", "012", "\"\"", "null"), NULL},
    {"listen.tcp", V("\"0.0.0.0:8080\"", "\"192.168.1.1:80\"", "\"[::]:80\"", "\"localhost:8080\"", "\"127.0.0.1\"",
                     "\"127.0.0.1:0\"", "\"127.0.0.1:65536\"", "\"::1:80\"", "\"[fe80::1]:80\"", "8080"),
     NULL},
    {"auth.admin_group", V("\"-admin\"", "\"\"", "\"a/b\""), NULL},
    {"state_directory", V("var/lib/ds41d", "/", "/var/../etc", "null", "[]"), NULL},
    {"models[].name", V("\"-x\"", "\"\"", "\"a b\"", "\"a/b\"", "null", "{}"), NULL},
    {"models[].path", V("relative", "/", "/srv/../etc", "null", "[/a]"), NULL},
    {"models[].default", V("yes", "no", "on", "1", "True", "null"), NULL},
    {"embedded_model.enabled", V("yes", "off", "0", "TRUE", "y"), "true or false"},
    {"embedded_model.name", V("deepseek-v4.1-flash", "DeepSeek-tiny", "\"\"", "\"a b\""), NULL},
    {"embedded_model.preset", V("huge", "Tiny", "\"\"", "null"), NULL},
    {"embedded_model.seed", V("-1", "18446744073709551616", "1.5", "seed"), NULL},
    {"engine.threads", V("4097", "-1", "auto", "\"\"", "08"), NULL},
    {"engine.mode", V("slow", "FAST", "\"\"", "null"), NULL},
    {"engine.backend", V("gpu", "CUDA", "cuda_emu", "reference", "\"\"", "null", "1"), NULL},
    {"engine.cuda_device", V("-1", "1024", "gpu0", "\"\""), NULL},
    {"engine.max_sequences", V("0", "4097", "many"), NULL},
    {"engine.max_batch_tokens", V("0", "1048577", "8k"), NULL},
    {"engine.prefill_chunk", V("0", "1048577", "512.0"), NULL},
    {"engine.speculative", V("yes", "1", "null", "on"), NULL},
    {"engine.speculative_max_draft", V("0", "9", "five", "-1"), NULL},
    {"engine.speculative_min_confidence_pct", V("101", "0.5", "-1", "half"), NULL},
    {"engine.test_forced_output", V("yes", "1", "null", "on"), NULL},
    {"engine.test_fault_expert_read", V("-1", "18446744073709551616", "eio"), NULL},
    {"memory.kv_cache_bytes", V("8Q", "-1", "1.3B", "99999999999999999999", "20000PiB", "1.", "GiB", "8 G", "autox"),
     NULL},
    {"memory.expert_cache_bytes", V("8XB", "0.1B", "08GiB", "[]"), NULL},
    {"memory.engram_cache_bytes", V("lots", "1e9", "{}"), NULL},
    {"memory.host_expert_cache_bytes", V("auto", "-1", "8XB", "[]"), NULL},
    {"limits.max_body_bytes", V("100", "1023", "2GiB", "auto", "0"), NULL},
    {"limits.max_queue", V("0", "1000001", "x"), NULL},
    {"limits.max_tokens_default", V("0", "16777217"), NULL},
    {"limits.max_context", V("16777217", "-5"), NULL},
    {"limits.request_timeout_s", V("604801", "10m"), NULL},
    {"limits.idle_timeout_s", V("0", "86401"), NULL},
    {"limits.stream_stall_timeout_s", V("0", "86401"), NULL},
    {"limits.drain_timeout_s", V("3601", "1h"), NULL},
    {"prefix_cache.enabled", V("yes", "no", "null"), NULL},
    {"prefix_cache.max_bytes", V("-1", "1.1B", "many"), NULL},
    {"prefix_cache.share_across_users", V("yes", "1", "null", "shared"), NULL},
    {"snapshots.enabled", V("yes", "1", "null"), NULL},
    {"snapshots.max_bytes", V("-1", "auto", "lots"), NULL},
    {"snapshots.test_save_delay_ms", V("600001", "-1", "5s"), NULL},
    {"responses.max_bytes", V("-1", "auto", "lots"), NULL},
    {"responses.max_age_s", V("315360001", "-1", "30d"), NULL},
    {"log.level", V("warn", "INFO", "trace", "null"), NULL},
};

/* Build the YAML that sets key to value and the expected error prefix. */
static void build_case(const char *key, const char *value, char *yaml, size_t ysize, char *prefix, size_t psize) {
    const char *dot = strchr(key, '.');
    if (starts(key, "models[].")) {
        const char *leaf = dot + 1;
        bool is_path = strcmp(leaf, "path") == 0;
        /* line 1 "models:", line 2 "  - path: /m" (unless path is the key), line 3 the key */
        if (is_path) {
            snprintf(yaml, ysize, "models:\n  - name: m\n    path: %s\n", value);
        } else {
            snprintf(yaml, ysize, "models:\n  - path: /m\n    %s: %s\n", leaf, value);
        }
        snprintf(prefix, psize, "t.yaml:3:%zu: key 'models[0].%s':", 4 + strlen(leaf) + 2 + 1, leaf);
    } else if (dot) {
        snprintf(yaml, ysize, "%.*s:\n  %s: %s\n", (int)(dot - key), key, dot + 1, value);
        snprintf(prefix, psize, "t.yaml:2:%zu: key '%s':", 2 + strlen(dot + 1) + 2 + 1, key);
    } else {
        snprintf(yaml, ysize, "%s: %s\n", key, value);
        snprintf(prefix, psize, "t.yaml:1:%zu: key '%s':", strlen(key) + 2 + 1, key);
    }
}

static void test_bad_values(void) {
    size_t nk = ds41_daemon_config_key_count();
    const char *uncovered = NULL;
    for (size_t i = 0; i < nk && !uncovered; i++) {
        bool found = false;
        for (size_t c = 0; c < sizeof bad_cases / sizeof bad_cases[0]; c++)
            if (strcmp(bad_cases[c].key, ds41_daemon_config_key_name(i)) == 0) found = true;
        if (!found) uncovered = ds41_daemon_config_key_name(i);
    }
    TAP_CHECK(!uncovered, "every key has bad-value cases (uncovered: %s)", uncovered ? uncovered : "none");
    for (size_t c = 0; c < sizeof bad_cases / sizeof bad_cases[0]; c++) {
        const bad_case *bc = &bad_cases[c];
        char failure[DS41_ERROR_MAX * 2] = "";
        size_t n = 0;
        for (size_t v = 0; bc->values[v] && !failure[0]; v++, n++) {
            char yaml[512], prefix[128], got[DS41_ERROR_MAX];
            build_case(bc->key, bc->values[v], yaml, sizeof yaml, prefix, sizeof prefix);
            if (!fails_with(yaml, prefix, bc->want, got, sizeof got))
                snprintf(failure, sizeof failure, "value %s: want '%s' got '%s'", bc->values[v], prefix, got);
        }
        TAP_CHECK(!failure[0], "%s: %zu bad values each give FILE:LINE:COLUMN naming the key%s%s", bc->key, n,
                  failure[0] ? ": " : "", failure);
    }
}

/* ---- good values ----------------------------------------------------------- */

static void test_sizes(void) {
    static const struct {
        const char *text;
        uint64_t bytes;
    } good[] = {
        {"0", 0},
        {"4096", 4096},
        {"512MB", 512000000ull},
        {"8GiB", 8ull << 30},
        {"8 GiB", 8ull << 30},
        {"8gib", 8ull << 30},
        {"1.5GiB", 3ull << 29},
        {"0.5KiB", 512},
        {"2TB", 2000000000000ull},
        {"3PiB", 3ull << 50},
        {"1kB", 1000},
        {"7B", 7},
        {"1.0B", 1},
        {"18446744073709551615", UINT64_MAX},
        {"16383.999999999999999PiB", 0}, /* not whole: checked below as a failure */
    };
    const char *bad = NULL;
    for (size_t i = 0; i + 1 < sizeof good / sizeof good[0] && !bad; i++) {
        uint64_t b = 1;
        ds41_error err;
        if (ds41_size_parse(good[i].text, &b, &err) != 0 || b != good[i].bytes) bad = good[i].text;
    }
    TAP_CHECK(!bad, "sizes with units parse exactly (first wrong: %s)", bad ? bad : "none");
    static const char *const bad_sizes[] = {"",    "GiB",   "8 G",  "8iB", "-1",   "1.",   "1.3B",
                                            "08",  "1e9",   "8GiBs", "0x10", "16EiB", "18446744073709551616",
                                            "16384PiB", "16383.999999999999999PiB"};
    bad = NULL;
    for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0] && !bad; i++) {
        uint64_t b;
        ds41_error err;
        if (ds41_size_parse(bad_sizes[i], &b, &err) == 0) bad = bad_sizes[i];
    }
    TAP_CHECK(!bad, "malformed, fractional-byte and overflowing sizes are refused (first accepted: %s)",
              bad ? bad : "none");
    static const uint64_t round[] = {0, 1, 1023, 1024, 1536, 8ull << 30, 3ull << 29, 5ull << 50, UINT64_MAX, 1ull << 63};
    bad = NULL;
    char text[64] = "";
    for (size_t i = 0; i < sizeof round / sizeof round[0] && !bad; i++) {
        uint64_t b = 0;
        ds41_error err;
        ds41_size_format(round[i], text, sizeof text);
        if (ds41_size_parse(text, &b, &err) != 0 || b != round[i]) bad = text;
    }
    TAP_CHECK(!bad, "size_format output parses back to the same bytes (first wrong: %s)", bad ? bad : "none");
    char f1[32], f2[32];
    ds41_size_format(8ull << 30, f1, sizeof f1);
    ds41_size_format(1000, f2, sizeof f2);
    TAP_CHECK(strcmp(f1, "8GiB") == 0 && strcmp(f2, "1000") == 0, "size_format picks the largest exact binary unit");

    ds41_daemon_config cfg;
    ds41_error err;
    int rc = parse("memory:\n  kv_cache_bytes: 1.5GiB\n  expert_cache_bytes: 512MB\n  engram_cache_bytes: 0\n"
                   "prefix_cache:\n  max_bytes: \"1 GiB\"\nlimits:\n  max_body_bytes: 1KiB\n",
                   &cfg, &err);
    TAP_CHECK(rc == 0 && cfg.memory.kv_cache_bytes == 3ull << 29 && cfg.memory.expert_cache_bytes == 512000000ull &&
                  cfg.memory.engram_cache_bytes == 0 && cfg.prefix_cache.max_bytes == 1ull << 30 &&
                  cfg.limits.max_body_bytes == 1024,
              "size keys take units, quoted or not, and 0 as auto (%s)", rc ? err.msg : "ok");
    ds41_daemon_config_free(&cfg);
}

static void test_modes_and_scalars(void) {
    static const struct {
        const char *text;
        uint32_t mode;
    } modes[] = {{"\"0660\"", 0660}, {"0660", 0660}, {"\"660\"", 0660}, {"'0600'", 0600},
                 {"\"0o640\"", 0640}, {"0770", 0770}, {"\"0000\"", 0},   {"\"0775\"", 0775}};
    const char *bad = NULL;
    char got[DS41_ERROR_MAX] = "";
    for (size_t i = 0; i < sizeof modes / sizeof modes[0] && !bad; i++) {
        char yaml[128];
        snprintf(yaml, sizeof yaml, "listen:\n  socket_mode: %s\n", modes[i].text);
        ds41_daemon_config cfg;
        ds41_error err;
        if (parse(yaml, &cfg, &err) != 0 || cfg.listen.socket_mode != modes[i].mode) {
            bad = modes[i].text;
            snprintf(got, sizeof got, "%s", err.msg);
        }
        ds41_daemon_config_free(&cfg);
    }
    TAP_CHECK(!bad, "octal mode strings (quoted, plain, 0o) parse (first wrong: %s %s)", bad ? bad : "none", got);

    ds41_daemon_config cfg;
    ds41_error err;
    int rc = parse("listen:\n  tcp: \"[::1]:8080\"\n  socket_group: null\n  backlog: 1\nauth:\n  admin_group: ~\n"
                   "prefix_cache:\n  enabled: false\nembedded_model:\n  seed: 18446744073709551615\n"
                   "  preset: bench\nengine:\n  mode: reference\n  threads: 4096\n  backend: cuda-emu\n"
                   "  cuda_device: 1023\nlog:\n  level: debug\n",
                   &cfg, &err);
    TAP_CHECK(rc == 0 && cfg.listen.tcp && strcmp(cfg.listen.tcp, "[::1]:8080") == 0 && !cfg.listen.socket_group &&
                  !cfg.auth.admin_group && cfg.listen.backlog == 1 && !cfg.prefix_cache.enabled &&
                  cfg.embedded_model.seed == UINT64_MAX && strcmp(cfg.embedded_model.preset, "bench") == 0 &&
                  cfg.engine.mode == DS41_ENGINE_MODE_REFERENCE && cfg.engine.threads == 4096 &&
                  cfg.engine.backend == DS41_CFG_BACKEND_CUDA_EMU && cfg.engine.cuda_device == 1023 &&
                  cfg.log.level == DS41_LOG_DEBUG,
              "nulls (null, ~), booleans, enums, a 64-bit seed and IPv6 loopback parse (%s)", rc ? err.msg : "ok");
    ds41_daemon_config_free(&cfg);

    rc = parse("listen:\n  socket: //run//ds41d//x.sock/\n  socket_group: \"null\"\nstate_directory: /srv/ds41/\n"
               "engine:\n  threads: \"8\"\n",
               &cfg, &err);
    TAP_CHECK(rc == 0 && strcmp(cfg.listen.socket, "/run/ds41d/x.sock") == 0 &&
                  strcmp(cfg.state_directory, "/srv/ds41") == 0 && cfg.listen.socket_group &&
                  strcmp(cfg.listen.socket_group, "null") == 0 && cfg.engine.threads == 8,
              "paths are normalized; a quoted \"null\" is a string; a quoted number is read by the key's type (%s)",
              rc ? err.msg : "ok");
    ds41_daemon_config_free(&cfg);

    rc = parse("", &cfg, &err);
    ds41_daemon_config def;
    ds41_daemon_config_defaults(&def, &err);
    bool empty_ok = rc == 0 && ds41_daemon_config_equal(&cfg, &def);
    ds41_daemon_config_free(&cfg);
    rc = parse("# nothing but a comment\n\n", &cfg, &err);
    bool comment_ok = rc == 0 && ds41_daemon_config_equal(&cfg, &def);
    ds41_daemon_config_free(&cfg);
    rc = parse("---\n...\n", &cfg, &err);
    bool doc_ok = rc == 0 && ds41_daemon_config_equal(&cfg, &def);
    ds41_daemon_config_free(&cfg);
    rc = parse("engine:\nlimits: ~\nmodels:\n", &cfg, &err);
    bool null_sections = rc == 0 && ds41_daemon_config_equal(&cfg, &def);
    ds41_daemon_config_free(&cfg);
    TAP_CHECK(empty_ok && comment_ok && doc_ok && null_sections,
              "empty file, comments only, an empty document and empty sections give the defaults");
    ds41_daemon_config_free(&def);
}

static void test_loopback(void) {
    struct sockaddr_storage ss;
    socklen_t len = 0;
    ds41_error err;
    bool v4 = ds41_loopback_address_parse("127.0.0.1:8080", false, &ss, &len, &err) == 0 && ss.ss_family == AF_INET &&
              len == sizeof(struct sockaddr_in) && ntohs(((struct sockaddr_in *)&ss)->sin_port) == 8080;
    bool v4b = ds41_loopback_address_parse("127.1.2.3:1", false, &ss, &len, &err) == 0;
    bool v6 = ds41_loopback_address_parse("[::1]:65535", false, &ss, &len, &err) == 0 && ss.ss_family == AF_INET6 &&
              ntohs(((struct sockaddr_in6 *)&ss)->sin6_port) == 65535;
    bool mapped = ds41_loopback_address_parse("[::ffff:127.0.0.1]:80", false, &ss, &len, &err) == 0;
    TAP_CHECK(v4 && v4b && v6 && mapped, "loopback addresses parse: 127.0.0.1, 127.1.2.3, [::1], v4-mapped 127");
    bool port0 = ds41_loopback_address_parse("127.0.0.1:0", true, &ss, &len, &err) == 0 &&
                 ds41_loopback_address_parse("127.0.0.1:0", false, &ss, &len, &err) == -1;
    TAP_CHECK(port0, "port 0 only when allowed (tests' ephemeral ports)");
    static const char *const refused[] = {"0.0.0.0:80", "10.0.0.1:80", "[::]:80", "[::ffff:10.0.0.1]:80",
                                          "localhost:80", "127.0.0.1", "127.0.0.1:", "127.0.0.1:x", "::1:80",
                                          "[::1]80", "[::1", "", "128.0.0.1:80", "127.0.0.1:070"};
    const char *bad = NULL;
    for (size_t i = 0; i < sizeof refused / sizeof refused[0] && !bad; i++)
        if (ds41_loopback_address_parse(refused[i], false, &ss, &len, &err) == 0) bad = refused[i];
    TAP_CHECK(!bad, "non-loopback, host names and malformed addresses are refused (first accepted: %s)",
              bad ? bad : "none");
    ds41_loopback_address_parse("0.0.0.0:80", false, &ss, &len, &err);
    TAP_CHECK(has(err.msg, "not a loopback address"), "the refusal says why (%s)", err.msg);
}

/* ---- structure --------------------------------------------------------------- */

static void test_structure(void) {
    expect_error("listen:\n  sockett: /x\n", "t.yaml:2:3: key 'listen.sockett':", "unknown key", "unknown section key");
    expect_error("listen:\n  sockett: /x\n", "t.yaml:2:3:", "socket, socket_mode, socket_group, backlog, tcp",
                 "unknown key lists the known ones");
    expect_error("engine: {}\nfoo: 1\n", "t.yaml:2:1: key 'foo':", "unknown key", "unknown top-level key");
    expect_error("models:\n  - path: /m\n    weights: x\n", "t.yaml:3:5: key 'models[0].weights':", "unknown key",
                 "unknown key in a models entry");
    expect_error("engine:\n  threads: 1\n  threads: 2\n", "t.yaml:3:3: key 'engine.threads':",
                 "duplicate key (first at line 2)", "duplicate key in a section");
    expect_error("log:\n  level: info\nlog:\n  level: debug\n", "t.yaml:3:1: key 'log':", "duplicate key",
                 "duplicate section");
    expect_error("state_directory: /a\nstate_directory: /b\n", "t.yaml:2:1: key 'state_directory':", "duplicate key",
                 "duplicate top-level scalar");
    expect_error("models:\n  - path: /m\n    path: /n\n", "t.yaml:3:5: key 'models[0].path':", "duplicate key",
                 "duplicate key in a models entry");
    expect_error("engine:\n  threads:\n    a: 1\n", "t.yaml:3:5: key 'engine.threads':", "got a mapping",
                 "mapping where a scalar is expected");
    expect_error("engine:\n  threads: [1, 2]\n", "t.yaml:2:12: key 'engine.threads':", "got a sequence",
                 "sequence where a scalar is expected");
    expect_error("engine: [1]\n", "t.yaml:1:9: key 'engine':", "expected a mapping", "sequence where a section is expected");
    expect_error("engine: fast\n", "t.yaml:1:9: key 'engine':", "expected a mapping", "scalar where a section is expected");
    expect_error("models: /srv/m\n", "t.yaml:1:9: key 'models':", "expected a sequence", "scalar where models expected");
    expect_error("models:\n  - /srv/m\n", "t.yaml:2:5: key 'models[0]':", "expected a mapping",
                 "scalar as a models entry");
    expect_error("- listen\n", "t.yaml:1:1:", "top level must be a mapping", "a sequence at the top level");
    expect_error("just text\n", "t.yaml:1:1:", "top level must be a mapping", "a scalar at the top level");
    expect_error("? [a]\n: 1\n", "t.yaml:1:3: key '(top level)':", "keys must be names", "a non-scalar key");
    expect_error("log: {level: info}\n---\nlog: {level: info}\n", "t.yaml:2:1:", "only one YAML document",
                 "a second document");
    expect_error("engine:\n  threads: &n 4\n", "t.yaml:2:12: key 'engine.threads':", "anchors", "an anchor");
    expect_error("engine: &e\n  threads: 4\nlimits: *e\n", "t.yaml:1:9: key 'engine':", "anchors", "an anchored section");
    expect_error("engine:\n  threads: *n\n", "t.yaml:2:12:", NULL, "an undefined alias");
    expect_error("log:\n  level: !!str info\n", "t.yaml:2:10: key 'log.level':", "tags", "a tag");
    expect_error("listen:\n  socket: \"/run/a\\0b\"\n", "t.yaml:2:11: key 'listen.socket':", "NUL byte",
                 "a NUL byte in a scalar");
    expect_error("engine: {threads: 1\n", "t.yaml:", "YAML syntax error", "unclosed flow mapping");
    expect_error("engine:\n\tthreads: 1\n", "t.yaml:2:1:", "tab", "a tab in indentation is named");
    expect_error("engine:\n  threads: 1\n mode: fast\n", "t.yaml:", "YAML syntax error", "bad indentation");
    expect_error("log:\n  level: \"info\n", "t.yaml:", "YAML syntax error", "unterminated quoted scalar");
    expect_error("log:\n  level: \xff\n", "t.yaml:2:10:", "UTF-8", "invalid UTF-8 is positioned");

    /* whole-file size cap */
    size_t big = DS41_DAEMON_CONFIG_MAX_BYTES + 1;
    char *buf = malloc(big);
    memset(buf, '#', big);
    buf[big - 1] = '\n';
    ds41_daemon_config cfg;
    ds41_error err;
    int rc = ds41_daemon_config_parse(buf, big, "big.yaml", &cfg, &err);
    TAP_CHECK(rc == -1 && starts(err.msg, "big.yaml: the file is") && has(err.msg, "limit"),
              "a buffer over the size cap is refused (%s)", err.msg);
    rc = ds41_daemon_config_parse(buf, big - 1, "big.yaml", &cfg, &err);
    TAP_CHECK(rc == 0, "a comment file at exactly the cap parses (%s)", rc ? err.msg : "ok");
    ds41_daemon_config_free(&cfg);

    char path[] = "/tmp/ds41-test-config-XXXXXX";
    int fd = mkstemp(path);
    bool wrote = fd >= 0 && write(fd, buf, big) == (ssize_t)big;
    if (fd >= 0) close(fd);
    rc = wrote ? ds41_daemon_config_load(path, &cfg, &err) : 0;
    TAP_CHECK(wrote && rc == -1 && starts(err.msg, path) && has(err.msg, "limit"),
              "a file over the size cap is refused by load (%s)", err.msg);
    unlink(path);
    free(buf);
    rc = ds41_daemon_config_load("/nonexistent/ds41d.yaml", &cfg, &err);
    TAP_CHECK(rc == -1 && starts(err.msg, "/nonexistent/ds41d.yaml: cannot open"), "a missing file: %s", err.msg);
    rc = ds41_daemon_config_load("/tmp", &cfg, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "not a regular file"), "a directory is refused: %s", err.msg);
    TAP_CHECK(cfg.listen.socket == NULL && cfg.models == NULL, "a failed load leaves a zeroed config");
    ds41_daemon_config_free(&cfg);
}

/* ---- models and cross-key rules ---------------------------------------------- */

static void test_models(void) {
    ds41_daemon_config cfg;
    ds41_error err;
    int rc = parse("models:\n  - name: big\n    path: /srv/models/big/\n  - path: /srv/models//v41\n"
                   "    default: true\n  - name: other:7b\n    path: /srv/o\n    default: false\n",
                   &cfg, &err);
    const ds41_daemon_model *d = rc == 0 ? ds41_daemon_config_default_model(&cfg) : NULL;
    TAP_CHECK(rc == 0 && cfg.n_models == 3 && strcmp(cfg.models[0].path, "/srv/models/big") == 0 &&
                  strcmp(cfg.models[1].name, DS41_DAEMON_CONFIG_REAL_MODEL_NAME) == 0 &&
                  strcmp(cfg.models[1].path, "/srv/models/v41") == 0 && d == &cfg.models[1] &&
                  strcmp(cfg.models[2].name, "other:7b") == 0,
              "models list: names (default deepseek-v4.1-flash), normalized paths, the marked default (%s)",
              rc ? err.msg : "ok");
    ds41_daemon_config_free(&cfg);
    rc = parse("models:\n  - {name: a, path: /a}\n  - {name: b, path: /b}\n", &cfg, &err);
    TAP_CHECK(rc == 0 && ds41_daemon_config_default_model(&cfg) == &cfg.models[0],
              "no entry marked default: the first is the default");
    ds41_daemon_config_free(&cfg);
    rc = parse("models: []\nembedded_model: {enabled: true}\n", &cfg, &err);
    TAP_CHECK(rc == 0 && cfg.n_models == 0 && ds41_daemon_config_default_model(&cfg) == NULL, "an empty list");
    ds41_daemon_config_free(&cfg);
    rc = parse("models:\n  - path: /srv/m\nembedded_model:\n  enabled: false\n", &cfg, &err);
    TAP_CHECK(rc == 0, "embedded model off with a configured model (%s)", rc ? err.msg : "ok");
    ds41_daemon_config_free(&cfg);

    expect_error("models:\n  - name: a\n", "t.yaml:2:5: key 'models[0]':", "missing required key 'path'",
                 "an entry without path");
    expect_error("models:\n  - {name: a, path: /a}\n  - {name: a, path: /b}\n", "t.yaml:3:12: key 'models[1].name':",
                 "already used by models[0]", "duplicate model names");
    expect_error("models:\n  - path: /a\n  - path: /b\n", "t.yaml:3:5: key 'models[1].name':",
                 "already used by models[0]", "two entries with the default name point at the second entry");
    expect_error("models:\n  - {name: a, path: /a}\n  - {name: b, path: /a/}\n", "t.yaml:3:21: key 'models[1].path':",
                 "already used by models[0]", "duplicate model paths (after normalization)");
    expect_error("models:\n  - {name: a, path: /a, default: true}\n  - {name: b, path: /b, default: true}\n",
                 "t.yaml:3:34: key 'models[1].default':", "only one model may be the default", "two defaults");
    expect_error("models:\n  - {name: ds41-tiny, path: /a}\n", "t.yaml:2:12: key 'models[0].name':",
                 "embedded_model.name", "a model named like the embedded model");
    expect_error("embedded_model:\n  name: mine\nmodels:\n  - {name: mine, path: /a}\n",
                 "t.yaml:4:12: key 'models[0].name':", "embedded_model.name", "the later of the two clashing names");
    expect_error("models:\n  - {name: mine, path: /a}\nembedded_model:\n  name: mine\n",
                 "t.yaml:4:9: key 'embedded_model.name':", "own name", "... whichever comes later");
    expect_error("embedded_model:\n  enabled: false\n", "t.yaml:2:12: key 'embedded_model.enabled':", "nothing to serve",
                 "nothing to serve");
}

static void test_cross_rules(void) {
    expect_error("engine:\n  max_sequences: 100\n  max_batch_tokens: 50\n", "t.yaml:3:21: key 'engine.max_batch_tokens':",
                 "at least engine.max_sequences", "max_batch_tokens < max_sequences");
    expect_error("engine:\n  max_batch_tokens: 50\n  max_sequences: 100\n", "t.yaml:3:18: key 'engine.max_sequences':",
                 "at least engine.max_sequences", "... positioned at the later key");
    expect_error("engine:\n  prefill_chunk: 16384\n", "t.yaml:2:18: key 'engine.prefill_chunk':",
                 "at least engine.prefill_chunk", "prefill_chunk > max_batch_tokens (default)");
    expect_error("limits:\n  max_context: 1000\n", "t.yaml:2:16: key 'limits.max_context':", "max_tokens_default",
                 "max_context < max_tokens_default");
    expect_error("memory:\n  kv_cache_bytes: 1GiB\nprefix_cache:\n  max_bytes: 2GiB\n",
                 "t.yaml:4:14: key 'prefix_cache.max_bytes':", "exceeds memory.kv_cache_bytes",
                 "prefix cache larger than the KV cache");
    expect_error("memory:\n  expert_cache_bytes: 8GiB\n  host_expert_cache_bytes: 4GiB\n",
                 "t.yaml:3:28: key 'memory.host_expert_cache_bytes':", "below memory.expert_cache_bytes (8GiB)",
                 "a host expert tier below the device tier");
    {
        ds41_daemon_config hc;
        ds41_error herr;
        const int hrc = parse("memory:\n  expert_cache_bytes: 8GiB\n  host_expert_cache_bytes: 64GiB\n", &hc, &herr);
        TAP_CHECK(hrc == 0 && hc.memory.host_expert_cache_bytes == 64ull << 30,
                  "memory.host_expert_cache_bytes takes a size (%s)", hrc ? herr.msg : "ok");
        if (hrc == 0) ds41_daemon_config_free(&hc);
    }
    ds41_daemon_config cfg;
    ds41_error err;
    int rc = parse("limits:\n  max_context: 0\n  max_tokens_default: 100000\nprefix_cache:\n  max_bytes: 1TiB\n"
                   "engine:\n  max_sequences: 4096\n  max_batch_tokens: 4096\n  prefill_chunk: 4096\n",
                   &cfg, &err);
    TAP_CHECK(rc == 0, "rules hold at their edges (context 0 = model's, kv auto, equal batch sizes) (%s)",
              rc ? err.msg : "ok");
    ds41_daemon_config_free(&cfg);
}

/* ---- overrides, dump, misc ----------------------------------------------------- */

static void test_overrides(void) {
    ds41_daemon_config cfg;
    ds41_error err;
    int rc = ds41_daemon_config_load(DEFAULT_FILE, &cfg, &err);
    rc = rc || ds41_daemon_config_set(&cfg, "listen.socket", "/tmp/x//ds41.sock", &err);
    rc = rc || ds41_daemon_config_set(&cfg, "engine.threads", "12", &err);
    rc = rc || ds41_daemon_config_set(&cfg, "listen.tcp", "127.0.0.1:9000", &err);
    rc = rc || ds41_daemon_config_set(&cfg, "memory.kv_cache_bytes", "2GiB", &err);
    rc = rc || ds41_daemon_config_set(&cfg, "auth.admin_group", "null", &err);
    rc = rc || ds41_daemon_config_validate(&cfg, &err);
    TAP_CHECK(rc == 0 && strcmp(cfg.listen.socket, "/tmp/x/ds41.sock") == 0 && cfg.engine.threads == 12 &&
                  strcmp(cfg.listen.tcp, "127.0.0.1:9000") == 0 && cfg.memory.kv_cache_bytes == 2ull << 30 &&
                  cfg.auth.admin_group == NULL,
              "set() overrides path, integer, address, size and null values (%s)", rc ? err.msg : "ok");

    rc = ds41_daemon_config_set(&cfg, "listen.socket", "relative.sock", &err);
    TAP_CHECK(rc == -1 && starts(err.msg, "key 'listen.socket':") && strcmp(cfg.listen.socket, "/tmp/x/ds41.sock") == 0,
              "a bad override names the key and leaves the value (%s)", err.msg);
    rc = ds41_daemon_config_set(&cfg, "listen.socket", "/run/\xff\xfe.sock", &err);
    TAP_CHECK(rc == -1 && has(err.msg, "not valid UTF-8"), "an override that is not UTF-8 is refused: %s", err.msg);
    rc = ds41_daemon_config_set(&cfg, "engine.thread", "1", &err);
    TAP_CHECK(rc == -1 && has(err.msg, "unknown key"), "an unknown override key: %s", err.msg);
    rc = ds41_daemon_config_set(&cfg, "models[].path", "/x", &err);
    TAP_CHECK(rc == -1 && has(err.msg, "--model"), "models entries are not set key by key: %s", err.msg);

    rc = ds41_daemon_config_set_model(&cfg, NULL, "/srv/models/v41/", &err);
    TAP_CHECK(rc == 0 && cfg.n_models == 1 && strcmp(cfg.models[0].path, "/srv/models/v41") == 0 &&
                  strcmp(cfg.models[0].name, DS41_DAEMON_CONFIG_REAL_MODEL_NAME) == 0 && cfg.models[0].is_default &&
                  ds41_daemon_config_validate(&cfg, &err) == 0,
              "--model DIR replaces the models list with one default entry");
    rc = ds41_daemon_config_set_model(&cfg, "x", "../up", &err);
    TAP_CHECK(rc == -1 && starts(err.msg, "key 'models[0].path':") && strcmp(cfg.models[0].path, "/srv/models/v41") == 0,
              "a bad --model is refused and leaves the list (%s)", err.msg);
    rc = ds41_daemon_config_set_model(&cfg, "bad name", "/a", &err);
    TAP_CHECK(rc == -1 && starts(err.msg, "key 'models[0].name':"), "a bad model name: %s", err.msg);

    ds41_daemon_config_set(&cfg, "engine.max_batch_tokens", "100", &err);
    rc = ds41_daemon_config_validate(&cfg, &err);
    TAP_CHECK(rc == -1 && starts(err.msg, "key 'engine.max_batch_tokens':"),
              "validate() after overrides catches a cross-key rule, without position (%s)", err.msg);
    ds41_daemon_config_free(&cfg);
    ds41_daemon_config_free(&cfg);
    TAP_CHECK(cfg.listen.socket == NULL, "free is idempotent");
}

static bool round_trips(const ds41_daemon_config *cfg, char **text_out) {
    char *out = NULL;
    size_t out_len = 0;
    FILE *f = open_memstream(&out, &out_len);
    ds41_error err;
    bool ok = f && ds41_daemon_config_write_yaml(cfg, f, &err) == 0;
    if (f) fclose(f);
    ds41_daemon_config back;
    ok = ok && ds41_daemon_config_parse(out, out_len, "dump", &back, &err) == 0;
    ok = ok && ds41_daemon_config_equal(cfg, &back);
    if (ok) ds41_daemon_config_free(&back);
    if (text_out) *text_out = out;
    else free(out);
    return ok;
}

static void test_dump(void) {
    ds41_daemon_config cfg;
    ds41_error err;
    ds41_daemon_config_defaults(&cfg, &err);
    char *text = NULL;
    TAP_CHECK(round_trips(&cfg, &text), "the defaults dump to YAML that parses back equal");
    TAP_CHECK(has(text, "socket_mode: \"0660\"") && has(text, "max_body_bytes: 8MiB") &&
                  has(text, "kv_cache_bytes: auto") && has(text, "tcp: null") && has(text, "models: []"),
              "the dump shows modes, sizes with units, auto and null");
    free(text);
    ds41_daemon_config_free(&cfg);

    int rc = parse("listen:\n  socket: \"/run/with space/#x.sock\"\n  socket_group: \"null\"\n  tcp: \"[::1]:1\"\n"
                   "auth: {admin_group: null}\nmodels:\n  - {name: 'a:b', path: \"/srv/m: x\", default: true}\n"
                   "  - {name: c, path: /srv/c}\nmemory: {kv_cache_bytes: 1000, expert_cache_bytes: 1.5GiB}\n"
                   "embedded_model: {seed: 0, preset: long}\nlog: {level: error}\nengine: {mode: reference}\n",
                   &cfg, &err);
    TAP_CHECK(rc == 0 && round_trips(&cfg, NULL),
              "a config with odd strings, two models and non-default values round-trips (%s)", rc ? err.msg : "ok");
    char dir[256];
    rc = ds41_daemon_config_embedded_dir(&cfg, dir, sizeof dir, &err);
    TAP_CHECK(rc == 0 && strcmp(dir, "/var/lib/ds41d/embedded/long-seed0") == 0, "embedded_dir: %s", dir);
    char tiny[8];
    TAP_CHECK(ds41_daemon_config_embedded_dir(&cfg, tiny, sizeof tiny, &err) == -1, "embedded_dir checks the buffer");
    ds41_daemon_config other;
    parse("models:\n  - {name: 'a:b', path: \"/srv/m: x\"}\n  - {name: c, path: /srv/c}\n", &other, &err);
    TAP_CHECK(!ds41_daemon_config_equal(&cfg, &other), "equal() sees differences");
    ds41_daemon_config_free(&other);
    ds41_daemon_config_free(&cfg);

    FILE *f = fopen("/dev/full", "w");
    ds41_daemon_config_defaults(&cfg, &err);
    if (f) {
        setvbuf(f, NULL, _IONBF, 0);
        rc = ds41_daemon_config_write_yaml(&cfg, f, &err);
        fclose(f);
        TAP_CHECK(rc == -1, "a write error is reported (%s)", err.msg);
    } else {
        TAP_SKIP("/dev/full is not available");
    }
    ds41_daemon_config_free(&cfg);
}

int main(void) {
    test_default_file();
    test_documentation();
    test_bad_values();
    test_sizes();
    test_modes_and_scalars();
    test_loopback();
    test_structure();
    test_models();
    test_cross_rules();
    test_overrides();
    test_dump();
    return tap_done();
}
