/* storage/safetensors: writer -> reader round trips, the single-file layout,
 * every malformed input we know of (each must fail naming the file and the
 * tensor), and a page-cache check that opening reads no payload page.
 * Everything is written under a mkdtemp directory in /tmp, removed at the end. */
#include "storage/safetensors.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static char root[PATH_MAX];

/* ------------------------------------------------------------ helpers */

static void path_in(char *out, const char *dir, const char *name) {
    if (snprintf(out, PATH_MAX, "%s/%s", dir, name) >= PATH_MAX) exit(2);
}

/* A fresh, empty directory under the test root. */
static const char *new_dir(const char *label) {
    static char dirs[128][PATH_MAX];
    static int n;
    char *d = dirs[n++ % 128];
    if (snprintf(d, PATH_MAX, "%s/%02d-%s", root, n, label) >= PATH_MAX || mkdir(d, 0755) != 0) {
        perror(d);
        exit(2);
    }
    return d;
}

static void write_bytes(const char *dir, const char *name, const void *buf, size_t len) {
    char p[PATH_MAX];
    path_in(p, dir, name);
    FILE *f = fopen(p, "wb");
    if (!f || fwrite(buf, 1, len, f) != len || fclose(f) != 0) {
        perror(p);
        exit(2);
    }
}

static void write_text(const char *dir, const char *name, const char *text) {
    write_bytes(dir, name, text, strlen(text));
}

/* A safetensors file with the given header JSON (verbatim, N = its length)
 * followed by data_len payload bytes. */
static void write_st_n(const char *dir, const char *name, uint64_t n_field, const char *json,
                       size_t data_len) {
    size_t jl = strlen(json);
    uint8_t *buf = malloc(8 + jl + data_len + 1);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(n_field >> (8 * i));
    memcpy(buf + 8, json, jl);
    for (size_t i = 0; i < data_len; i++) buf[8 + jl + i] = (uint8_t)(i * 7 + 1);
    write_bytes(dir, name, buf, 8 + jl + data_len);
    free(buf);
}

static void write_st(const char *dir, const char *name, const char *json, size_t data_len) {
    write_st_n(dir, name, strlen(json), json, data_len);
}

static uint8_t pattern_byte(const char *name, size_t j) {
    uint32_t h = 2166136261u;
    for (const char *c = name; *c; c++) h = (h ^ (uint8_t)*c) * 16777619u;
    return (uint8_t)(h + j * 131u + (j >> 9));
}

static uint8_t *pattern(const char *name, size_t n) {
    uint8_t *b = malloc(n ? n : 1);
    for (size_t j = 0; j < n; j++) b[j] = pattern_byte(name, j);
    return b;
}

static size_t read_file(const char *path, uint8_t **out) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = malloc((size_t)len + 1);
    size_t got = fread(*out, 1, (size_t)len, f);
    fclose(f);
    (*out)[got] = 0;
    return got;
}

/* Open must fail and the message must contain want_file and (when not
 * NULL) want_tensor. */
static void expect_fail(const char *dir, const char *want_file, const char *want_tensor, const char *what) {
    ds41_error e;
    strcpy(e.msg, "(no message)");
    ds41_checkpoint *c = ds41_checkpoint_open(dir, &e);
    bool names_file = strstr(e.msg, want_file) != NULL;
    bool names_tensor = !want_tensor || strstr(e.msg, want_tensor) != NULL;
    TAP_CHECK(!c && names_file && names_tensor, "%s: open fails naming %s%s%s", what, want_file,
              want_tensor ? " and " : "", want_tensor ? want_tensor : "");
    TAP_NOTE("  -> %s", c ? "(opened!)" : e.msg);
    ds41_checkpoint_close(c);
}

/* ------------------------------------------------------ dtype table */

static void test_dtypes(void) {
    bool ok = true;
    int bad = -1;
    static const size_t sizes[DS41_DTYPE_COUNT] = {2, 2, 4, 1, 1, 1, 1, 4, 8, 1};
    for (int d = 0; d < DS41_DTYPE_COUNT; d++) {
        const char *n = ds41_dtype_name((ds41_dtype)d);
        ds41_dtype back = DS41_DTYPE_COUNT;
        if (ds41_dtype_from_name(n, strlen(n), &back) != 0 || back != (ds41_dtype)d ||
            ds41_dtype_size((ds41_dtype)d) != sizes[d]) {
            ok = false;
            if (bad < 0) bad = d;
        }
    }
    TAP_CHECK(ok, "every dtype name round-trips and has its size (first bad: %d)", bad);
    TAP_CHECK(strcmp(ds41_dtype_name(DS41_F8_E8M0), "F8_E8M0") == 0 && strcmp(ds41_dtype_name(DS41_I8), "I8") == 0,
              "dtype strings are the safetensors ones");
    static const char *const rejects[] = {"bf16", "BF1", "BF16 ", "F8_E5M2", "F64", "", "F8_E4M3\0"};
    ds41_dtype out = DS41_BF16;
    int rejected = 0;
    for (size_t i = 0; i < sizeof rejects / sizeof *rejects; i++)
        rejected += ds41_dtype_from_name(rejects[i], strlen(rejects[i]) + (i == 6), &out) != 0;
    TAP_CHECK(rejected == 7 && out == DS41_BF16, "near-miss dtype strings are rejected, *out untouched");
    TAP_CHECK(ds41_dtype_size(DS41_DTYPE_COUNT) == 0 && strcmp(ds41_dtype_name((ds41_dtype)99), "?") == 0,
              "out-of-range dtype has size 0 and name '?'");
}


/* ------------------------------------------------ writer round trip */

typedef struct decl {
    const char *name;
    ds41_dtype dtype;
    int ndim;
    int64_t shape[DS41_MAX_DIMS];
    bool break_before;
} decl;

static const decl model[] = {
    {"embed.weight", DS41_BF16, 2, {64, 32}, false},                  /* 4096 B */
    {"layers.0.attn.wq_a.weight", DS41_F8_E4M3, 2, {32, 64}, false},  /* 2048 */
    {"layers.0.attn.wq_a.scale", DS41_F8_E8M0, 2, {1, 2}, false},     /* 2 */
    {"layers.0.attn.attn_sink", DS41_F32, 1, {3}, false},             /* 12 */
    {"layers.0.ffn.experts.0.w1.weight", DS41_I8, 2, {16, 8}, false}, /* 128 */
    {"norm.weight", DS41_BF16, 1, {33}, true},                        /* 66 */
    {"scalar", DS41_F32, 0, {0}, false},                              /* 4 */
    {"empty", DS41_F16, 2, {0, 5}, false},                            /* 0 */
    {"ids", DS41_I64, 1, {3}, false},                                 /* 24 */
    {"mask", DS41_BOOL, 1, {5}, false},                               /* 5 */
    {"counts", DS41_I32, 2, {2, 2}, false},                           /* 16 */
    {"bytes", DS41_U8, 1, {7}, false},                                /* 7 */
    {"half", DS41_F16, 1, {3}, false},                                /* 6 */
};
#define MODEL_N (sizeof model / sizeof *model)

