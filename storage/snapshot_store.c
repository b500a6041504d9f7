/* The disk tier of the prefix cache (see snapshot_store.h). */
#include "storage/snapshot_store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct entry {
    ds41_snapshot_entry info;
    int32_t *ids;
} store_entry;

typedef struct wjob {
    ds41_snapshot_owner owner;
    int32_t *ids;
    size_t n;
    uint8_t *kv;
    size_t kv_len;
    struct wjob *next;
} wjob;

struct ds41_snapshot_store {
    ds41_snapshot_store_opts o;
    char *dir;
    pthread_mutex_t mu;
    store_entry *e;
    size_t n, cap;
    ds41_snapshot_store_stats st;
    /* writer thread */
    pthread_cond_t wake, idle;
    pthread_t writer;
    bool writer_started, stopping, writing;
    wjob *head, *tail;
    uint64_t pending_bytes; /* state bytes queued for the writer */
};

/* Queued saves beyond this many bytes are dropped (a disk slower than the evictions must not
 * make the queue grow without bound). */
#define MAX_PENDING_BYTES (1ull << 30)

__attribute__((format(printf, 2, 3))) static void slog(ds41_snapshot_store *st, const char *fmt, ...) {
    if (!st->o.log) return;
    char line[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    st->o.log(st->o.log_ctx, line);
}

static uint64_t max_raw_for(const ds41_snapshot_store *st, size_t n_ids) {
    return st->o.max_raw ? st->o.max_raw(st->o.max_raw_ctx, n_ids) : (1ull << 30) + (64ull << 20);
}

void ds41_snapshot_store_name(const ds41_snapshot_owner *owner, const int32_t *ids, size_t n,
                              char name[DS41_SNAPSHOT_NAME_LEN + 1]) {
    uint8_t *b = malloc(DS41_SNAPSHOT_KEY_BYTES + 4 * n);
    uint8_t h[32];
    if (b) {
        memcpy(b, owner->key, DS41_SNAPSHOT_KEY_BYTES);
        for (size_t i = 0; i < n; i++)
            for (int k = 0; k < 4; k++)
                b[DS41_SNAPSHOT_KEY_BYTES + 4 * i + k] = (uint8_t)((uint32_t)ids[i] >> (8 * k));
        ds41_sha256(b, DS41_SNAPSHOT_KEY_BYTES + 4 * n, h);
        free(b);
    } else {
        memset(h, 0, sizeof h);
    }
    for (int i = 0; i < DS41_SNAPSHOT_NAME_LEN / 2; i++) snprintf(name + 2 * i, 3, "%02x", h[i]);
}

static bool valid_name(const char *name) {
    if (!name || strlen(name) != DS41_SNAPSHOT_NAME_LEN) return false;
    for (int i = 0; i < DS41_SNAPSHOT_NAME_LEN; i++)
        if (!((name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f'))) return false;
    return true;
}

static void path_of(const ds41_snapshot_store *st, const char *name, char *out, size_t size) {
    snprintf(out, size, "%s/%s.snap", st->dir, name);
}

/* ---- index (callers hold mu) ----------------------------------------------------------------- */

static size_t find(const ds41_snapshot_store *st, const char *name) {
    for (size_t i = 0; i < st->n; i++)
        if (strcmp(st->e[i].info.name, name) == 0) return i;
    return SIZE_MAX;
}

static void drop(ds41_snapshot_store *st, size_t i) {
    st->st.bytes -= st->e[i].info.bytes;
    free(st->e[i].ids);
    st->e[i] = st->e[--st->n];
    st->st.entries = st->n;
}

/* Take over ids; replaces an entry of the same name. */
static int add(ds41_snapshot_store *st, const ds41_snapshot_entry *info, int32_t *ids) {
    size_t i = find(st, info->name);
    if (i != SIZE_MAX) drop(st, i);
    if (st->n == st->cap) {
        size_t cap = st->cap ? st->cap * 2 : 16;
        store_entry *ne = realloc(st->e, cap * sizeof *ne);
        if (!ne) {
            free(ids);
            return -1;
        }
        st->e = ne;
        st->cap = cap;
    }
    st->e[st->n].info = *info;
    st->e[st->n].ids = ids;
    st->n++;
    st->st.entries = st->n;
    st->st.bytes += info->bytes;
    return 0;
}

static void touch(ds41_snapshot_store *st, size_t i) {
    st->e[i].info.last_used = (int64_t)time(NULL);
    char p[PATH_MAX];
    path_of(st, st->e[i].info.name, p, sizeof p);
    utimensat(AT_FDCWD, p, NULL, 0); /* the mtime carries the LRU order across restarts */
}

/* Delete least recently used snapshots (never `keep`) until the total fits. */
static void trim(ds41_snapshot_store *st, const char *keep) {
    while (st->o.max_bytes && st->st.bytes > st->o.max_bytes) {
        size_t victim = SIZE_MAX;
        for (size_t i = 0; i < st->n; i++) {
            if (keep && strcmp(st->e[i].info.name, keep) == 0) continue;
            if (victim == SIZE_MAX || st->e[i].info.last_used < st->e[victim].info.last_used) victim = i;
        }
        if (victim == SIZE_MAX) break;
        char p[PATH_MAX];
        path_of(st, st->e[victim].info.name, p, sizeof p);
        unlink(p);
        st->st.evictions++;
        drop(st, victim);
    }
}

/* ---- open / close ---------------------------------------------------------------------------- */

static int mkdir_p(const char *path) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0750) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    return mkdir(buf, 0750) != 0 && errno != EEXIST ? -1 : 0;
}

static void do_save(ds41_snapshot_store *st, const ds41_snapshot_owner *owner, const int32_t *ids, size_t n,
                    const uint8_t *kv, size_t kv_len, const uint8_t *sampler, size_t sampler_len,
                    ds41_snapshot_entry *out, int *rc, ds41_error *err);

static void *writer_main(void *p) {
    ds41_snapshot_store *st = p;
    pthread_mutex_lock(&st->mu);
    for (;;) {
        while (!st->head && !st->stopping) pthread_cond_wait(&st->wake, &st->mu);
        if (!st->head) break;
        wjob *j = st->head;
        st->head = j->next;
        if (!st->head) st->tail = NULL;
        st->pending_bytes -= j->kv_len;
        st->writing = true;
        pthread_mutex_unlock(&st->mu);
        int rc;
        ds41_error err = {{0}};
        do_save(st, &j->owner, j->ids, j->n, j->kv, j->kv_len, NULL, 0, NULL, &rc, &err);
        if (rc != 0) slog(st, "snapshot save failed: %s", err.msg);
        free(j->ids);
        free(j->kv);
        free(j);
        pthread_mutex_lock(&st->mu);
        st->writing = false;
        if (!st->head) pthread_cond_broadcast(&st->idle);
    }
    pthread_mutex_unlock(&st->mu);
    return NULL;
}

int ds41_snapshot_store_open(const ds41_snapshot_store_opts *opts, ds41_snapshot_store **out,
                             ds41_error *err) {
    *out = NULL;
    if (!opts || !opts->dir || !*opts->dir) return ds41_fail(err, "snapshot store: no directory");
    if (mkdir_p(opts->dir) != 0) return ds41_fail(err, "%s: cannot create: %s", opts->dir, strerror(errno));
    ds41_snapshot_store *st = calloc(1, sizeof *st);
    if (!st || !(st->dir = strdup(opts->dir))) {
        free(st);
        return ds41_fail(err, "out of memory");
    }
    st->o = *opts;
    st->o.dir = st->dir;
    st->st.max_bytes = opts->max_bytes;
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->wake, NULL);
    pthread_cond_init(&st->idle, NULL);
    int cleaned = ds41_snapshot_clean_temp(st->dir);
    if (cleaned > 0) slog(st, "%s: removed %d temporary file(s) of an interrupted save", st->dir, cleaned);
    DIR *d = opendir(st->dir);
    if (!d) {
        ds41_fail(err, "%s: %s", st->dir, strerror(errno));
        ds41_snapshot_store_free(st);
        return -1;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len != DS41_SNAPSHOT_NAME_LEN + 5 || strcmp(de->d_name + DS41_SNAPSHOT_NAME_LEN, ".snap") != 0)
            continue;
        char name[DS41_SNAPSHOT_NAME_LEN + 1];
        memcpy(name, de->d_name, DS41_SNAPSHOT_NAME_LEN);
        name[DS41_SNAPSHOT_NAME_LEN] = 0;
        if (!valid_name(name)) continue;
        char p[PATH_MAX];
        path_of(st, name, p, sizeof p);
        ds41_snapshot s;
        ds41_error e = {{0}};
        if (ds41_snapshot_read_head(p, st->o.model_id, &s, &e) != 0) {
            slog(st, "unreadable snapshot deleted: %s", e.msg);
            unlink(p);
            continue;
        }
        char want[DS41_SNAPSHOT_NAME_LEN + 1];
        ds41_snapshot_store_name(&s.owner, s.ids, s.n_ids, want);
        if (strcmp(want, name) != 0) {
            slog(st, "unreadable snapshot deleted: %s: its ids do not match its name", p);
            unlink(p);
            ds41_snapshot_free(&s);
            continue;
        }
        struct stat sb;
        ds41_snapshot_entry info = {0};
        memcpy(info.name, name, sizeof info.name);
        info.n_ids = s.n_ids;
        info.owner = s.owner;
        info.bytes = s.file_bytes;
        info.created = s.created;
        info.last_used = stat(p, &sb) == 0 ? (int64_t)sb.st_mtime : s.created;
        info.has_sampler = s.sampler_len > 0;
        int32_t *ids = s.ids;
        s.ids = NULL;
        ds41_snapshot_free(&s);
        if (add(st, &info, ids) != 0) {
            closedir(d);
            ds41_fail(err, "out of memory");
            ds41_snapshot_store_free(st);
            return -1;
        }
    }
    closedir(d);
    int e = pthread_create(&st->writer, NULL, writer_main, st);
    if (e != 0) {
        ds41_fail(err, "snapshot store: cannot start the writer thread: %s", strerror(e));
        ds41_snapshot_store_free(st);
        return -1;
    }
    st->writer_started = true;
    *out = st;
    return 0;
}

