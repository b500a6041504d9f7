/* Streaming safetensors checkpoint writer (contract: storage/safetensors.h).
 *
 * Two phases keep multi-GB checkpoints out of memory: the caller declares
 * every tensor first (names, dtypes, shapes), so the whole layout -- shards,
 * offsets, headers, index -- is known and written before any payload; then
 * payloads are streamed with pwrite at their final offsets. */
#include "storage/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum writer_state { DECLARING, WRITING, FINISHED, FAILED };

typedef struct wtensor {
    char *name;
    ds41_dtype dtype;
    int ndim;
    int64_t shape[DS41_MAX_DIMS];
    uint64_t nbytes;
    bool starts_shard; /* a forced break precedes this tensor */
    uint32_t shard;
    uint64_t offset;   /* relative to the shard's data region */
} wtensor;

typedef struct wshard {
    char *path;
    size_t first, count;  /* tensors [first, first+count) in declaration order */
    uint64_t data_start;  /* 8 + padded header length */
    uint64_t data_size;
    bool synced;
} wshard;

struct ds41_st_writer {
    char *dir;
    uint64_t target;
    bool single;
    enum writer_state state;
    ds41_error failure;   /* the message every call repeats once FAILED */

    wtensor *tensors;
    size_t count, cap;
    json_t *names;        /* declared names, for duplicate detection */
    bool break_pending;

    wshard *shards;
    size_t shard_count;

    size_t next;          /* next tensor to write */
    int fd;               /* open shard, or -1 */
    size_t fd_shard;
};

/* Record a failure (the writer stays failed) and copy it to err. */
__attribute__((format(printf, 3, 4))) static int wfail(ds41_st_writer *w, ds41_error *err, const char *fmt,
                                                       ...) {
    va_list ap;
    va_start(ap, fmt);
    ds41_vfail(&w->failure, fmt, ap);
    va_end(ap);
    w->state = FAILED;
    if (err) *err = w->failure;
    return -1;
}

/* Every entry point starts here: a failed writer repeats its failure. */
static int check_state(ds41_st_writer *w, enum writer_state want, const char *call, ds41_error *err) {
    if (!w) return ds41_fail(err, "%s: NULL writer", call);
    if (w->state == FAILED) {
        if (err) *err = w->failure;
        return -1;
    }
    if (w->state != want) {
        static const char *const words[] = {"declaring", "writing", "finished", "failed"};
        return wfail(w, err, "%s: %s called while the writer is %s", w->dir, call, words[w->state]);
    }
    return 0;
}

ds41_st_writer *ds41_checkpoint_writer_new(const char *dir, uint64_t shard_target_bytes, ds41_error *err) {
    struct stat st;
    if (!dir || !*dir) {
        ds41_fail(err, "checkpoint writer: empty directory path");
        return NULL;
    }
    if (stat(dir, &st) != 0) {
        ds41_fail(err, "%s: cannot use as checkpoint directory: %s", dir, strerror(errno));
        return NULL;
    }
    if (!S_ISDIR(st.st_mode)) {
        ds41_fail(err, "%s: not a directory", dir);
        return NULL;
    }
    ds41_st_writer *w = calloc(1, sizeof *w);
    if (w) {
        w->dir = strdup(dir);
        w->names = json_object();
    }
    if (!w || !w->dir || !w->names) {
        ds41_checkpoint_writer_free(w);
        ds41_fail(err, "%s: out of memory", dir);
        return NULL;
    }
    w->target = shard_target_bytes;
    w->fd = -1;
    return w;
}

int ds41_checkpoint_writer_single_file(ds41_st_writer *w, ds41_error *err) {
    if (check_state(w, DECLARING, "ds41_checkpoint_writer_single_file", err) != 0) return -1;
    if (w->count > 0)
        return wfail(w, err, "%s: single-file mode must be chosen before the first tensor is declared", w->dir);
    w->single = true;
    return 0;
}

