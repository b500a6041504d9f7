/* storage/snapshot: the session snapshot file format -- checksums, round trips, every corruption
 * and truncation refused with a message naming the file, atomic writes (a writer killed in the
 * middle of a save leaves only a temporary file, which is cleaned), model identity. */
#include "engine/model/model_gen.h"
#include "storage/snapshot.h"
#include "storage/snapshot_store.h"
#include "tap.h"
#include "tmpdir.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char ROOT[512];
static uint8_t MODEL_A[32], MODEL_B[32];
/* two prefix-cache partitions (issue 13): different keys, different owners */
static ds41_snapshot_owner OWN_A = {.key = {0xA0, 1, 2, 3}, .uid = 1000},
                           OWN_B = {.key = {0xB0, 1, 2, 3}, .uid = 1001};

static uint8_t *slurp(const char *path, size_t *len) {
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(n > 0 ? (size_t)n : 1);
    *len = fread(b, 1, (size_t)n, f);
    fclose(f);
    return b;
}

static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Recompute both checksums (to reach the checks behind them). */
static void fix_checks(uint8_t *b, size_t len) {
    uint64_t n_ids = get64(b + 48);
    uint64_t hc = ds41_crc64(0, b, 128);
    hc = ds41_crc64(hc, b + DS41_SNAPSHOT_HEAD_BYTES, 4 * n_ids);
    put64(b + 128, hc);
    put64(b + len - 8, ds41_crc64(0, b, len - 8));
}

static bool refused(const uint8_t *b, size_t len, const uint8_t *model, uint64_t max_raw, const char *want,
                    char *msg, size_t msg_size) {
    ds41_snapshot s;
    ds41_error err = {{0}};
    int rc = ds41_snapshot_parse(b, len, "SNAPFILE", model, max_raw, &s, &err);
    snprintf(msg, msg_size, "%.300s", err.msg);
    if (rc == 0) {
        ds41_snapshot_free(&s);
        return false;
    }
    return s.ids == NULL && s.kv == NULL && strstr(err.msg, "SNAPFILE") && (!want || strstr(err.msg, want));
}

static void test_hashes(void) {
    TAP_CHECK(ds41_crc64(0, "123456789", 9) == 0x995DC9BBDF1939FAull, "CRC-64/XZ check value");
    TAP_CHECK(ds41_crc64(ds41_crc64(0, "1234", 4), "56789", 5) == 0x995DC9BBDF1939FAull, "CRC-64 continues");
    uint8_t h[32];
    ds41_sha256("abc", 3, h);
    static const uint8_t abc[32] = {0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40,
                                    0xde, 0x5d, 0xae, 0x22, 0x23, 0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17,
                                    0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad};
    TAP_CHECK(memcmp(h, abc, 32) == 0, "SHA-256(\"abc\")");
    char m[1000];
    memset(m, 'a', sizeof m);
    ds41_sha256(m, 1000, h); /* 1000 x 'a' spans several blocks and the length padding */
    static const uint8_t a1000[32] = {0x41, 0xed, 0xec, 0xe4, 0x2d, 0x63, 0xe8, 0xd9, 0xbf, 0x51, 0x5a,
                                      0x9b, 0xa6, 0x93, 0x2e, 0x1c, 0x20, 0xcb, 0xc9, 0xf5, 0xa5, 0xd1,
                                      0x34, 0x64, 0x5a, 0xdb, 0x5d, 0xb1, 0xb9, 0x73, 0x7e, 0xa3};
    TAP_CHECK(memcmp(h, a1000, 32) == 0, "SHA-256 of 1000 'a'");
}

static int32_t IDS[300];
static uint8_t KV[5000], SMP[77];