void ds41_snapshot_store_flush(ds41_snapshot_store *st) {
    if (!st) return;
    pthread_mutex_lock(&st->mu);
    while (st->head || st->writing) pthread_cond_wait(&st->idle, &st->mu);
    pthread_mutex_unlock(&st->mu);
}

void ds41_snapshot_store_free(ds41_snapshot_store *st) {
    if (!st) return;
    if (st->writer_started) {
        pthread_mutex_lock(&st->mu);
        st->stopping = true;
        pthread_cond_broadcast(&st->wake);
        pthread_mutex_unlock(&st->mu);
        pthread_join(st->writer, NULL); /* it drains the queue first */
    }
    for (size_t i = 0; i < st->n; i++) free(st->e[i].ids);
    free(st->e);
    pthread_cond_destroy(&st->wake);
    pthread_cond_destroy(&st->idle);
    pthread_mutex_destroy(&st->mu);
    free(st->dir);
    free(st);
}

/* ---- lookups, loads, saves ------------------------------------------------------------------- */

static bool same_partition(const store_entry *e, const ds41_snapshot_owner *owner) {
    return memcmp(e->info.owner.key, owner->key, DS41_SNAPSHOT_KEY_BYTES) == 0;
}

size_t ds41_snapshot_store_match(ds41_snapshot_store *st, const ds41_snapshot_owner *owner,
                                 const int32_t *ids, size_t n, char name[DS41_SNAPSHOT_NAME_LEN + 1]) {
    pthread_mutex_lock(&st->mu);
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < st->n; i++) {
        const store_entry *e = &st->e[i];
        if (e->info.n_ids >= n || (best != SIZE_MAX && e->info.n_ids <= st->e[best].info.n_ids)) continue;
        if (!same_partition(e, owner)) continue;
        if (memcmp(e->ids, ids, e->info.n_ids * sizeof *ids) == 0) best = i;
    }
    size_t len = 0;
    if (best != SIZE_MAX) {
        memcpy(name, st->e[best].info.name, DS41_SNAPSHOT_NAME_LEN + 1);
        len = st->e[best].info.n_ids;
        st->st.hits++;
    } else {
        name[0] = 0;
        st->st.misses++;
    }
    pthread_mutex_unlock(&st->mu);
    return len;
}