int ds41_checkpoint_writer_declare(ds41_st_writer *w, const char *name, ds41_dtype dtype, int ndim,
                                   const int64_t *shape, ds41_error *err) {
    if (check_state(w, DECLARING, "ds41_checkpoint_writer_declare", err) != 0) return -1;
    if (!name || !*name) return wfail(w, err, "%s: tensor %zu has an empty name", w->dir, w->count);
    if (strcmp(name, "__metadata__") == 0)
        return wfail(w, err, "%s: '__metadata__' is reserved, not a tensor name", w->dir);
    if ((unsigned)dtype >= DS41_DTYPE_COUNT)
        return wfail(w, err, "%s: tensor '%s': dtype %d is not a ds41_dtype", w->dir, name, (int)dtype);
    if (ndim < 0 || ndim > DS41_MAX_DIMS)
        return wfail(w, err, "%s: tensor '%s': %d dimensions, expected 0..%d", w->dir, name, ndim, DS41_MAX_DIMS);
    if (ndim > 0 && !shape) return wfail(w, err, "%s: tensor '%s': NULL shape", w->dir, name);
    if (json_object_get(w->names, name))
        return wfail(w, err, "%s: tensor '%s' is declared twice", w->dir, name);

    uint64_t bytes = ds41_dtype_size(dtype);
    bool zero = false, overflow = false;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return wfail(w, err, "%s: tensor '%s': shape[%d] is %" PRId64 ", negative", w->dir, name, i, shape[i]);
        if (shape[i] == 0) zero = true;
        if (__builtin_mul_overflow(bytes, (uint64_t)shape[i], &bytes)) overflow = true;
    }
    if (zero) bytes = 0;
    else if (overflow || bytes > (uint64_t)INT64_MAX)
        return wfail(w, err, "%s: tensor '%s': byte size overflows", w->dir, name);

    if (w->count == w->cap) {
        size_t ncap = w->cap ? w->cap * 2 : 64;
        wtensor *nt = realloc(w->tensors, ncap * sizeof *nt);
        if (!nt) return wfail(w, err, "%s: out of memory", w->dir);
        w->tensors = nt;
        w->cap = ncap;
    }
    wtensor *t = &w->tensors[w->count];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (!t->name) return wfail(w, err, "%s: out of memory", w->dir);
    /* json_object_set_new validates UTF-8, which the JSON header needs. */
    if (json_object_set_new(w->names, name, json_true()) != 0) {
        free(t->name);
        return wfail(w, err, "%s: tensor name '%s' is not valid UTF-8", w->dir, name);
    }
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->nbytes = bytes;
    t->starts_shard = w->break_pending && w->count > 0;
    w->break_pending = false;
    w->count++;
    return 0;
}

int ds41_checkpoint_writer_break_shard(ds41_st_writer *w) {
    if (check_state(w, DECLARING, "ds41_checkpoint_writer_break_shard", NULL) != 0) return -1;
    if (w->single) return wfail(w, NULL, "%s: shard breaks are not allowed in single-file mode", w->dir);
    w->break_pending = true;
    return 0;
}

/* ------------------------------------------------------------- file I/O */

static int write_all(int fd, const void *buf, size_t len, uint64_t off) {
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t put = pwrite(fd, p, len, (off_t)off);
        if (put < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (put == 0) {
            errno = EIO;
            return -1;
        }
        p += put;
        len -= (size_t)put;
        off += (uint64_t)put;
    }
    return 0;
}

static char *join(const char *dir, const char *name) {
    size_t dl = strlen(dir), nl = strlen(name);
    char *p = malloc(dl + nl + 2);
    if (!p) return NULL;
    memcpy(p, dir, dl);
    p[dl] = '/';
    memcpy(p + dl + 1, name, nl + 1);
    return p;
}

/* Create path and write buf[0..len) at offset 0 (truncating what was there). */
static int create_file(ds41_st_writer *w, const char *path, const void *buf, size_t len, bool sync,
                       ds41_error *err) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return wfail(w, err, "%s: cannot create: %s", path, strerror(errno));
    if (write_all(fd, buf, len, 0) != 0 || (sync && fsync(fd) != 0)) {
        int e = errno;
        close(fd);
        return wfail(w, err, "%s: write failed: %s", path, strerror(e));
    }
    if (close(fd) != 0) return wfail(w, err, "%s: close failed: %s", path, strerror(errno));
    return 0;
}

/* ---------------------------------------------------------------- begin */