static void test_round_trip(void) {
    char path[700];
    snprintf(path, sizeof path, "%s/one.snap", ROOT);
    ds41_error err = {{0}};
    uint64_t bytes = 0;
    int rc = ds41_snapshot_write(path, MODEL_A, &OWN_A, IDS, 300, KV, sizeof KV, SMP, sizeof SMP, NULL,
                                 &bytes, &err);
    struct stat st;
    TAP_CHECK(rc == 0 && stat(path, &st) == 0 && (uint64_t)st.st_size == bytes, "write (%llu bytes; %s)",
              (unsigned long long)bytes, rc ? err.msg : "ok");
    TAP_CHECK(bytes < sizeof KV, "the payload is compressed (%llu < %zu)", (unsigned long long)bytes,
              sizeof KV);
    ds41_snapshot s;
    rc = ds41_snapshot_read(path, MODEL_A, 1 << 20, &s, &err);
    TAP_CHECK(rc == 0 && s.n_ids == 300 && memcmp(s.ids, IDS, sizeof IDS) == 0 && s.kv_len == sizeof KV &&
                  memcmp(s.kv, KV, sizeof KV) == 0 && s.sampler_len == sizeof SMP &&
                  memcmp(s.sampler, SMP, sizeof SMP) == 0 && s.flags == DS41_SNAPSHOT_FLAG_SAMPLER &&
                  s.created > 0,
              "read gives back ids, KV state and sampler state (%s)", rc ? err.msg : "ok");
    TAP_CHECK(rc == 0 && memcmp(s.owner.key, OWN_A.key, sizeof OWN_A.key) == 0 && s.owner.uid == 1000,
              "read gives back the partition key and owner uid");
    ds41_snapshot_free(&s);
    rc = ds41_snapshot_read_head(path, MODEL_A, &s, &err);
    TAP_CHECK(rc == 0 && s.n_ids == 300 && memcmp(s.ids, IDS, sizeof IDS) == 0 && !s.kv &&
                  s.kv_len == sizeof KV,
              "read_head gives the ids without the payload (%s)", rc ? err.msg : "ok");
    ds41_snapshot_free(&s);
    rc = ds41_snapshot_read_head(path, MODEL_B, &s, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, path) && strstr(err.msg, "another model"),
              "read_head refuses another model's snapshot (%s)", err.msg);
    rc = ds41_snapshot_read(path, MODEL_B, 1 << 20, &s, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, path) && strstr(err.msg, "another model"),
              "read refuses another model's snapshot, naming the file (%s)", err.msg);
    rc = ds41_snapshot_read(path, MODEL_A, sizeof KV, &s, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, "exceeds"),
              "a state larger than the caller's bound is refused (%s)", err.msg);

    /* without a sampler */
    char p2[700];
    snprintf(p2, sizeof p2, "%s/two.snap", ROOT);
    rc = ds41_snapshot_write(p2, MODEL_A, &OWN_A, IDS, 1, KV, 10, NULL, 0, NULL, NULL, &err);
    if (rc == 0) rc = ds41_snapshot_read(p2, NULL, 1 << 20, &s, &err);
    TAP_CHECK(rc == 0 && s.n_ids == 1 && s.kv_len == 10 && !s.sampler && s.flags == 0,
              "a snapshot without sampler state round-trips (%s)", rc ? err.msg : "ok");
    ds41_snapshot_free(&s);
    /* bad arguments */
    int32_t neg[2] = {1, -5};
    TAP_CHECK(ds41_snapshot_write(p2, MODEL_A, &OWN_A, neg, 2, KV, 10, NULL, 0, NULL, NULL, &err) == -1 &&
                  strstr(err.msg, "negative"),
              "negative ids are refused at write (%s)", err.msg);
    TAP_CHECK(ds41_snapshot_write(p2, MODEL_A, &OWN_A, IDS, 0, KV, 10, NULL, 0, NULL, NULL, &err) == -1,
              "no ids is refused at write (%s)", err.msg);
    char p3[700];
    snprintf(p3, sizeof p3, "%s/missing-dir/x.snap", ROOT);
    TAP_CHECK(ds41_snapshot_write(p3, MODEL_A, &OWN_A, IDS, 3, KV, 10, NULL, 0, NULL, NULL, &err) == -1 &&
                  strstr(err.msg, p3),
              "an unwritable place fails naming the file (%s)", err.msg);
    rc = ds41_snapshot_read(p3, MODEL_A, 1 << 20, &s, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, p3), "a missing file fails naming it (%s)", err.msg);

    /* every corruption and truncation */
    size_t len = 0;
    uint8_t *file = slurp(path, &len);
    if (!file) return;
    uint8_t *b = malloc(len + 1);
    char msg[400];
    size_t bad = SIZE_MAX;
    for (size_t i = 0; i < len && bad == SIZE_MAX; i++) {
        memcpy(b, file, len);
        b[i] ^= (uint8_t)(1u << (i % 8));
        if (!refused(b, len, MODEL_A, 1 << 20, NULL, msg, sizeof msg)) bad = i;
    }
    TAP_CHECK(bad == SIZE_MAX, "every single-bit flip of the %zu bytes is refused (first accepted: %lld)",
              len, bad == SIZE_MAX ? -1LL : (long long)bad);
    memcpy(b, file, len);
    b[len / 2] ^= 0x40;
    TAP_CHECK(refused(b, len, MODEL_A, 1 << 20, "checksum mismatch (file corrupted)", msg, sizeof msg),
              "a corrupted payload: checksum mismatch (%s)", msg);
    bad = SIZE_MAX;
    for (size_t n = 0; n < len && bad == SIZE_MAX; n++)
        if (!refused(file, n, MODEL_A, 1 << 20, NULL, msg, sizeof msg)) bad = n;
    TAP_CHECK(bad == SIZE_MAX, "every truncation is refused (first accepted: %lld)",
              bad == SIZE_MAX ? -1LL : (long long)bad);
    TAP_CHECK(refused(file, len - 100, MODEL_A, 1 << 20, "truncated", msg, sizeof msg), "truncated file (%s)",
              msg);
    memcpy(b, file, len);
    b[len] = 0;
    TAP_CHECK(refused(b, len + 1, MODEL_A, 1 << 20, "trailing data", msg, sizeof msg), "trailing data (%s)",
              msg);
    memcpy(b, file, len);
    b[8] = 3;
    fix_checks(b, len);
    TAP_CHECK(refused(b, len, MODEL_A, 1 << 20, "format version 3, this build reads 2", msg, sizeof msg),
              "another format version (%s)", msg);
    memcpy(b, file, len);
    b[12] = 4;
    fix_checks(b, len);
    TAP_CHECK(refused(b, len, MODEL_A, 1 << 20, "unknown flags", msg, sizeof msg), "unknown flags (%s)", msg);
    memcpy(b, file, len);
    b[0] = 'X';
    TAP_CHECK(refused(b, len, MODEL_A, 1 << 20, "bad magic", msg, sizeof msg), "bad magic (%s)", msg);
    memcpy(b, file, len);
    b[DS41_SNAPSHOT_HEAD_BYTES + 3] = 0x80; /* id 0 >= 2^31 */
    fix_checks(b, len);
    TAP_CHECK(refused(b, len, MODEL_A, 1 << 20, "out of range", msg, sizeof msg), "an id beyond int32 (%s)",
              msg);
    memcpy(b, file, len);
    put64(b + 56, sizeof KV + 1); /* kv_len no longer matches the frame */
    fix_checks(b, len);
    TAP_CHECK(refused(b, len, MODEL_A, 1 << 20, "does not declare", msg, sizeof msg),
              "lengths that disagree with the zstd frame (%s)", msg);
    memcpy(b, file, len);
    b[DS41_SNAPSHOT_HEAD_BYTES + 4 * 300 + 60] ^=
        0x55; /* inside the zstd frame, checksums fixed: zstd must catch it or the sizes */
    fix_checks(b, len);
    {
        ds41_snapshot s2;
        ds41_error e2 = {{0}};
        int r = ds41_snapshot_parse(b, len, "SNAPFILE", MODEL_A, 1 << 20, &s2, &e2);
        bool ok = r == -1 ? strstr(e2.msg, "SNAPFILE") != NULL : s2.kv_len == sizeof KV; /* never a crash */
        ds41_snapshot_free(&s2);
        TAP_CHECK(ok, "a damaged zstd frame behind valid checksums never crashes (%s)",
                  r ? e2.msg : "decoded");
    }
    free(b);
    free(file);
}

