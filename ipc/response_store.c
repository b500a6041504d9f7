/* The stored responses (see ipc/response_store.h): an in-memory index of the entries (id,
 * owner, creation time, size), with their bytes in files under the directory or, without one,
 * in memory. */
#include "ipc/response_store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_ID 64

typedef struct entry {
    char id[MAX_ID + 1];
    int64_t owner;
    int64_t created;
    uint64_t bytes;
    char *data; /* memory mode only */
} entry;

struct ds41_response_store {
    pthread_mutex_t mu;
    char *dir; /* NULL: memory only */
    uint64_t max_bytes, max_age_s;
    entry *e;
    size_t n, cap;
    uint64_t total;
};

bool ds41_response_store_id_ok(const char *id) {
    size_t n = id ? strlen(id) : 0;
    if (n == 0 || n > MAX_ID) return false;
    for (size_t i = 0; i < n; i++) {
        char c = id[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '-'))
            return false;
    }
    return true;
}

/* "<dir>/<owner>-<id>.json" (suffix ".tmp" for the file being written). */
static int entry_path(const ds41_response_store *s, int64_t owner, const char *id, const char *suffix,
                      char *out, size_t n) {
    int r = owner < 0 ? snprintf(out, n, "%s/anon-%s.json%s", s->dir, id, suffix)
                      : snprintf(out, n, "%s/%" PRId64 "-%s.json%s", s->dir, owner, id, suffix);
    return r < 0 || (size_t)r >= n ? -1 : 0;
}

static void drop_at(ds41_response_store *s, size_t i) {
    entry *x = &s->e[i];
    if (s->dir) {
        char path[PATH_MAX];
        if (entry_path(s, x->owner, x->id, "", path, sizeof path) == 0) unlink(path);
    }
    free(x->data);
    s->total -= x->bytes;
    s->e[i] = s->e[--s->n];
}

static bool expired(const ds41_response_store *s, const entry *x, int64_t now) {
    return s->max_age_s && now - x->created > (int64_t)s->max_age_s;
}

static void drop_expired(ds41_response_store *s, int64_t now) {
    for (size_t i = 0; i < s->n;)
        if (expired(s, &s->e[i], now))
            drop_at(s, i);
        else
            i++;
}

static long find(const ds41_response_store *s, const char *id) {
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->e[i].id, id) == 0) return (long)i;
    return -1;
}

static int add_entry(ds41_response_store *s, const entry *x) {
    if (s->n == s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 16;
        entry *ne = realloc(s->e, nc * sizeof *ne);
        if (!ne) return -1;
        s->e = ne;
        s->cap = nc;
    }
    s->e[s->n++] = *x;
    s->total += x->bytes;
    return 0;
}

/* "<owner>-<id>.json" -> owner and id; false for any other name. */
static bool parse_name(const char *name, int64_t *owner, char id[MAX_ID + 1]) {
    const char *dash = strchr(name, '-');
    size_t nl = strlen(name);
    if (!dash || nl < 6 || strcmp(name + nl - 5, ".json") != 0) return false;
    size_t ol = (size_t)(dash - name), il = nl - 5 - ol - 1;
    if (il == 0 || il > MAX_ID) return false;
    if (ol == 4 && strncmp(name, "anon", 4) == 0) {
        *owner = -1;
    } else {
        if (ol == 0 || ol > 10) return false;
        int64_t v = 0;
        for (size_t i = 0; i < ol; i++) {
            if (name[i] < '0' || name[i] > '9') return false;
            v = v * 10 + (name[i] - '0');
        }
        if (v > UINT32_MAX) return false;
        *owner = v;
    }
    memcpy(id, dash + 1, il);
    id[il] = 0;
    return ds41_response_store_id_ok(id);
}