static int cmp_size_desc(const void *a, const void *b, void *ctx) {
    const wtensor *t = ctx;
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    size_t sx = ds41_dtype_size(t[x].dtype), sy = ds41_dtype_size(t[y].dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return x < y ? -1 : x > y; /* stable: declaration order */
}

static json_t *shape_json(const wtensor *t) {
    json_t *a = json_array();
    for (int i = 0; a && i < t->ndim; i++)
        if (json_array_append_new(a, json_integer(t->shape[i])) != 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* Lay out shard s (offsets by element size, largest first), build its
 * header and write it. */
static int write_shard_header(ds41_st_writer *w, wshard *s, ds41_error *err) {
    size_t *order = malloc(s->count * sizeof *order);
    if (!order) return wfail(w, err, "%s: out of memory", s->path);
    for (size_t i = 0; i < s->count; i++) order[i] = s->first + i;
    qsort_r(order, s->count, sizeof *order, cmp_size_desc, w->tensors);
    uint64_t off = 0;
    for (size_t i = 0; i < s->count; i++) {
        wtensor *t = &w->tensors[order[i]];
        t->offset = off;
        if (__builtin_add_overflow(off, t->nbytes, &off) || off > (uint64_t)INT64_MAX / 2) {
            free(order);
            return wfail(w, err, "%s: shard payload exceeds 2^62 bytes", s->path);
        }
    }
    free(order);
    s->data_size = off;

    json_t *root = json_object(), *meta = json_object();
    int bad = !root || !meta || json_object_set_new(meta, "format", json_string("pt")) != 0 ||
              json_object_set_new(root, "__metadata__", meta) != 0;
    if (!root || !meta) json_decref(meta);
    for (size_t i = 0; !bad && i < s->count; i++) {
        const wtensor *t = &w->tensors[s->first + i];
        json_t *e = json_pack("{s:s, s:o, s:[I, I]}", "dtype", ds41_dtype_name(t->dtype), "shape",
                              shape_json(t), "data_offsets", (json_int_t)t->offset,
                              (json_int_t)(t->offset + t->nbytes));
        bad = !e || json_object_set_new(root, t->name, e) != 0;
    }
    char *text = bad ? NULL : json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!text) return wfail(w, err, "%s: out of memory building the header", s->path);

    /* Pad with spaces to a multiple of 8 so the data region (and every
     * payload, given the layout) is aligned, as Hugging Face does. */
    size_t len = strlen(text), padded = (len + 7) & ~(size_t)7;
    uint8_t *buf = malloc(8 + padded);
    if (!buf) {
        free(text);
        return wfail(w, err, "%s: out of memory", s->path);
    }
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, text, len);
    memset(buf + 8 + len, ' ', padded - len);
    free(text);
    s->data_start = 8 + padded;
    int rc = create_file(w, s->path, buf, 8 + padded, false, err);
    free(buf);
    return rc;
}

static int write_index(ds41_st_writer *w, ds41_error *err) {
    uint64_t total = 0;
    for (size_t i = 0; i < w->shard_count; i++) total += w->shards[i].data_size;
    json_t *wm = json_object();
    json_t *root = json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)total, "weight_map", wm);
    int bad = !root;
    for (size_t i = 0; !bad && i < w->count; i++) {
        const wtensor *t = &w->tensors[i];
        const char *shard = strrchr(w->shards[t->shard].path, '/') + 1;
        bad = json_object_set_new(wm, t->name, json_string(shard)) != 0;
    }
    char *text = bad ? NULL : json_dumps(root, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(root);
    char *path = join(w->dir, DS41_ST_INDEX_NAME);
    if (!text || !path) {
        free(text);
        free(path);
        return wfail(w, err, "%s: out of memory building the index", w->dir);
    }
    size_t len = strlen(text);
    char *buf = realloc(text, len + 2);
    if (!buf) {
        free(text);
        free(path);
        return wfail(w, err, "%s: out of memory building the index", w->dir);
    }
    buf[len] = '\n'; /* transformers ends the file with a newline */
    int rc = create_file(w, path, buf, len + 1, true, err);
    free(buf);
    free(path);
    return rc;
}

int ds41_checkpoint_writer_begin(ds41_st_writer *w, ds41_error *err) {
    if (check_state(w, DECLARING, "ds41_checkpoint_writer_begin", err) != 0) return -1;
    if (w->count == 0) return wfail(w, err, "%s: no tensors were declared", w->dir);

    /* Assign shards in declaration order. */
    size_t nshards = 0;
    uint64_t cur = 0;
    for (size_t i = 0; i < w->count; i++) {
        wtensor *t = &w->tensors[i];
        uint64_t grown;
        bool over = __builtin_add_overflow(cur, t->nbytes, &grown) || grown > w->target;
        bool start = i == 0 || (!w->single && (t->starts_shard || (w->target && over)));
        if (start) {
            nshards++;
            cur = t->nbytes;
        } else {
            cur = over ? UINT64_MAX : grown;
        }
        t->shard = (uint32_t)(nshards - 1);
    }
    if (nshards > 99999) return wfail(w, err, "%s: %zu shards, more than the 5-digit names allow", w->dir, nshards);
    w->shards = calloc(nshards, sizeof *w->shards);
    if (!w->shards) return wfail(w, err, "%s: out of memory", w->dir);
    w->shard_count = nshards;
    for (size_t i = 0; i < w->count; i++) {
        wshard *s = &w->shards[w->tensors[i].shard];
        if (s->count == 0) s->first = i;
        s->count++;
    }
    for (size_t i = 0; i < nshards; i++) {
        char name[64];
        if (w->single) snprintf(name, sizeof name, "%s", DS41_ST_SINGLE_NAME);
        else snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, nshards);
        w->shards[i].path = join(w->dir, name);
        if (!w->shards[i].path) return wfail(w, err, "%s: out of memory", w->dir);
    }
    for (size_t i = 0; i < nshards; i++)
        if (write_shard_header(w, &w->shards[i], err) != 0) return -1;
    if (!w->single && write_index(w, err) != 0) return -1;
    w->state = WRITING;
    return 0;
}