static void test_atomic(void) {
    char dir[700], path[800];
    snprintf(dir, sizeof dir, "%s/atomic", ROOT);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/victim.snap", dir);
    ds41_error err = {{0}};
    /* an old version of the file exists */
    int rc = ds41_snapshot_write(path, MODEL_A, &OWN_A, IDS, 10, KV, 100, NULL, 0, NULL, NULL, &err);
    pid_t pid = fork();
    if (pid == 0) {
        ds41_snapshot_write_opts o = {.test_delay_ms = 5000};
        ds41_snapshot_write(path, MODEL_A, &OWN_A, IDS, 300, KV, sizeof KV, NULL, 0, &o, NULL, &err);
        _exit(0);
    }
    /* wait until the temporary file appears, then kill the writer mid-save */
    int tmp_seen = 0;
    for (int i = 0; i < 400 && !tmp_seen; i++) {
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL);
        char cmd[900];
        snprintf(cmd, sizeof cmd, "ls -a %s | grep -q '^\\.tmp-victim.snap'", dir);
        tmp_seen = system(cmd) == 0;
    }
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    ds41_snapshot s;
    int rr = ds41_snapshot_read(path, MODEL_A, 1 << 20, &s, &err);
    TAP_CHECK(rc == 0 && tmp_seen && WIFSIGNALED(status) && rr == 0 && s.n_ids == 10,
              "SIGKILL in the middle of a save leaves the previous snapshot intact (%s)",
              rr ? err.msg : "ok");
    ds41_snapshot_free(&s);
    TAP_CHECK(ds41_snapshot_clean_temp(dir) == 1, "the killed writer's temporary file is cleaned");
    TAP_CHECK(ds41_snapshot_clean_temp(dir) == 0, "and nothing else is removed");
}