static int scan_dir(ds41_response_store *s, ds41_error *err) {
    DIR *d = opendir(s->dir);
    if (!d) return ds41_fail(err, "responses: cannot open %s: %s", s->dir, strerror(errno));
    struct dirent *de;
    int rc = 0;
    while ((de = readdir(d))) {
        entry x = {0};
        if (!parse_name(de->d_name, &x.owner, x.id)) {
            size_t nl = strlen(de->d_name);
            /* a temporary file left by a crash mid-write is never an entry */
            if (nl > 4 && strcmp(de->d_name + nl - 4, ".tmp") == 0) unlinkat(dirfd(d), de->d_name, 0);
            continue;
        }
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
        if (find(s, x.id) >= 0) continue; /* the same id under two owners: keep the first seen */
        x.created = (int64_t)st.st_mtime;
        x.bytes = (uint64_t)st.st_size;
        if (add_entry(s, &x)) {
            rc = ds41_fail(err, "responses: out of memory");
            break;
        }
    }
    closedir(d);
    return rc;
}

int ds41_response_store_open(const char *dir, uint64_t max_bytes, uint64_t max_age_s, int64_t now,
                             ds41_response_store **out, ds41_error *err) {
    *out = NULL;
    ds41_response_store *s = calloc(1, sizeof *s);
    if (!s) return ds41_fail(err, "responses: out of memory");
    pthread_mutex_init(&s->mu, NULL);
    s->max_bytes = max_bytes;
    s->max_age_s = max_age_s;
    if (dir) {
        s->dir = strdup(dir);
        if (!s->dir) {
            ds41_response_store_close(s);
            return ds41_fail(err, "responses: out of memory");
        }
        if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
            ds41_fail(err, "responses: cannot create %s: %s", dir, strerror(errno));
            ds41_response_store_close(s);
            return -1;
        }
        if (scan_dir(s, err)) {
            ds41_response_store_close(s);
            return -1;
        }
        drop_expired(s, now);
    }
    *out = s;
    return 0;
}

void ds41_response_store_close(ds41_response_store *s) {
    if (!s) return;
    for (size_t i = 0; i < s->n; i++) free(s->e[i].data);
    free(s->e);
    free(s->dir);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static int write_file(const ds41_response_store *s, int64_t owner, const char *id, const char *data,
                      size_t len, int64_t now, ds41_error *err) {
    char tmp[PATH_MAX], path[PATH_MAX];
    if (entry_path(s, owner, id, ".tmp", tmp, sizeof tmp) || entry_path(s, owner, id, "", path, sizeof path))
        return ds41_fail(err, "responses: the path of '%s' is too long", id);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return ds41_fail(err, "responses: cannot create %s: %s", tmp, strerror(errno));
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, data + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            ds41_fail(err, "responses: cannot write %s: %s", tmp, w < 0 ? strerror(errno) : "short write");
            goto fail;
        }
        done += (size_t)w;
    }
    /* the mtime is the creation time the age limit counts from, also after a restart */
    struct timespec ts[2] = {{.tv_sec = now}, {.tv_sec = now}};
    if (futimens(fd, ts) != 0 || fsync(fd) != 0) {
        ds41_fail(err, "responses: cannot sync %s: %s", tmp, strerror(errno));
        goto fail;
    }
    close(fd);
    if (rename(tmp, path) != 0) {
        ds41_fail(err, "responses: cannot rename %s: %s", tmp, strerror(errno));
        unlink(tmp);
        return -1;
    }
    int dfd = open(s->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    return 0;
fail:
    close(fd);
    unlink(tmp);
    return -1;
}