static uint64_t decl_bytes(const decl *d) {
    uint64_t b = ds41_dtype_size(d->dtype);
    for (int i = 0; i < d->ndim; i++) b *= (uint64_t)d->shape[i];
    return b;
}

static int write_model(const char *dir, uint64_t target, bool single, ds41_error *e) {
    ds41_st_writer *w = ds41_checkpoint_writer_new(dir, target, e);
    if (!w) return -1;
    int rc = single ? ds41_checkpoint_writer_single_file(w, e) : 0;
    for (size_t i = 0; rc == 0 && i < MODEL_N; i++) {
        if (model[i].break_before && !single) rc = ds41_checkpoint_writer_break_shard(w);
        if (rc == 0)
            rc = ds41_checkpoint_writer_declare(w, model[i].name, model[i].dtype, model[i].ndim,
                                                model[i].shape, e);
    }
    if (rc == 0) rc = ds41_checkpoint_writer_begin(w, e);
    for (size_t i = 0; rc == 0 && i < MODEL_N; i++) {
        size_t n = (size_t)decl_bytes(&model[i]);
        uint8_t *buf = pattern(model[i].name, n);
        rc = ds41_checkpoint_writer_write(w, model[i].name, n ? buf : NULL, n, e);
        free(buf);
    }
    if (rc == 0) rc = ds41_checkpoint_writer_finish(w, e);
    ds41_checkpoint_writer_free(w);
    return rc;
}

/* Every declared tensor is found with its dtype, shape and bytes. */
static void check_model_contents(const ds41_checkpoint *c, const char *what) {
    size_t bad = MODEL_N;
    const char *why = "";
    for (size_t i = 0; i < MODEL_N && bad == MODEL_N; i++) {
        const decl *d = &model[i];
        const ds41_tensor *t = ds41_checkpoint_find(c, d->name);
        if (!t) {
            why = "not found";
        } else if (strcmp(t->name, d->name) || t->dtype != d->dtype || t->ndim != d->ndim ||
                   t->nbytes != decl_bytes(d)) {
            why = "metadata differs";
        } else if (memcmp(t->shape, d->shape, sizeof t->shape) != 0) {
            why = "shape differs";
        } else if ((const uint8_t *)t->data != (const uint8_t *)ds41_checkpoint_shard_base(c, t->shard) + t->file_offset) {
            why = "data is not base + file_offset";
        } else if ((uintptr_t)t->data % ds41_dtype_size(t->dtype) != 0) {
            why = "payload not aligned to its element size";
        } else {
            uint8_t *want = pattern(d->name, (size_t)t->nbytes);
            if (t->nbytes && memcmp(t->data, want, (size_t)t->nbytes) != 0) why = "bytes differ";
            free(want);
        }
        if (*why) bad = i;
    }
    TAP_CHECK(bad == MODEL_N, "%s: every tensor found with its dtype, shape, aligned bytes (first bad: %s: %s)",
               what, bad < MODEL_N ? model[bad].name : "-", why);
}

static void check_iteration(const ds41_checkpoint *c, const char *what) {
    size_t n = ds41_checkpoint_tensor_count(c);
    bool sorted = true;
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        const ds41_tensor *t = ds41_checkpoint_tensor_at(c, i);
        if (i && strcmp(ds41_checkpoint_tensor_at(c, i - 1)->name, t->name) >= 0) sorted = false;
        if (ds41_checkpoint_find(c, t->name) != t) sorted = false;
        sum += t->nbytes;
    }
    TAP_CHECK(n == MODEL_N, "%s: tensor_count is %zu (%zu)", what, MODEL_N, n);
    TAP_CHECK(sorted, "%s: tensor_at is strictly sorted by name and agrees with find", what);
    TAP_CHECK(ds41_checkpoint_tensor_at(c, n) == NULL && ds41_checkpoint_find(c, "embed") == NULL &&
                  ds41_checkpoint_find(c, "embed.weight.") == NULL && ds41_checkpoint_find(c, "") == NULL &&
                  ds41_checkpoint_find(c, NULL) == NULL,
              "%s: out-of-range index and unknown names give NULL", what);
    TAP_CHECK(sum == ds41_checkpoint_payload_bytes(c), "%s: payload_bytes is the sum of nbytes", what);
}

/* Parse a shard file with the pure parser and check what the writer
 * promises about its layout: Hugging Face metadata first, padded header,
 * payloads packed with no gaps. */
static bool check_shard_layout(const char *path, char *why, size_t why_len) {
    uint8_t *buf;
    size_t len = read_file(path, &buf);
    ds41_st_header h;
    ds41_error e;
    bool ok = false;
    if (ds41_checkpoint_parse_header(buf, len, len, path, &h, &e) != 0) {
        snprintf(why, why_len, "%s", e.msg);
    } else if (h.header_len % 8 != 0) {
        snprintf(why, why_len, "header length %" PRIu64 " not a multiple of 8", h.header_len);
    } else if (memcmp(buf + 8, "{\"__metadata__\":{\"format\":\"pt\"}", 31) != 0) {
        snprintf(why, why_len, "header does not start with __metadata__ format pt");
    } else if (h.metadata_count != 1 || strcmp(h.metadata[0].key, "format") ||
               strcmp(h.metadata[0].value, "pt")) {
        snprintf(why, why_len, "metadata not parsed back");
    } else if (h.data_start + h.payload_bytes != len) {
        snprintf(why, why_len, "payload (%" PRIu64 ") does not fill the file exactly", h.payload_bytes);
    } else {
        /* No gaps: the non-empty payloads tile the data region. */
        bool *seen = calloc(h.data_size + 1, 1);
        uint64_t covered = 0;
        for (size_t i = 0; i < h.tensor_count; i++) {
            for (uint64_t b = 0; b < h.tensors[i].nbytes; b++) seen[h.tensors[i].file_offset - h.data_start + b] = 1;
        }
        for (uint64_t b = 0; b < h.data_size; b++) covered += seen[b];
        free(seen);
        ok = covered == h.data_size;
        if (!ok) snprintf(why, why_len, "data region has gaps");
    }
    ds41_checkpoint_header_free(&h);
    free(buf);
    return ok;
}