static void test_model_id(void) {
    char a[700], b[700], c[700];
    snprintf(a, sizeof a, "%s/m1", ROOT);
    snprintf(b, sizeof b, "%s/m2", ROOT);
    snprintf(c, sizeof c, "%s/m3", ROOT);
    ds41_error err = {{0}};
    ds41_model_gen_opts o1 = {.preset = "tiny", .seed = 1}, o2 = {.preset = "tiny", .seed = 2};
    int rc = ds41_model_generate(a, &o1, NULL, &err);
    if (rc == 0) rc = ds41_model_generate(b, &o2, NULL, &err);
    if (rc == 0) rc = ds41_model_generate(c, &o1, NULL, &err);
    uint8_t ia[32], ib[32], ic[32], ia2[32];
    if (rc == 0) rc = ds41_snapshot_model_id(a, ia, &err);
    if (rc == 0) rc = ds41_snapshot_model_id(b, ib, &err);
    if (rc == 0) rc = ds41_snapshot_model_id(c, ic, &err);
    if (rc == 0) rc = ds41_snapshot_model_id(a, ia2, &err);
    TAP_CHECK(rc == 0 && memcmp(ia, ia2, 32) == 0 && memcmp(ia, ic, 32) == 0,
              "model identity: stable, equal for identical checkpoints (%s)", rc ? err.msg : "ok");
    TAP_CHECK(rc == 0 && memcmp(ia, ib, 32) != 0,
              "model identity differs for checkpoints that differ only in the seed");
    char missing[800];
    snprintf(missing, sizeof missing, "%s/nope", ROOT);
    TAP_CHECK(ds41_snapshot_model_id(missing, ia, &err) == -1 && strstr(err.msg, "config.json"),
              "a directory without a config fails naming the file (%s)", err.msg);
}