int ds41_response_store_put(ds41_response_store *s, int64_t owner_uid, const char *id, const char *data,
                            size_t len, int64_t now, ds41_error *err) {
    if (!ds41_response_store_id_ok(id)) return ds41_fail(err, "responses: invalid id");
    if (s->max_bytes && len > s->max_bytes)
        return ds41_fail(
            err, "responses: the response (%zu bytes) is larger than the store's cap (%" PRIu64 " bytes)",
            len, s->max_bytes);
    if (owner_uid < -1) owner_uid = -1;
    pthread_mutex_lock(&s->mu);
    int rc = -1;
    long old = find(s, id);
    if (old >= 0) drop_at(s, (size_t)old);
    drop_expired(s, now);
    while (s->max_bytes && s->n && s->total + len > s->max_bytes) {
        size_t oldest = 0;
        for (size_t i = 1; i < s->n; i++)
            if (s->e[i].created < s->e[oldest].created) oldest = i;
        drop_at(s, oldest);
    }
    entry x = {.owner = owner_uid, .created = now, .bytes = len};
    memcpy(x.id, id, strlen(id) + 1);
    if (s->dir) {
        if (write_file(s, owner_uid, id, data, len, now, err)) goto out;
    } else {
        x.data = malloc(len + 1);
        if (!x.data) {
            ds41_fail(err, "responses: out of memory");
            goto out;
        }
        memcpy(x.data, data, len);
        x.data[len] = 0;
    }
    if (add_entry(s, &x)) {
        free(x.data);
        ds41_fail(err, "responses: out of memory");
        goto out;
    }
    rc = 0;
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int read_file(const char *path, uint64_t bytes, char **data, size_t *len, ds41_error *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return ds41_fail(err, "responses: cannot open %s: %s", path, strerror(errno));
    char *b = malloc((size_t)bytes + 1);
    size_t done = 0;
    if (!b) {
        close(fd);
        return ds41_fail(err, "responses: out of memory");
    }
    while (done < bytes) {
        ssize_t r = read(fd, b + done, (size_t)bytes - done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        done += (size_t)r;
    }
    close(fd);
    if (done != bytes) {
        free(b);
        return ds41_fail(err, "responses: %s changed size while being read", path);
    }
    b[done] = 0;
    *data = b;
    *len = done;
    return 0;
}

int ds41_response_store_get(ds41_response_store *s, int64_t owner_uid, const char *id, int64_t now,
                            char **data, size_t *len, ds41_error *err) {
    *data = NULL;
    *len = 0;
    if (!ds41_response_store_id_ok(id)) return 0;
    if (owner_uid < -1) owner_uid = -1;
    pthread_mutex_lock(&s->mu);
    int rc = 0;
    long i = find(s, id);
    if (i < 0 || s->e[i].owner != owner_uid) goto out;
    if (expired(s, &s->e[i], now)) {
        drop_at(s, (size_t)i);
        goto out;
    }
    if (!s->dir) {
        *data = malloc(s->e[i].bytes + 1);
        if (!*data) {
            rc = ds41_fail(err, "responses: out of memory");
            goto out;
        }
        memcpy(*data, s->e[i].data, s->e[i].bytes + 1);
        *len = s->e[i].bytes;
        rc = 1;
        goto out;
    }
    char path[PATH_MAX];
    if (entry_path(s, owner_uid, id, "", path, sizeof path) ||
        read_file(path, s->e[i].bytes, data, len, err) != 0) {
        /* gone or changed under us: forget it rather than fail every later request */
        s->total -= s->e[i].bytes;
        s->e[i] = s->e[--s->n];
        rc = -1;
        goto out;
    }
    rc = 1;
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int ds41_response_store_remove(ds41_response_store *s, int64_t owner_uid, const char *id) {
    if (!ds41_response_store_id_ok(id)) return 0;
    if (owner_uid < -1) owner_uid = -1;
    pthread_mutex_lock(&s->mu);
    long i = find(s, id);
    int rc = 0;
    if (i >= 0 && s->e[i].owner == owner_uid) {
        drop_at(s, (size_t)i);
        rc = 1;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

void ds41_response_store_stats(ds41_response_store *s, size_t *entries, uint64_t *bytes) {
    pthread_mutex_lock(&s->mu);
    if (entries) *entries = s->n;
    if (bytes) *bytes = s->total;
    pthread_mutex_unlock(&s->mu);
}