static void test_sharded_round_trip(void) {
    const char *dir = new_dir("sharded");
    ds41_error e = {{0}};
    /* target 2100: embed (4096) alone; wq_a .weight+.scale+sink (2062)
     * together; expert (128) starts a new shard since 2062+128 > 2100;
     * the forced break puts norm.weight and the rest in a fourth shard. */
    int rc = write_model(dir, 2100, false, &e);
    TAP_CHECK(rc == 0, "writer writes a sharded checkpoint (%s)", rc ? e.msg : "ok");

    ds41_checkpoint *c = ds41_checkpoint_open(dir, &e);
    TAP_CHECK(c != NULL, "sharded checkpoint opens (%s)", c ? "ok" : e.msg);
    if (!c) return;
    check_model_contents(c, "sharded");
    check_iteration(c, "sharded");

    size_t ns = ds41_checkpoint_shard_count(c);
    TAP_CHECK(ns == 4, "shards follow target and forced break: 4 (%zu)", ns);
    bool names_ok = true, fds_ok = true, layout_ok = true;
    char why[DS41_ERROR_MAX + 128] = "";
    for (uint32_t i = 0; i < ns; i++) {
        char want[PATH_MAX], file[64];
        snprintf(file, sizeof file, "model-%05u-of-%05zu.safetensors", i + 1, ns);
        path_in(want, dir, file);
        if (strcmp(ds41_checkpoint_shard_path(c, i), want) != 0) names_ok = false;
        struct stat st;
        int fd = ds41_checkpoint_shard_fd(c, i);
        if (fd < 0 || fstat(fd, &st) != 0 || (uint64_t)st.st_size != ds41_checkpoint_shard_size(c, i)) fds_ok = false;
        uint8_t first8[8];
        if (pread(fd, first8, 8, 0) != 8) fds_ok = false;
        if (layout_ok && !check_shard_layout(want, why, sizeof why)) layout_ok = false;
    }
    TAP_CHECK(names_ok, "shard paths are DIR/model-%%05d-of-%%05d.safetensors in order");
    TAP_CHECK(fds_ok, "shard fds are open, readable and match shard_size");
    TAP_CHECK(layout_ok, "shard headers: __metadata__ first, padded to 8, payload packed without gaps (%s)", why);
    TAP_CHECK(ds41_checkpoint_shard_path(c, (uint32_t)ns) == NULL && ds41_checkpoint_shard_fd(c, (uint32_t)ns) == -1 &&
                  ds41_checkpoint_shard_size(c, (uint32_t)ns) == 0 && ds41_checkpoint_shard_base(c, (uint32_t)ns) == NULL,
              "out-of-range shard queries give NULL/-1/0");
    TAP_CHECK(strcmp(ds41_checkpoint_dir(c), dir) == 0, "checkpoint_dir is the directory given");

    /* Shard sizes: no shard holds more than the target unless it is one tensor. */
    bool within = true;
    for (uint32_t s = 0; s < ns; s++) {
        uint64_t bytes = 0;
        size_t count = 0;
        for (size_t i = 0; i < ds41_checkpoint_tensor_count(c); i++) {
            const ds41_tensor *t = ds41_checkpoint_tensor_at(c, i);
            if (t->shard == s) bytes += t->nbytes, count++;
        }
        if (count == 0 || (bytes > 2100 && count != 1)) within = false;
    }
    TAP_CHECK(within, "every shard has a tensor and stays within the target unless it holds one");
    const ds41_tensor *embed = ds41_checkpoint_find(c, "embed.weight");
    const ds41_tensor *norm = ds41_checkpoint_find(c, "norm.weight");
    const ds41_tensor *expert = ds41_checkpoint_find(c, "layers.0.ffn.experts.0.w1.weight");
    TAP_CHECK(embed && norm && expert && embed->shard == 0 && expert->shard == 2 && norm->shard == 3,
              "assignment: embed in shard 0, expert in shard 2, forced break before norm.weight (shard 3)");

    /* The index: sorted keys, total_size, every tensor mapped to its shard. */
    char ipath[PATH_MAX];
    path_in(ipath, dir, DS41_ST_INDEX_NAME);
    uint8_t *text;
    size_t tlen = read_file(ipath, &text);
    json_error_t je;
    json_t *idx = json_loadb((const char *)text, tlen, JSON_REJECT_DUPLICATES, &je);
    json_t *wm = json_object_get(idx, "weight_map");
    bool mapped = json_object_size(wm) == MODEL_N;
    for (size_t i = 0; mapped && i < ds41_checkpoint_tensor_count(c); i++) {
        const ds41_tensor *t = ds41_checkpoint_tensor_at(c, i);
        const char *p = ds41_checkpoint_shard_path(c, t->shard);
        const char *s = json_string_value(json_object_get(wm, t->name));
        if (!s || strcmp(s, strrchr(p, '/') + 1) != 0) mapped = false;
    }
    json_int_t total = json_integer_value(json_object_get(json_object_get(idx, "metadata"), "total_size"));
    TAP_CHECK(mapped, "index weight_map maps every tensor to its shard file name");
    TAP_CHECK(total > 0 && (uint64_t)total == ds41_checkpoint_payload_bytes(c), "index metadata.total_size is the payload sum");
    bool keys_sorted = true;
    const char *prev = NULL;
    for (size_t i = 0; i < ds41_checkpoint_tensor_count(c); i++) {
        char quoted[256];
        snprintf(quoted, sizeof quoted, "\"%s\":", ds41_checkpoint_tensor_at(c, i)->name);
        const char *at = strstr((const char *)text, quoted);
        if (!at || (prev && at < prev)) keys_sorted = false;
        prev = at;
    }
    TAP_CHECK(keys_sorted && text[tlen - 1] == '\n' && strstr((const char *)text, "{\n  \"metadata\": {\n    \"total_size\": "),
              "index text: 2-space indent, weight_map keys in sorted order, trailing newline");
    json_decref(idx);
    free(text);

    /* The pure index parser agrees. */
    ds41_st_index ix;
    tlen = read_file(ipath, &text);
    rc = ds41_checkpoint_parse_index(text, tlen, ipath, &ix, &e);
    bool ix_ok = rc == 0 && ix.shard_count == ns && ix.entry_count == MODEL_N && ix.has_total_size &&
                 ix.total_size == ds41_checkpoint_payload_bytes(c);
    for (size_t i = 0; ix_ok && i < ns; i++) {
        if (strcmp(ix.shard_names[i], strrchr(ds41_checkpoint_shard_path(c, (uint32_t)i), '/') + 1) != 0) ix_ok = false;
        const ds41_tensor *t = ds41_checkpoint_find(c, ix.shard_first_tensor[i]);
        if (!t || t->shard != i) ix_ok = false;
    }
    TAP_CHECK(ix_ok, "ds41_checkpoint_parse_index: shard names sorted, entries and first tensors match (%s)",
              rc ? e.msg : "ok");
    ds41_checkpoint_index_free(&ix);
    free(text);
    ds41_checkpoint_close(c);

    /* A trailing slash in the directory is fine. */
    char slashed[PATH_MAX];
    snprintf(slashed, sizeof slashed, "%s/", dir);
    c = ds41_checkpoint_open(slashed, &e);
    TAP_CHECK(c && ds41_checkpoint_tensor_count(c) == MODEL_N, "directory given with a trailing slash opens");
    ds41_checkpoint_close(c);

    /* Truncating a shard by a few bytes is caught, naming the tensor cut. */
    char last[PATH_MAX];
    path_in(last, dir, "model-00001-of-00004.safetensors");
    struct stat st;
    stat(last, &st);
    if (truncate(last, st.st_size - 3) != 0) perror("truncate");
    expect_fail(dir, "model-00001-of-00004.safetensors", "embed.weight", "shard truncated by 3 bytes");
}