static void collect(void *acc, const ds41_snapshot_entry *e) {
    ds41_snapshot_entry *v = acc;
    for (int i = 0; i < 16; i++)
        if (!v[i].name[0]) {
            v[i] = *e;
            return;
        }
}

static size_t count_entries(ds41_snapshot_store *st, ds41_snapshot_entry *v) {
    memset(v, 0, 16 * sizeof *v);
    ds41_snapshot_store_list(st, collect, v);
    size_t n = 0;
    while (n < 16 && v[n].name[0]) n++;
    return n;
}

static void test_store(void) {
    char dir[700];
    snprintf(dir, sizeof dir, "%s/store/model-a", ROOT);
    ds41_snapshot_store_opts o = {.dir = dir};
    memcpy(o.model_id, MODEL_A, 32);
    ds41_snapshot_store *st = NULL;
    ds41_error err = {{0}};
    int rc = ds41_snapshot_store_open(&o, &st, &err);
    if (!TAP_CHECK(rc == 0, "store: opens (creating %s) (%s)", dir, rc ? err.msg : "ok")) return;
    ds41_snapshot_entry e100, e200;
    rc = ds41_snapshot_store_save(st, &OWN_A, IDS, 100, KV, 1000, NULL, 0, &e100, &err);
    if (rc == 0) rc = ds41_snapshot_store_save(st, &OWN_A, IDS, 200, KV, 2000, SMP, sizeof SMP, &e200, &err);
    TAP_CHECK(rc == 0 && strlen(e100.name) == 40 && e200.has_sampler && e200.n_ids == 200,
              "store: two saves (%s)", rc ? err.msg : "ok");
    char name[41];
    size_t m1 = ds41_snapshot_store_match(st, &OWN_A, IDS, 250, name);
    bool n1 = strcmp(name, e200.name) == 0;
    size_t m2 = ds41_snapshot_store_match(st, &OWN_A, IDS, 150, name);
    size_t m3 = ds41_snapshot_store_match(st, &OWN_A, IDS, 100, name);
    int32_t other[120];
    memcpy(other, IDS, sizeof other);
    other[50] ^= 1;
    size_t m4 = ds41_snapshot_store_match(st, &OWN_A, other, 120, name);
    TAP_CHECK(m1 == 200 && n1 && m2 == 100 && m3 == 0 && m4 == 0,
              "store: match finds the longest proper prefix (%zu %zu %zu %zu)", m1, m2, m3, m4);
    ds41_snapshot s;
    rc = ds41_snapshot_store_load(st, e200.name, &s, &err);
    TAP_CHECK(rc == 0 && s.n_ids == 200 && s.kv_len == 2000 && memcmp(s.kv, KV, 2000) == 0 &&
                  s.sampler_len == sizeof SMP,
              "store: load gives the state back (%s)", rc ? err.msg : "ok");
    ds41_snapshot_free(&s);
    int32_t *ids = malloc(50 * sizeof *ids);
    uint8_t *kv = malloc(500);
    memcpy(ids, IDS, 50 * sizeof *ids);
    memcpy(kv, KV, 500);
    rc = ds41_snapshot_store_save_async(st, &OWN_A, ids, 50, kv, 500, &err);
    ds41_snapshot_store_flush(st);
    ds41_snapshot_entry v[16];
    TAP_CHECK(rc == 0 && count_entries(st, v) == 3 &&
                  ds41_snapshot_store_match(st, &OWN_A, IDS, 60, name) == 50,
              "store: an asynchronous save is indexed after flush");
    TAP_CHECK(ds41_snapshot_store_load(st, "../../etc/passwd", &s, &err) == -1 &&
                  strstr(err.msg, "no snapshot"),
              "store: a malformed name is refused (%s)", err.msg);
    ds41_snapshot_store_free(st);

    /* a crashed writer's temp file, a file of another model, a corrupted file */
    char p[900];
    snprintf(p, sizeof p, "%s/.tmp-x.snap-1-1", dir);
    FILE *f = fopen(p, "w");
    if (f) fclose(f);
    char other_name[41];
    ds41_snapshot_store_name(&OWN_A, IDS, 7, other_name);
    snprintf(p, sizeof p, "%s/%s.snap", dir, other_name);
    ds41_snapshot_write(p, MODEL_B, &OWN_A, IDS, 7, KV, 10, NULL, 0, NULL, NULL, &err);
    rc = ds41_snapshot_store_open(&o, &st, &err);
    size_t n_after = rc == 0 ? count_entries(st, v) : 0;
    TAP_CHECK(rc == 0 && n_after == 3 && ds41_snapshot_store_match(st, &OWN_A, IDS, 250, name) == 200,
              "store: reopening rebuilds the index from the files, skipping another model's (%zu entries)",
              n_after);
    snprintf(p, sizeof p, "%s/%s.snap", dir, other_name);
    struct stat sb0;
    TAP_CHECK(stat(p, &sb0) != 0, "store: the other model's snapshot is deleted at open");
    struct stat sb;
    snprintf(p, sizeof p, "%s/.tmp-x.snap-1-1", dir);
    TAP_CHECK(stat(p, &sb) != 0, "store: opening removes temporary files of interrupted saves");
    if (rc != 0) return;
    snprintf(p, sizeof p, "%s/%s.snap", dir, e200.name);
    {
        size_t len = 0;
        uint8_t *b = slurp(p, &len);
        if (b && len > 200) {
            b[len - 100] ^= 0xFF;
            FILE *w = fopen(p, "wb");
            fwrite(b, 1, len, w);
            fclose(w);
        }
        free(b);
    }
    rc = ds41_snapshot_store_load(st, e200.name, &s, &err);
    TAP_CHECK(
        rc == -1 && strstr(err.msg, p) && strstr(err.msg, "checksum") && stat(p, &sb) != 0 &&
            ds41_snapshot_store_match(st, &OWN_A, IDS, 250, name) == 100,
        "store: a corrupted snapshot is refused naming the file, deleted, and the next match falls back (%s)",
        err.msg);
    snprintf(p, sizeof p, "%s/%s.snap", dir, e100.name);
    truncate(p, 60);
    rc = ds41_snapshot_store_load(st, e100.name, &s, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, p) && strstr(err.msg, "truncated"),
              "store: a truncated snapshot is refused (%s)", err.msg);
    ds41_snapshot_store_stats ss;
    ds41_snapshot_store_get_stats(st, &ss);
    TAP_CHECK(ss.load_errors == 2 && ss.entries == 1,
              "store: statistics count the refused loads (%llu errors, %llu entries)",
              (unsigned long long)ss.load_errors, (unsigned long long)ss.entries);
    ds41_snapshot_store_free(st);

    /* LRU cap */
    char dir2[700];
    snprintf(dir2, sizeof dir2, "%s/store/capped", ROOT);
    o.dir = dir2;
    o.max_bytes = 2500;
    rc = ds41_snapshot_store_open(&o, &st, &err);
    if (rc != 0) return;
    ds41_snapshot_entry a, b, c;
    static uint8_t noise[3000];
    uint64_t x = 1;
    for (size_t i = 0; i < sizeof noise; i++) {
        x = x * 6364136223846793005u + 1442695040888963407u;
        noise[i] = (uint8_t)(x >> 56);
    }
    ds41_snapshot_store_save(st, &OWN_A, IDS, 10, noise, 1000, NULL, 0, &a, &err);
    ds41_snapshot_store_save(st, &OWN_A, IDS, 20, noise, 1000, NULL, 0, &b, &err);
    ds41_snapshot_store_load(st, a.name, &s, &err); /* a becomes the most recently used */
    ds41_snapshot_free(&s);
    sleep(1);
    ds41_snapshot_store_load(st, a.name, &s, &err);
    ds41_snapshot_free(&s);
    ds41_snapshot_store_save(st, &OWN_A, IDS, 30, noise, 1000, NULL, 0, &c, &err);
    size_t n = count_entries(st, v);
    bool has_a = false, has_b = false, has_c = false;
    for (size_t i = 0; i < n; i++) {
        has_a |= strcmp(v[i].name, a.name) == 0;
        has_b |= strcmp(v[i].name, b.name) == 0;
        has_c |= strcmp(v[i].name, c.name) == 0;
    }
    ds41_snapshot_store_get_stats(st, &ss);
    TAP_CHECK(has_a && !has_b && has_c && ss.bytes <= 2500 && ss.evictions == 1,
              "store: the byte cap evicts the least recently used snapshot (%zu left, %llu bytes)", n,
              (unsigned long long)ss.bytes);
    TAP_CHECK(ds41_snapshot_store_remove(st, a.name, &err) == 0 &&
                  ds41_snapshot_store_remove(st, a.name, &err) == -1 && strstr(err.msg, "no snapshot"),
              "store: remove deletes once (%s)", err.msg);
    ds41_snapshot_store_free(st);
}