bool ds41_snapshot_store_contains(ds41_snapshot_store *st, const ds41_snapshot_owner *owner,
                                  const int32_t *ids, size_t n) {
    char name[DS41_SNAPSHOT_NAME_LEN + 1];
    ds41_snapshot_store_name(owner, ids, n, name);
    pthread_mutex_lock(&st->mu);
    size_t i = find(st, name);
    bool yes = i != SIZE_MAX && st->e[i].info.n_ids == n && same_partition(&st->e[i], owner) &&
               memcmp(st->e[i].ids, ids, n * sizeof *ids) == 0;
    pthread_mutex_unlock(&st->mu);
    return yes;
}

int ds41_snapshot_store_load(ds41_snapshot_store *st, const char *name, ds41_snapshot *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&st->mu);
    size_t i = valid_name(name) ? find(st, name) : SIZE_MAX;
    size_t n_ids = i != SIZE_MAX ? st->e[i].info.n_ids : 0;
    pthread_mutex_unlock(&st->mu);
    if (i == SIZE_MAX) return ds41_fail(err, "no snapshot %.64s", name ? name : "(null)");
    char p[PATH_MAX];
    path_of(st, name, p, sizeof p);
    ds41_error e = {{0}};
    int rc = ds41_snapshot_read(p, st->o.model_id, max_raw_for(st, n_ids), out, &e);
    char want[DS41_SNAPSHOT_NAME_LEN + 1];
    if (rc == 0) {
        ds41_snapshot_store_name(&out->owner, out->ids, out->n_ids, want);
        if (strcmp(want, name) != 0) {
            ds41_snapshot_free(out);
            rc = ds41_fail(&e, "%s: its ids do not match its name", p);
        }
    }
    pthread_mutex_lock(&st->mu);
    i = find(st, name);
    if (rc == 0) {
        st->st.loads++;
        st->st.restored_tokens += out->n_ids;
        if (i != SIZE_MAX) touch(st, i);
    } else {
        st->st.load_errors++;
        if (i != SIZE_MAX) drop(st, i);
        unlink(p);
    }
    pthread_mutex_unlock(&st->mu);
    if (rc != 0) {
        slog(st, "snapshot refused and deleted: %s", e.msg);
        if (err) *err = e;
        return -1;
    }
    return 0;
}