static void test_single_file(void) {
    const char *dir = new_dir("single");
    ds41_error e = {{0}};
    int rc = write_model(dir, 1, true, &e);
    TAP_CHECK(rc == 0, "writer writes a single-file checkpoint (%s)", rc ? e.msg : "ok");
    char p[PATH_MAX];
    path_in(p, dir, DS41_ST_INDEX_NAME);
    TAP_CHECK(access(p, F_OK) != 0, "single-file mode writes no index");
    ds41_checkpoint *c = ds41_checkpoint_open(dir, &e);
    TAP_CHECK(c != NULL, "single model.safetensors opens (%s)", c ? "ok" : e.msg);
    if (!c) return;
    path_in(p, dir, DS41_ST_SINGLE_NAME);
    TAP_CHECK(ds41_checkpoint_shard_count(c) == 1 && strcmp(ds41_checkpoint_shard_path(c, 0), p) == 0,
              "single-file checkpoint has one shard, model.safetensors");
    check_model_contents(c, "single");
    check_iteration(c, "single");
    ds41_checkpoint_close(c);
}

/* ---------------------------------------------------- writer misuse */

static void test_writer_misuse(void) {
    const char *dir = new_dir("misuse");
    ds41_error e = {{0}};
    int64_t shp[9] = {2, 2, 1, 1, 1, 1, 1, 1, 1};

    TAP_CHECK(ds41_checkpoint_writer_new("/nonexistent/ds41", 0, &e) == NULL &&
                  strstr(e.msg, "/nonexistent/ds41"),
              "writer_new on a missing directory fails naming it");

    ds41_st_writer *w = ds41_checkpoint_writer_new(dir, 0, &e);
    TAP_CHECK(w && ds41_checkpoint_writer_declare(w, "a", DS41_F32, 9, shp, &e) != 0 && strstr(e.msg, "'a'"),
              "declare with 9 dimensions fails naming the tensor");
    TAP_CHECK(ds41_checkpoint_writer_declare(w, "b", DS41_F32, 1, shp, &e) != 0 && strstr(e.msg, "'a'"),
              "a failed writer repeats its first failure");
    ds41_checkpoint_writer_free(w);

    w = ds41_checkpoint_writer_new(dir, 0, &e);
    int64_t neg[2] = {3, -1};
    TAP_CHECK(ds41_checkpoint_writer_declare(w, "neg", DS41_F32, 2, neg, &e) != 0 &&
                  strstr(e.msg, "negative"),
              "declare with a negative dimension fails");
    ds41_checkpoint_writer_free(w);

    w = ds41_checkpoint_writer_new(dir, 0, &e);
    int64_t huge[3] = {INT64_C(1) << 40, INT64_C(1) << 40, 4};
    TAP_CHECK(ds41_checkpoint_writer_declare(w, "huge", DS41_F32, 3, huge, &e) != 0 &&
                  strstr(e.msg, "overflow"),
              "declare whose byte size overflows fails");
    ds41_checkpoint_writer_free(w);

    w = ds41_checkpoint_writer_new(dir, 0, &e);
    ds41_checkpoint_writer_declare(w, "x", DS41_U8, 1, shp, &e);
    TAP_CHECK(ds41_checkpoint_writer_declare(w, "x", DS41_U8, 1, shp, &e) != 0 && strstr(e.msg, "'x'") &&
                  strstr(e.msg, "twice"),
              "declaring a name twice fails");
    ds41_checkpoint_writer_free(w);

    w = ds41_checkpoint_writer_new(dir, 0, &e);
    TAP_CHECK(ds41_checkpoint_writer_declare(w, "__metadata__", DS41_U8, 1, shp, &e) != 0,
              "'__metadata__' is not a tensor name");
    ds41_checkpoint_writer_free(w);

    w = ds41_checkpoint_writer_new(dir, 0, &e);
    TAP_CHECK(ds41_checkpoint_writer_begin(w, &e) != 0 && strstr(e.msg, "no tensors"),
              "begin without tensors fails");
    ds41_checkpoint_writer_free(w);

    w = ds41_checkpoint_writer_new(dir, 0, &e);
    ds41_checkpoint_writer_single_file(w, &e);
    TAP_CHECK(ds41_checkpoint_writer_break_shard(w) != 0 &&
                  ds41_checkpoint_writer_declare(w, "y", DS41_U8, 1, shp, &e) != 0 &&
                  strstr(e.msg, "single-file"),
              "a shard break in single-file mode fails, and the next call says why");
    ds41_checkpoint_writer_free(w);

    /* Write-phase errors: order, size, unwritten tensors, late declares. */
    uint8_t four[4] = {1, 2, 3, 4};
    w = ds41_checkpoint_writer_new(dir, 0, &e);
    ds41_checkpoint_writer_declare(w, "first", DS41_U8, 1, (int64_t[]){4}, &e);
    ds41_checkpoint_writer_declare(w, "second", DS41_U8, 1, (int64_t[]){2}, &e);
    TAP_CHECK(ds41_checkpoint_writer_write(w, "first", four, 4, &e) != 0 && strstr(e.msg, "declaring"),
              "write before begin fails");
    ds41_checkpoint_writer_free(w);

    w = ds41_checkpoint_writer_new(dir, 0, &e);
    ds41_checkpoint_writer_declare(w, "first", DS41_U8, 1, (int64_t[]){4}, &e);
    ds41_checkpoint_writer_declare(w, "second", DS41_U8, 1, (int64_t[]){2}, &e);
    ds41_checkpoint_writer_begin(w, &e);
    TAP_CHECK(ds41_checkpoint_writer_declare(w, "third", DS41_U8, 1, shp, &e) != 0,
              "declare after begin fails");
    ds41_checkpoint_writer_free(w);

    w = ds41_checkpoint_writer_new(dir, 0, &e);
    ds41_checkpoint_writer_declare(w, "first", DS41_U8, 1, (int64_t[]){4}, &e);
    ds41_checkpoint_writer_declare(w, "second", DS41_U8, 1, (int64_t[]){2}, &e);
    ds41_checkpoint_writer_begin(w, &e);
    TAP_CHECK(ds41_checkpoint_writer_write(w, "second", four, 2, &e) != 0 && strstr(e.msg, "'second'") &&
                  strstr(e.msg, "'first'"),
              "writing out of declaration order fails naming both tensors");
    ds41_checkpoint_writer_free(w);

    w = ds41_checkpoint_writer_new(dir, 0, &e);
    ds41_checkpoint_writer_declare(w, "first", DS41_U8, 1, (int64_t[]){4}, &e);
    ds41_checkpoint_writer_declare(w, "second", DS41_U8, 1, (int64_t[]){2}, &e);
    ds41_checkpoint_writer_begin(w, &e);
    TAP_CHECK(ds41_checkpoint_writer_write(w, "first", four, 3, &e) != 0 &&
                  strstr(e.msg, "3 bytes given, 4 declared"),
              "writing the wrong byte count fails");
    ds41_checkpoint_writer_free(w);

    w = ds41_checkpoint_writer_new(dir, 0, &e);
    ds41_checkpoint_writer_declare(w, "first", DS41_U8, 1, (int64_t[]){4}, &e);
    ds41_checkpoint_writer_declare(w, "second", DS41_U8, 1, (int64_t[]){2}, &e);
    ds41_checkpoint_writer_begin(w, &e);
    ds41_checkpoint_writer_write(w, "first", four, 4, &e);
    TAP_CHECK(ds41_checkpoint_writer_finish(w, &e) != 0 && strstr(e.msg, "'second'") &&
                  strstr(e.msg, "not written"),
              "finish with an unwritten tensor fails naming it");
    ds41_checkpoint_writer_free(w);
    /* That unfinished checkpoint must not open: its shard lacks a payload. */
    expect_fail(dir, "model-00001-of-00001.safetensors", "second", "unfinished writer output");
}