/* ---------------------------------------------------------------- write */

static int close_current(ds41_st_writer *w, ds41_error *err) {
    if (w->fd < 0) return 0;
    wshard *s = &w->shards[w->fd_shard];
    int fd = w->fd;
    w->fd = -1;
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        return wfail(w, err, "%s: fsync failed: %s", s->path, strerror(e));
    }
    if (close(fd) != 0) return wfail(w, err, "%s: close failed: %s", s->path, strerror(errno));
    s->synced = true;
    return 0;
}

int ds41_checkpoint_writer_write(ds41_st_writer *w, const char *name, const void *data, size_t nbytes,
                                 ds41_error *err) {
    if (check_state(w, WRITING, "ds41_checkpoint_writer_write", err) != 0) return -1;
    if (!name) name = "(null)";
    if (w->next >= w->count)
        return wfail(w, err, "%s: tensor '%s' written after all %zu declared tensors", w->dir, name, w->count);
    wtensor *t = &w->tensors[w->next];
    if (strcmp(t->name, name) != 0)
        return wfail(w, err, "%s: tensor '%s' written out of order: the next declared tensor is '%s'", w->dir,
                     name, t->name);
    if ((uint64_t)nbytes != t->nbytes)
        return wfail(w, err, "%s: tensor '%s': %zu bytes given, %" PRIu64 " declared", w->dir, name, nbytes,
                     t->nbytes);
    if (nbytes && !data) return wfail(w, err, "%s: tensor '%s': NULL data", w->dir, name);
    wshard *s = &w->shards[t->shard];
    if (w->fd < 0 || w->fd_shard != t->shard) {
        if (close_current(w, err) != 0) return -1;
        w->fd = open(s->path, O_WRONLY | O_CLOEXEC);
        if (w->fd < 0) return wfail(w, err, "%s: cannot open for writing: %s", s->path, strerror(errno));
        w->fd_shard = t->shard;
    }
    if (nbytes && write_all(w->fd, data, nbytes, s->data_start + t->offset) != 0)
        return wfail(w, err, "%s: tensor '%s': write failed: %s", s->path, name, strerror(errno));
    w->next++;
    /* Keep one shard open at a time: sync it as soon as it is complete. */
    if (w->next == w->count || w->tensors[w->next].shard != t->shard) return close_current(w, err);
    return 0;
}

int ds41_checkpoint_writer_finish(ds41_st_writer *w, ds41_error *err) {
    if (check_state(w, WRITING, "ds41_checkpoint_writer_finish", err) != 0) return -1;
    if (w->next < w->count)
        return wfail(w, err, "%s: tensor '%s' was declared but not written (%zu of %zu written)", w->dir,
                     w->tensors[w->next].name, w->next, w->count);
    if (close_current(w, err) != 0) return -1;
    for (size_t i = 0; i < w->shard_count; i++) {
        if (w->shards[i].synced) continue;
        int fd = open(w->shards[i].path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || fsync(fd) != 0) {
            int e = errno;
            if (fd >= 0) close(fd);
            return wfail(w, err, "%s: fsync failed: %s", w->shards[i].path, strerror(e));
        }
        close(fd);
        w->shards[i].synced = true;
    }
    /* Make the new directory entries durable too. */
    int dfd = open(w->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) != 0) {
        int e = errno;
        if (dfd >= 0) close(dfd);
        return wfail(w, err, "%s: fsync of the directory failed: %s", w->dir, strerror(e));
    }
    close(dfd);
    w->state = FINISHED;
    return 0;
}

void ds41_checkpoint_writer_free(ds41_st_writer *w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    for (size_t i = 0; i < w->count; i++) free(w->tensors[i].name);
    free(w->tensors);
    for (size_t i = 0; i < w->shard_count; i++) free(w->shards[i].path);
    free(w->shards);
    json_decref(w->names);
    free(w->dir);
    free(w);
}