static void do_save(ds41_snapshot_store *st, const ds41_snapshot_owner *owner, const int32_t *ids, size_t n,
                    const uint8_t *kv, size_t kv_len, const uint8_t *sampler, size_t sampler_len,
                    ds41_snapshot_entry *out, int *rc, ds41_error *err) {
    ds41_snapshot_entry info = {0};
    ds41_snapshot_store_name(owner, ids, n, info.name);
    info.owner = *owner;
    char p[PATH_MAX];
    path_of(st, info.name, p, sizeof p);
    uint64_t bytes = 0;
    *rc = ds41_snapshot_write(p, st->o.model_id, owner, ids, n, kv, kv_len, sampler, sampler_len,
                              &st->o.write, &bytes, err);
    int32_t *copy = *rc == 0 ? malloc(n * sizeof *copy) : NULL;
    if (*rc == 0 && !copy) *rc = ds41_fail(err, "out of memory");
    pthread_mutex_lock(&st->mu);
    if (*rc == 0) {
        memcpy(copy, ids, n * sizeof *copy);
        info.n_ids = n;
        info.bytes = bytes;
        info.created = info.last_used = (int64_t)time(NULL);
        info.has_sampler = sampler_len > 0;
        if (add(st, &info, copy) != 0) *rc = ds41_fail(err, "out of memory");
    }
    if (*rc == 0) {
        st->st.saves++;
        trim(st, info.name);
        if (out) *out = info;
    } else {
        st->st.save_errors++;
    }
    pthread_mutex_unlock(&st->mu);
}