/* ------------------------------------------------- malformed inputs */

#define SHARD_A "model-00001-of-00002.safetensors"
#define SHARD_B "model-00002-of-00002.safetensors"
#define JSON_A                                                                                     \
    "{\"__metadata__\":{\"format\":\"pt\"},"                                                       \
    "\"a.weight\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"                    \
    "\"a.bias\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[16,20]}}"
#define JSON_B                                                                                     \
    "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"               \
    "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]}}"
#define INDEX_OK                                                                                   \
    "{\"metadata\":{\"total_size\":33},\"weight_map\":{\"a.weight\":\"" SHARD_A "\",\"a.bias\":\"" \
    SHARD_A "\",\"b.weight\":\"" SHARD_B "\",\"b.scale\":\"" SHARD_B "\"}}"

/* Two shards A and B plus an index; b_json/b_len replace shard B, index
 * replaces the index. */
static const char *two_shards(const char *label, const char *b_json, size_t b_len, const char *index) {
    const char *dir = new_dir(label);
    write_st(dir, SHARD_A, JSON_A, 20);
    write_st(dir, SHARD_B, b_json, b_len);
    write_text(dir, DS41_ST_INDEX_NAME, index);
    return dir;
}

static const char *bad_b(const char *label, const char *b_json, size_t b_len) {
    return two_shards(label, b_json, b_len, INDEX_OK);
}

static const char *bad_index(const char *label, const char *index) {
    return two_shards(label, JSON_B, 13, index);
}

/* Index JSON with B's tensors swapped for the given weight_map tail. */
#define INDEX_WITH(tail)                                                                           \
    "{\"weight_map\":{\"a.weight\":\"" SHARD_A "\",\"a.bias\":\"" SHARD_A "\"," tail "}}"