/* ---- partitions (issue 13) -------------------------------------------------------------------- */

static char LOGGED[2048];
static void capture_log(void *ctx, const char *line) {
    (void)ctx;
    size_t n = strlen(LOGGED);
    snprintf(LOGGED + n, sizeof LOGGED - n, "%s\n", line);
}

/* A file of format version 1 (before partitions): 96-byte head, ids, a payload, file_check. */
static void write_v1(const char *path, const int32_t *ids, size_t n) {
    size_t len = 96 + 4 * n + 20 + 8;
    uint8_t *b = calloc(1, len);
    memcpy(b, "DS41SNAP", 8);
    b[8] = 1;
    memcpy(b + 16, MODEL_A, 32);
    put64(b + 48, n);
    put64(b + 56, 20);
    put64(b + 72, 20);
    put64(b + 80, (uint64_t)time(NULL));
    for (size_t i = 0; i < n; i++)
        for (int k = 0; k < 4; k++) b[96 + 4 * i + k] = (uint8_t)((uint32_t)ids[i] >> (8 * k));
    uint64_t hc = ds41_crc64(0, b, 88);
    put64(b + 88, ds41_crc64(hc, b + 96, 4 * n));
    put64(b + len - 8, ds41_crc64(0, b, len - 8));
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(b, 1, len, f);
        fclose(f);
    }
    free(b);
}