int ds41_snapshot_store_save(ds41_snapshot_store *st, const ds41_snapshot_owner *owner, const int32_t *ids,
                             size_t n, const uint8_t *kv, size_t kv_len, const uint8_t *sampler,
                             size_t sampler_len, ds41_snapshot_entry *entry, ds41_error *err) {
    int rc;
    do_save(st, owner, ids, n, kv, kv_len, sampler, sampler_len, entry, &rc, err);
    return rc;
}

int ds41_snapshot_store_save_async(ds41_snapshot_store *st, const ds41_snapshot_owner *owner, int32_t *ids,
                                   size_t n, uint8_t *kv, size_t kv_len, ds41_error *err) {
    wjob *j = calloc(1, sizeof *j);
    if (!j) {
        free(ids);
        free(kv);
        return ds41_fail(err, "out of memory");
    }
    j->owner = *owner;
    j->ids = ids;
    j->n = n;
    j->kv = kv;
    j->kv_len = kv_len;
    pthread_mutex_lock(&st->mu);
    if (st->pending_bytes + kv_len > MAX_PENDING_BYTES) {
        st->st.save_errors++;
        pthread_mutex_unlock(&st->mu);
        free(ids);
        free(kv);
        free(j);
        return ds41_fail(err, "%s: %llu bytes of snapshots already wait for the disk; this one is dropped",
                         st->dir, (unsigned long long)MAX_PENDING_BYTES);
    }
    st->pending_bytes += kv_len;
    if (st->tail)
        st->tail->next = j;
    else
        st->head = j;
    st->tail = j;
    pthread_cond_signal(&st->wake);
    pthread_mutex_unlock(&st->mu);
    return 0;
}

int ds41_snapshot_store_remove(ds41_snapshot_store *st, const char *name, ds41_error *err) {
    pthread_mutex_lock(&st->mu);
    size_t i = valid_name(name) ? find(st, name) : SIZE_MAX;
    if (i == SIZE_MAX) {
        pthread_mutex_unlock(&st->mu);
        return ds41_fail(err, "no snapshot %.64s", name ? name : "(null)");
    }
    char p[PATH_MAX];
    path_of(st, name, p, sizeof p);
    int rc = unlink(p) == 0 || errno == ENOENT ? 0 : ds41_fail(err, "%s: %s", p, strerror(errno));
    if (rc == 0) drop(st, i);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

static int by_last_used_desc(const void *a, const void *b) {
    const ds41_snapshot_entry *x = a, *y = b;
    if (x->last_used != y->last_used) return x->last_used > y->last_used ? -1 : 1;
    return strcmp(x->name, y->name);
}

void ds41_snapshot_store_list(ds41_snapshot_store *st, void (*emit)(void *acc, const ds41_snapshot_entry *e),
                              void *acc) {
    pthread_mutex_lock(&st->mu);
    ds41_snapshot_entry *v = malloc((st->n ? st->n : 1) * sizeof *v);
    if (v) {
        for (size_t i = 0; i < st->n; i++) v[i] = st->e[i].info;
        qsort(v, st->n, sizeof *v, by_last_used_desc);
        for (size_t i = 0; i < st->n; i++) emit(acc, &v[i]);
        free(v);
    }
    pthread_mutex_unlock(&st->mu);
}

void ds41_snapshot_store_get_stats(ds41_snapshot_store *st, ds41_snapshot_store_stats *out) {
    pthread_mutex_lock(&st->mu);
    *out = st->st;
    pthread_mutex_unlock(&st->mu);
}

const char *ds41_snapshot_store_dir(const ds41_snapshot_store *st) {
    return st->dir;
}