static void test_malformed_shards(void) {
    ds41_error e;
    const char *dir = bad_b("baseline", JSON_B, 13);
    ds41_checkpoint *c = ds41_checkpoint_open(dir, &e);
    TAP_CHECK(c && ds41_checkpoint_tensor_count(c) == 4 && ds41_checkpoint_shard_count(c) == 2,
              "baseline two-shard checkpoint opens (the cases below each break one thing) (%s)", c ? "ok" : e.msg);
    if (c) {
        const ds41_tensor *t = ds41_checkpoint_find(c, "b.scale");
        TAP_CHECK(t && t->shard == 1 && t->file_offset == 8 + strlen(JSON_B) + 12 &&
                      *(const uint8_t *)t->data == (uint8_t)(12 * 7 + 1),
                  "hand-written shard: file_offset and data are 8 + N + begin");
    }
    ds41_checkpoint_close(c);

    /* Payload cut short: b.scale's span [12,13) passes the end. */
    expect_fail(bad_b("truncated", JSON_B, 12), SHARD_B, "b.scale", "truncated payload");

    dir = new_dir("len-past-eof");
    write_st(dir, SHARD_A, JSON_A, 20);
    write_st_n(dir, SHARD_B, 4096, JSON_B, 13);
    write_text(dir, DS41_ST_INDEX_NAME, INDEX_OK);
    expect_fail(dir, SHARD_B, NULL, "header length past EOF");

    dir = new_dir("len-huge");
    write_st(dir, SHARD_A, JSON_A, 20);
    write_st_n(dir, SHARD_B, UINT64_C(1) << 40, JSON_B, 13);
    write_text(dir, DS41_ST_INDEX_NAME, INDEX_OK);
    expect_fail(dir, SHARD_B, NULL, "header length over the 100 MiB cap");

    dir = new_dir("tiny-file");
    write_st(dir, SHARD_A, JSON_A, 20);
    write_bytes(dir, SHARD_B, "\x05\0\0", 3);
    write_text(dir, DS41_ST_INDEX_NAME, INDEX_OK);
    expect_fail(dir, SHARD_B, NULL, "file shorter than the 8-byte length");

    dir = new_dir("fifo");
    write_st(dir, SHARD_A, JSON_A, 20);
    char fifo[PATH_MAX];
    path_in(fifo, dir, SHARD_B);
    if (mkfifo(fifo, 0644) != 0) perror("mkfifo");
    write_text(dir, DS41_ST_INDEX_NAME, INDEX_OK);
    expect_fail(dir, SHARD_B, NULL, "a FIFO in place of a shard (must not hang)");

    expect_fail(bad_b("bad-json", "{\"b.weight\":{\"dtype\":\"F8_E4M3\",", 13), SHARD_B, NULL, "invalid JSON");
    expect_fail(bad_b("not-object", "[1,2,3]", 13), SHARD_B, NULL, "header is an array");
    expect_fail(bad_b("trailing", JSON_B "x", 13), SHARD_B, NULL, "garbage after the JSON");
    expect_fail(bad_b("unknown-dtype",
                      "{\"b.weight\":{\"dtype\":\"F64\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, "b.weight", "unknown dtype F64");
    expect_fail(bad_b("overlap",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[10,13]}}",
                      13),
                SHARD_B, "b.scale", "overlapping data_offsets");
    expect_fail(bad_b("out-of-file",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[100,101]}}",
                      13),
                SHARD_B, "b.scale", "data_offsets outside the file");
    expect_fail(bad_b("size-mismatch",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,4],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, "b.weight", "shape/size mismatch");
    expect_fail(bad_b("begin-after-end",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[13,12]}}",
                      13),
                SHARD_B, "b.scale", "data_offsets begin > end");
    expect_fail(bad_b("dup-key",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]},"
                      "\"b.weight\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
                      13),
                SHARD_B, "b.weight", "duplicate tensor key");
    expect_fail(bad_b("ndim9",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, "b.scale", "ndim 9 > 8");
    expect_fail(bad_b("negative-dim",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[-4,-3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, "b.weight", "negative dimension");
    expect_fail(bad_b("overflow",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4611686018427387904,16],"
                      "\"data_offsets\":[12,12]}}",
                      13),
                SHARD_B, "b.scale", "dims whose product overflows 64 bits");
    expect_fail(bad_b("overflow-wrap",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[12,12]}}",
                      13),
                SHARD_B, "b.scale", "dim x element size wrapping to 0");
    expect_fail(bad_b("dim-too-big",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"U8\",\"shape\":[99999999999999999999],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, NULL, "dimension beyond 64-bit integers");
    expect_fail(bad_b("real-dim",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4.0,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, "b.weight", "real-valued dimension");
    expect_fail(bad_b("extra-key",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12],\"x\":1},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, "b.weight", "unexpected key in a tensor entry");
    expect_fail(bad_b("missing-offsets",
                      "{\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, "b.weight", "missing data_offsets");
    expect_fail(bad_b("entry-not-object",
                      "{\"b.weight\":[0,12],"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, "b.weight", "tensor entry is not an object");
    expect_fail(bad_b("meta-not-string",
                      "{\"__metadata__\":{\"format\":1},"
                      "\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, "format", "__metadata__ value not a string");
    expect_fail(bad_b("empty-name",
                      "{\"\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                      "\"b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,3],\"data_offsets\":[0,12]},"
                      "\"b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[1],\"data_offsets\":[12,13]}}",
                      13),
                SHARD_B, "empty name", "empty tensor name");
    expect_fail(bad_b("nul-in-name",
                      "{\"b.weight\\u0000x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1),
                SHARD_B, NULL, "NUL inside a tensor name");
}

static void test_malformed_index(void) {
    expect_fail(bad_index("missing-shard", INDEX_WITH("\"b.weight\":\"" SHARD_B "\",\"b.scale\":\"" SHARD_B
                                                      "\",\"c.weight\":\"model-00003-of-00003.safetensors\"")),
                "model-00003-of-00003.safetensors", "c.weight", "index names a missing shard");
    expect_fail(bad_index("tensor-missing", INDEX_WITH("\"b.weight\":\"" SHARD_B "\",\"b.scale\":\"" SHARD_B
                                                       "\",\"b.extra\":\"" SHARD_B "\"")),
                SHARD_B, "b.extra", "index tensor missing from its shard");
    expect_fail(bad_index("extra-in-shard", INDEX_WITH("\"b.weight\":\"" SHARD_B "\"")), SHARD_B, "b.scale",
                "shard tensor not in the index");
    expect_fail(bad_index("wrong-shard",
                          INDEX_WITH("\"b.weight\":\"" SHARD_B "\",\"b.scale\":\"" SHARD_A "\"")),
                SHARD_A, "b.scale", "index maps a tensor to the other shard");
    expect_fail(bad_index("slash", INDEX_WITH("\"b.weight\":\"" SHARD_B "\",\"b.scale\":\"sub/" SHARD_B "\"")),
                DS41_ST_INDEX_NAME, "b.scale", "shard name with '/'");
    expect_fail(bad_index("dotdot", INDEX_WITH("\"b.weight\":\"" SHARD_B "\",\"b.scale\":\"..\"")),
                DS41_ST_INDEX_NAME, "b.scale", "shard name '..'");
    expect_fail(bad_index("abs", INDEX_WITH("\"b.weight\":\"" SHARD_B "\",\"b.scale\":\"/etc/passwd\"")),
                DS41_ST_INDEX_NAME, "b.scale", "absolute shard path");
    expect_fail(bad_index("empty-shard-name", INDEX_WITH("\"b.weight\":\"" SHARD_B "\",\"b.scale\":\"\"")),
                DS41_ST_INDEX_NAME, "b.scale", "empty shard name");
    expect_fail(bad_index("dup-index-key", INDEX_WITH("\"b.weight\":\"" SHARD_B "\",\"b.scale\":\"" SHARD_B
                                                      "\",\"b.weight\":\"" SHARD_B "\"")),
                DS41_ST_INDEX_NAME, "b.weight", "duplicate key in the index");
    expect_fail(bad_index("shard-not-string", INDEX_WITH("\"b.weight\":\"" SHARD_B "\",\"b.scale\":2")),
                DS41_ST_INDEX_NAME, "b.scale", "weight_map value not a string");
    expect_fail(bad_index("no-weight-map", "{\"metadata\":{}}"), DS41_ST_INDEX_NAME, "weight_map",
                "index without weight_map");
    expect_fail(bad_index("empty-weight-map", "{\"weight_map\":{}}"), DS41_ST_INDEX_NAME, "empty",
                "empty weight_map");
    expect_fail(bad_index("index-bad-json", "{\"weight_map\":{\"a.weight\":"), DS41_ST_INDEX_NAME, NULL,
                "invalid index JSON");
    expect_fail(bad_index("total-size", "{\"metadata\":{\"total_size\":34},\"weight_map\":{\"a.weight\":\"" SHARD_A
                                        "\",\"a.bias\":\"" SHARD_A "\",\"b.weight\":\"" SHARD_B
                                        "\",\"b.scale\":\"" SHARD_B "\"}}"),
                DS41_ST_INDEX_NAME, "total_size", "metadata.total_size disagrees with the shards");
    expect_fail(bad_index("total-size-type", "{\"metadata\":{\"total_size\":\"33\"},\"weight_map\":{\"a.weight\":\"" SHARD_A
                                             "\"}}"),
                DS41_ST_INDEX_NAME, "total_size", "metadata.total_size not a number");

    /* A tensor in two shards (the index maps it to one of them). */
    const char *dir = new_dir("two-shards-one-name");
    write_st(dir, SHARD_A,
             "{\"a.weight\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
             "\"a.bias\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[16,20]},"
             "\"b.scale\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[20,21]}}",
             21);
    write_st(dir, SHARD_B, JSON_B, 13);
    write_text(dir, DS41_ST_INDEX_NAME, INDEX_OK);
    expect_fail(dir, SHARD_A, "b.scale", "same tensor name in two shards");

    /* Shards are parsed in parallel; with several broken, the message is
     * still about the first by name, every time. */
    dir = new_dir("many-broken");
    char name[64];
    char index[4096] = "{\"weight_map\":{";
    for (int i = 1; i <= 12; i++) {
        snprintf(name, sizeof name, "model-%05d-of-00012.safetensors", i);
        if (i < 5) write_st(dir, name, "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1);
        else write_st(dir, name, "{\"t\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,1]}}", 1);
        snprintf(index + strlen(index), sizeof index - strlen(index), "%s\"t%d\":\"%s\"", i > 1 ? "," : "", i, name);
    }
    strcat(index, "}}");
    write_text(dir, DS41_ST_INDEX_NAME, index);
    bool same = true;
    for (int r = 0; r < 8; r++) {
        ds41_error e1;
        ds41_checkpoint *c1 = ds41_checkpoint_open(dir, &e1);
        if (c1 || !strstr(e1.msg, "model-00005-of-00012.safetensors: tensor 't': shape [2]")) same = false;
        ds41_checkpoint_close(c1);
    }
    TAP_CHECK(same, "with shards 5..12 broken, every open reports shard 5");

    /* total_size written as an integral float still agrees. */
    dir = bad_index("total-size-float", "{\"metadata\":{\"total_size\":33.0},\"weight_map\":{\"a.weight\":\"" SHARD_A
                                        "\",\"a.bias\":\"" SHARD_A "\",\"b.weight\":\"" SHARD_B
                                        "\",\"b.scale\":\"" SHARD_B "\"}}");
    ds41_error e;
    ds41_checkpoint *c = ds41_checkpoint_open(dir, &e);
    TAP_CHECK(c != NULL, "metadata.total_size 33.0 equal to the payload is accepted (%s)", c ? "ok" : e.msg);
    ds41_checkpoint_close(c);
}

static void test_directory_errors(void) {
    const char *dir = new_dir("empty");
    expect_fail(dir, dir, NULL, "directory with neither index nor model.safetensors");
    char file[PATH_MAX];
    path_in(file, dir, "plain");
    write_text(dir, "plain", "x");
    expect_fail(file, file, NULL, "a regular file instead of a directory");
    char missing[PATH_MAX];
    path_in(missing, dir, "does-not-exist");
    expect_fail(missing, missing, NULL, "missing directory");

    dir = new_dir("single-bad");
    write_st(dir, DS41_ST_SINGLE_NAME, "{\"w\":{\"dtype\":\"Q4_K\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1);
    expect_fail(dir, DS41_ST_SINGLE_NAME, "w", "single-file checkpoint with an unknown dtype");

    /* When both layouts are present the index wins (as in vLLM). */
    dir = two_shards("both", JSON_B, 13, INDEX_OK);
    write_st(dir, DS41_ST_SINGLE_NAME, "{\"only\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1);
    ds41_error e;
    ds41_checkpoint *c = ds41_checkpoint_open(dir, &e);
    TAP_CHECK(c && ds41_checkpoint_tensor_count(c) == 4 && !ds41_checkpoint_find(c, "only"),
              "with both an index and model.safetensors, the index is used");
    ds41_checkpoint_close(c);
}

/* ------------------------------------------------- pure parser API */

static void test_parser_api(void) {
    const char *json = "{\"__metadata__\":{\"format\":\"pt\",\"k\":\"v\"},"
                       "\"z\":{\"dtype\":\"F16\",\"shape\":[0,4611686018427387904],\"data_offsets\":[4,4]},"
                       "\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[8,12]},"
                       "\"a\":{\"dtype\":\"U8\",\"shape\":[2,2],\"data_offsets\":[0,4]}}";
    size_t jl = strlen(json);
    uint8_t buf[512];
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)jl >> (8 * i));
    memcpy(buf + 8, json, jl);
    ds41_st_header h;
    ds41_error e;
    /* 12 payload bytes plus 8 bytes of trailing file the header does not use. */
    int rc = ds41_checkpoint_parse_header(buf, 8 + jl, 8 + jl + 20, "mem.safetensors", &h, &e);
    TAP_CHECK(rc == 0, "parser accepts scalars, zero-size tensors with huge dims, gaps and trailing bytes (%s)",
              rc ? e.msg : "ok");
    if (rc == 0) {
        TAP_CHECK(h.tensor_count == 3 && !strcmp(h.tensors[0].name, "a") && !strcmp(h.tensors[1].name, "s") &&
                      !strcmp(h.tensors[2].name, "z"),
                  "parser sorts tensors by name");
        TAP_CHECK(h.tensors[1].ndim == 0 && h.tensors[1].nbytes == 4 && h.tensors[2].nbytes == 0 &&
                      h.tensors[0].file_offset == 8 + jl && h.tensors[1].file_offset == 8 + jl + 8 &&
                      h.header_len == jl && h.data_size == 20 && h.payload_bytes == 8,
                  "parser sizes and absolute offsets");
        TAP_CHECK(h.metadata_count == 2 && !strcmp(h.metadata[1].key, "k") && !strcmp(h.metadata[1].value, "v"),
                  "parser keeps __metadata__ in file order");
    }
    ds41_checkpoint_header_free(&h);
    ds41_checkpoint_header_free(&h);
    rc = ds41_checkpoint_parse_header(buf, 8 + jl - 1, 8 + jl + 20, "mem.safetensors", &h, &e);
    TAP_CHECK(rc != 0 && strstr(e.msg, "mem.safetensors") && h.tensors == NULL,
              "a prefix shorter than 8 + N is refused, *out left empty");
    rc = ds41_checkpoint_parse_header(buf, 8 + jl, 8 + jl, NULL, &h, &e);
    TAP_CHECK(rc != 0 && strstr(e.msg, "<safetensors>") && strstr(e.msg, "'z'"),
              "NULL label reads <safetensors>; span past a data region of 0 bytes names the tensor");
}

/* -------------------------------------------- no payload page is read */

static size_t count_resident(const void *base, size_t len, unsigned char *vec) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = (len + page - 1) / page, n = 0;
    if (mincore((void *)base, len, vec) != 0) return (size_t)-1;
    for (size_t i = 0; i < pages; i++) n += vec[i] & 1;
    return n;
}

/* A checkpoint of the n tensors ds in dir, each filled with its pattern
 * (a new shard before each marked break_before). */
static int write_decls(const char *dir, const decl *ds, size_t n, ds41_error *e) {
    ds41_st_writer *w = ds41_checkpoint_writer_new(dir, 0, e);
    int rc = w ? 0 : -1;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        if (ds[i].break_before) ds41_checkpoint_writer_break_shard(w);
        rc = ds41_checkpoint_writer_declare(w, ds[i].name, ds[i].dtype, ds[i].ndim, ds[i].shape, e);
    }
    if (rc == 0) rc = ds41_checkpoint_writer_begin(w, e);
    for (size_t i = 0; rc == 0 && i < n; i++) {
        size_t nb = (size_t)decl_bytes(&ds[i]);
        uint8_t *b = pattern(ds[i].name, nb);
        rc = ds41_checkpoint_writer_write(w, ds[i].name, b, nb, e);
        free(b);
    }
    if (rc == 0) rc = ds41_checkpoint_writer_finish(w, e);
    ds41_checkpoint_writer_free(w);
    return rc;
}

static void test_no_payload_read(void) {
    const char *dir = new_dir("resident");
    ds41_error e;
    static const decl big[] = {
        {"r.big0", DS41_BF16, 2, {1024, 1024}, false}, /* 2 MiB */
        {"r.small", DS41_F32, 1, {10}, false},
        {"r.big1", DS41_F32, 2, {512, 1024}, false},   /* 2 MiB */
        {"r.big2", DS41_U8, 1, {3 << 20}, true},       /* 3 MiB, own shard */
    };
    int rc = write_decls(dir, big, 4, &e);
    TAP_CHECK(rc == 0, "writer writes a 7 MiB two-shard checkpoint (%s)", rc ? e.msg : "ok");
    if (rc) return;

    /* Drop the shards from the page cache, and make sure that worked before
     * relying on it. */
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const char *names[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    size_t still = 0, total_pages = 0;
    for (int s = 0; s < 2; s++) {
        char p[PATH_MAX];
        path_in(p, dir, names[s]);
        int fd = open(p, O_RDONLY);
        struct stat st;
        fstat(fd, &st);
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        unsigned char *vec = malloc((size_t)st.st_size / page + 1);
        size_t r = m == MAP_FAILED ? (size_t)-1 : count_resident(m, (size_t)st.st_size, vec);
        still += r == (size_t)-1 ? 1 : r;
        total_pages += (size_t)st.st_size / page;
        if (m != MAP_FAILED) munmap(m, (size_t)st.st_size);
        free(vec);
        close(fd);
    }
    if (still > 0) {
        TAP_SKIP("POSIX_FADV_DONTNEED did not evict the shards here (%zu of %zu pages still resident, or mincore "
                 "failed): cannot tell payload reads from cached pages",
                 still, total_pages);
        TAP_SKIP("touching a tensor faults its pages in (needs the eviction above)");
        return;
    }

    ds41_checkpoint *c = ds41_checkpoint_open(dir, &e);
    TAP_CHECK(c != NULL, "evicted checkpoint opens (%s)", c ? "ok" : e.msg);
    if (!c) return;
    size_t checked = 0, resident = 0;
    for (uint32_t s = 0; s < ds41_checkpoint_shard_count(c); s++) {
        const uint8_t *base = ds41_checkpoint_shard_base(c, s);
        size_t size = (size_t)ds41_checkpoint_shard_size(c, s), pages = (size + page - 1) / page;
        unsigned char *vec = malloc(pages);
        if (count_resident(base, size, vec) == (size_t)-1) {
            resident++;
            free(vec);
            continue;
        }
        for (size_t i = 0; i < ds41_checkpoint_tensor_count(c); i++) {
            const ds41_tensor *t = ds41_checkpoint_tensor_at(c, i);
            if (t->shard != s) continue;
            /* Pages wholly inside the payload; the first may share header bytes. */
            uint64_t first = (t->file_offset + page - 1) / page, end = (t->file_offset + t->nbytes) / page;
            for (uint64_t p = first; p < end; p++) {
                checked++;
                resident += vec[p] & 1;
            }
        }
        free(vec);
    }
    TAP_CHECK(resident == 0 && checked >= (7u << 20) / page - 8,
              "opening reads no payload page (%zu payload pages checked, %zu resident)", checked, resident);

    /* Touch one byte in the middle of r.big1 and watch its page come in. */
    const ds41_tensor *t = ds41_checkpoint_find(c, "r.big1");
    size_t mid = (size_t)t->nbytes / 2;
    uint8_t got = ((const volatile uint8_t *)t->data)[mid];
    const uint8_t *base = ds41_checkpoint_shard_base(c, t->shard);
    size_t pg = (size_t)((t->file_offset + mid) / page);
    unsigned char v = 0;
    int mr = mincore((void *)(base + pg * page), page, &v);
    TAP_CHECK(mr == 0 && (v & 1) && got == pattern_byte("r.big1", mid),
              "touching a tensor byte faults its page in with the written value (the check has teeth)");
    ds41_checkpoint_close(c);
}

/* ds41_checkpoint_prefault maps a tensor's pages in one call: before it,
 * none of the tensor's pages has a page-table entry (the checkpoint was
 * only opened); after it, every one has (/proc/self/pagemap, bit 63
 * "present", readable without privileges). */
static size_t pages_present(const void *p, size_t len) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    int fd = open("/proc/self/pagemap", O_RDONLY);
    if (fd < 0) return (size_t)-1;
    size_t n = 0;
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)(page - 1); a < (uintptr_t)p + len; a += page) {
        uint64_t ent = 0;
        if (pread(fd, &ent, sizeof ent, (off_t)(a / page * sizeof ent)) != (ssize_t)sizeof ent) {
            close(fd);
            return (size_t)-1;
        }
        n += (ent >> 63) & 1;
    }
    close(fd);
    return n;
}

static long minor_faults(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
}

static void test_prefault(void) {
    const char *dir = new_dir("prefault");
    ds41_error e;
    static const decl ds[] = {
        {"p.big", DS41_U8, 1, {4 << 20}, false}, /* 4 MiB */
        {"p.none", DS41_U8, 1, {0}, false},
    };
    const int rc = write_decls(dir, ds, 2, &e);
    ds41_checkpoint *c = rc == 0 ? ds41_checkpoint_open(dir, &e) : NULL;
    TAP_CHECK(c != NULL, "prefault: a checkpoint with a 4 MiB tensor opens (%s)", c ? "ok" : e.msg);
    if (!c) return;
    const ds41_tensor *big = ds41_checkpoint_find(c, "p.big"), *none = ds41_checkpoint_find(c, "p.none");
    TAP_CHECK(ds41_checkpoint_prefault(c, none) == 0 && ds41_checkpoint_prefault(c, NULL) == 0,
              "prefault of an empty tensor or of none does nothing");
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), npages = (size_t)(big->nbytes / page);
    const size_t before = pages_present(big->data, (size_t)big->nbytes);
    const uint64_t got = ds41_checkpoint_prefault(c, big);
    if (got == 0 || before == (size_t)-1) {
        TAP_SKIP("MADV_POPULATE_READ or /proc/self/pagemap is not available here: the pages fault in on use");
    } else {
        const size_t after = pages_present(big->data, (size_t)big->nbytes);
        const long f0 = minor_faults();
        unsigned sum = 0, want = 0;
        for (size_t i = 0; i < big->nbytes; i += page) {
            sum += ((const volatile uint8_t *)big->data)[i];
            want += pattern_byte("p.big", i);
        }
        const long f1 = minor_faults();
        /* The faults while reading are reported, not judged: under ASan the
         * reads also touch the mapping's shadow memory (an eighth of it),
         * whose pages fault in on first use. */
        TAP_CHECK(
            got == big->nbytes && before == 0 && after >= npages && sum == want,
            "prefault maps a tensor's %zu pages at once (present before %zu, after %zu); reading them then "
            "gives the written bytes (%ld page faults meanwhile)",
            npages, before, after, f1 - f0);
    }
    ds41_checkpoint_close(c);
}

int main(void) {
    const char *tmp = "/tmp";
    snprintf(root, sizeof root, "%s/ds41-safetensors-XXXXXX", tmp);
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 2;
    }
    test_dtypes();
    test_parser_api();
    test_sharded_round_trip();
    test_single_file();
    test_writer_misuse();
    test_malformed_shards();
    test_malformed_index();
    test_directory_errors();
    test_no_payload_read();
    test_prefault();
    tmpdir_remove(root);
    return tap_done();
}