static void test_partitions(void) {
    char dir[700];
    snprintf(dir, sizeof dir, "%s/store/parts", ROOT);
    ds41_snapshot_store_opts o = {.dir = dir, .log = capture_log};
    memcpy(o.model_id, MODEL_A, 32);
    ds41_snapshot_store *st = NULL;
    ds41_error err = {{0}};
    if (!TAP_CHECK(ds41_snapshot_store_open(&o, &st, &err) == 0, "partitions: store opens (%s)", err.msg))
        return;
    ds41_snapshot_entry ea, eb;
    int rc = ds41_snapshot_store_save(st, &OWN_A, IDS, 100, KV, 1000, NULL, 0, &ea, &err);
    char name[41];
    size_t mb = ds41_snapshot_store_match(st, &OWN_B, IDS, 150, name);
    size_t ma = ds41_snapshot_store_match(st, &OWN_A, IDS, 150, name);
    TAP_CHECK(rc == 0 && mb == 0 && ma == 100 && strcmp(name, ea.name) == 0,
              "partitions: another partition's snapshot of the same prompt is not matched (B %zu, A %zu)", mb,
              ma);
    TAP_CHECK(ds41_snapshot_store_contains(st, &OWN_A, IDS, 100) &&
                  !ds41_snapshot_store_contains(st, &OWN_B, IDS, 100),
              "partitions: contains looks in the caller's partition only");
    rc = ds41_snapshot_store_save(st, &OWN_B, IDS, 100, KV, 1000, NULL, 0, &eb, &err);
    ds41_snapshot_entry v[16];
    size_t n = count_entries(st, v);
    bool owners = n == 2 && v[0].owner.uid + v[1].owner.uid == 2001;
    TAP_CHECK(rc == 0 && strcmp(ea.name, eb.name) != 0 && owners,
              "partitions: the same ids in two partitions are two files, listed with their owner uids");
    ds41_snapshot_store_free(st);

    /* a version-1 file (no partition) among them; then a restart */
    int32_t old_ids[5] = {1, 2, 3, 4, 5};
    char old_name[41], p[900];
    ds41_snapshot_store_name(&OWN_A, old_ids, 5, old_name);
    snprintf(p, sizeof p, "%s/%s.snap", dir, old_name);
    write_v1(p, old_ids, 5);
    ds41_snapshot s;
    rc = ds41_snapshot_read_head(p, MODEL_A, &s, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, p) && strstr(err.msg, "format version 1 has no cache partition"),
              "partitions: a version-1 file is refused with a clear reason (%s)", err.msg);
    LOGGED[0] = 0;
    rc = ds41_snapshot_store_open(&o, &st, &err);
    struct stat sb;
    TAP_CHECK(rc == 0 && stat(p, &sb) != 0 && strstr(LOGGED, "format version 1 has no cache partition") &&
                  strstr(LOGGED, old_name),
              "partitions: reopening deletes the version-1 file with a log line naming it (%s)", LOGGED);
    if (rc != 0) return;
    ds41_snapshot_store_name(&OWN_A, IDS, 100, name);
    n = count_entries(st, v);
    ma = ds41_snapshot_store_match(st, &OWN_A, IDS, 150, name);
    bool name_a = strcmp(name, ea.name) == 0;
    mb = ds41_snapshot_store_match(st, &OWN_B, IDS, 150, name);
    bool name_b = strcmp(name, eb.name) == 0;
    ds41_snapshot_owner own_c = OWN_A; /* the same uid, another cache_salt */
    own_c.key[31] ^= 1;
    size_t mc = ds41_snapshot_store_match(st, &own_c, IDS, 150, name);
    TAP_CHECK(
        n == 2 && ma == 100 && name_a && mb == 100 && name_b && mc == 0,
        "partitions: after a restart each partition matches only its own file, a third none (%zu %zu %zu)",
        ma, mb, mc);
    rc = ds41_snapshot_store_load(st, eb.name, &s, &err);
    TAP_CHECK(rc == 0 && memcmp(s.owner.key, OWN_B.key, sizeof OWN_B.key) == 0 && s.owner.uid == 1001,
              "partitions: a loaded snapshot carries its partition (%s)", rc ? err.msg : "ok");
    ds41_snapshot_free(&s);
    ds41_snapshot_store_free(st);
}

int main(void) {
    if (!tmpdir_make(ROOT, sizeof ROOT, "TMPDIR", "ds41-snapfmt-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    memset(MODEL_A, 0xA1, 32);
    memset(MODEL_B, 0xB2, 32);
    for (int i = 0; i < 300; i++) IDS[i] = (i * 7919) % 129280;
    for (size_t i = 0; i < sizeof KV; i++) KV[i] = (uint8_t)(i % 251 < 40 ? i * 13 : 0);
    for (size_t i = 0; i < sizeof SMP; i++) SMP[i] = (uint8_t)(i * 3 + 1);
    test_hashes();
    test_round_trip();
    test_atomic();
    test_model_id();
    test_store();
    test_partitions();
    tmpdir_remove(ROOT);
    return tap_done();
}
