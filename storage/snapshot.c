/* Session snapshot files (see snapshot.h). */
#include "storage/snapshot.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#define SNAP_MAGIC "DS41SNAP"
#define HEAD_CHECK_AT 128 /* offset of head_check: it covers the bytes before it */

/* ---- CRC-64/XZ ------------------------------------------------------------------------------- */

static uint64_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
    const uint64_t poly = 0xC96C5795D7870F42ull; /* ECMA-182, reflected */
    for (unsigned i = 0; i < 256; i++) {
        uint64_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ poly : c >> 1;
        crc_table[i] = c;
    }
}

uint64_t ds41_crc64(uint64_t crc, const void *data, size_t len) {
    pthread_once(&crc_once, crc_init);
    const uint8_t *p = data;
    crc = ~crc;
    for (size_t i = 0; i < len; i++) crc = crc_table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
    return ~crc;
}


/* ---- little-endian helpers ------------------------------------------------------------------- */

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* ---- model identity -------------------------------------------------------------------------- */

/* Hash a whole file into c; 0 / -1 (errno kept), ENOENT allowed when optional. */
static int hash_file(ds41_sha256_ctx *c, const char *path, bool optional, ds41_error *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (optional && errno == ENOENT) return 0;
        return ds41_fail(err, "%s: %s", path, strerror(errno));
    }
    uint8_t buf[65536];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            int e = errno;
            close(fd);
            return ds41_fail(err, "%s: %s", path, strerror(e));
        }
        if (n == 0) break;
        ds41_sha256_update(c, buf, (size_t)n);
    }
    close(fd);
    return 0;
}

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* name, size, 8-byte length + header JSON, the first 4096 payload bytes. */
static int hash_shard(ds41_sha256_ctx *c, const char *dir, const char *name, ds41_error *err) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path)
        return ds41_fail(err, "%s: path too long", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ds41_fail(err, "%s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return ds41_fail(err, "%s: %s", path, strerror(e));
    }
    ds41_sha256_update(c, name, strlen(name) + 1);
    uint8_t size[8];
    put64(size, (uint64_t)st.st_size);
    ds41_sha256_update(c, size, 8);
    uint8_t hl[8];
    uint64_t header_len = 0;
    if (pread(fd, hl, 8, 0) == 8) header_len = get64(hl);
    uint64_t upto = 8 + header_len + 4096;
    if (header_len > (uint64_t)st.st_size || upto > (uint64_t)st.st_size) upto = (uint64_t)st.st_size;
    uint8_t buf[65536];
    for (uint64_t off = 0; off < upto;) {
        size_t k = upto - off < sizeof buf ? (size_t)(upto - off) : sizeof buf;
        ssize_t n = pread(fd, buf, k, (off_t)off);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            int e = n < 0 ? errno : EIO;
            close(fd);
            return ds41_fail(err, "%s: %s", path, strerror(e));
        }
        ds41_sha256_update(c, buf, (size_t)n);
        off += (uint64_t)n;
    }
    close(fd);
    return 0;
}

int ds41_snapshot_model_id(const char *dir, uint8_t id[DS41_SNAPSHOT_ID_BYTES], ds41_error *err) {
    ds41_sha256_ctx c;
    ds41_sha256_init(&c);
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/inference/config.json", dir);
    if (hash_file(&c, path, false, err) != 0) return -1;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    if (hash_file(&c, path, true, err) != 0) return -1;
    DIR *d = opendir(dir);
    if (!d) return ds41_fail(err, "%s: %s", dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 12 || strcmp(e->d_name + len - 12, ".safetensors") != 0) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            char **nn = realloc(names, cap * sizeof *nn);
            if (!nn) {
                rc = ds41_fail(err, "out of memory");
                break;
            }
            names = nn;
        }
        if (!(names[n] = strdup(e->d_name))) {
            rc = ds41_fail(err, "out of memory");
            break;
        }
        n++;
    }
    closedir(d);
    if (rc == 0) {
        qsort(names, n, sizeof *names, cmp_names);
        for (size_t i = 0; i < n && rc == 0; i++) rc = hash_shard(&c, dir, names[i], err);
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    if (rc != 0) return -1;
    ds41_sha256_final(&c, id);
    return 0;
}

/* ---- writing --------------------------------------------------------------------------------- */

static int write_all(int fd, const uint8_t *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static atomic_uint temp_counter;

void ds41_snapshot_free(ds41_snapshot *s) {
    if (!s) return;
    free(s->ids);
    free(s->kv);
    free(s->sampler);
    memset(s, 0, sizeof *s);
}

int ds41_snapshot_write(const char *path, const uint8_t model_id[DS41_SNAPSHOT_ID_BYTES],
                        const ds41_snapshot_owner *owner, const int32_t *ids, size_t n_ids, const uint8_t *kv,
                        size_t kv_len, const uint8_t *sampler, size_t sampler_len,
                        const ds41_snapshot_write_opts *opts, uint64_t *file_bytes, ds41_error *err) {
    if (file_bytes) *file_bytes = 0;
    if (!path || !model_id || !owner || !ids || !kv) return ds41_fail(err, "snapshot: missing argument");
    if (owner->uid < -1 || owner->uid > UINT32_MAX)
        return ds41_fail(err, "%s: owner uid %lld out of range", path, (long long)owner->uid);
    if (n_ids == 0 || n_ids > DS41_SNAPSHOT_MAX_IDS)
        return ds41_fail(err, "%s: %zu token ids (1..%u)", path, n_ids, DS41_SNAPSHOT_MAX_IDS);
    if (kv_len == 0) return ds41_fail(err, "%s: empty KV state", path);
    if (sampler_len && !sampler) return ds41_fail(err, "%s: sampler length without data", path);
    for (size_t i = 0; i < n_ids; i++)
        if (ids[i] < 0) return ds41_fail(err, "%s: token id %d at %zu is negative", path, ids[i], i);

    /* the raw payload: kv then sampler */
    const size_t raw_len = kv_len + sampler_len;
    uint8_t *raw = NULL;
    const uint8_t *src = kv;
    if (sampler_len) {
        raw = malloc(raw_len);
        if (!raw) return ds41_fail(err, "%s: out of memory", path);
        memcpy(raw, kv, kv_len);
        memcpy(raw + kv_len, sampler, sampler_len);
        src = raw;
    }
    const size_t head_and_ids = DS41_SNAPSHOT_HEAD_BYTES + 4 * n_ids;
    const size_t bound = ZSTD_compressBound(raw_len);
    uint8_t *file = malloc(head_and_ids + bound + 8);
    if (!file) {
        free(raw);
        return ds41_fail(err, "%s: out of memory", path);
    }
    const int level = opts && opts->zstd_level ? opts->zstd_level : 3;
    /* zstd's own content checksum too: a second line of defence behind file_check */
    size_t z;
    ZSTD_CCtx *cctx = ZSTD_createCCtx();
    if (!cctx) {
        z = (size_t)-1;
    } else {
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, level);
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1);
        z = ZSTD_compress2(cctx, file + head_and_ids, bound, src, raw_len);
        ZSTD_freeCCtx(cctx);
    }
    free(raw);
    if (ZSTD_isError(z)) {
        free(file);
        return ds41_fail(err, "%s: zstd: %s", path, ZSTD_getErrorName(z));
    }
    memcpy(file, SNAP_MAGIC, 8);
    put32(file + 8, DS41_SNAPSHOT_VERSION);
    put32(file + 12, sampler_len ? DS41_SNAPSHOT_FLAG_SAMPLER : 0);
    memcpy(file + 16, model_id, DS41_SNAPSHOT_ID_BYTES);
    put64(file + 48, n_ids);
    put64(file + 56, kv_len);
    put64(file + 64, sampler_len);
    put64(file + 72, z);
    put64(file + 80, (uint64_t)(int64_t)time(NULL));
    memcpy(file + 88, owner->key, DS41_SNAPSHOT_KEY_BYTES);
    put64(file + 120, (uint64_t)owner->uid);
    for (size_t i = 0; i < n_ids; i++) put32(file + DS41_SNAPSHOT_HEAD_BYTES + 4 * i, (uint32_t)ids[i]);
    uint64_t hc = ds41_crc64(0, file, HEAD_CHECK_AT);
    hc = ds41_crc64(hc, file + DS41_SNAPSHOT_HEAD_BYTES, 4 * n_ids);
    put64(file + HEAD_CHECK_AT, hc);
    const size_t total = head_and_ids + z + 8;
    put64(file + total - 8, ds41_crc64(0, file, total - 8));

    /* temporary file beside the target */
    char dir[PATH_MAX], tmp[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    const char *base = slash ? slash + 1 : path;
    if (slash)
        *slash = 0;
    else
        snprintf(dir, sizeof dir, ".");
    if (snprintf(tmp, sizeof tmp, "%s/.tmp-%s-%ld-%u", dir, base, (long)getpid(),
                 atomic_fetch_add(&temp_counter, 1)) >= (int)sizeof tmp) {
        free(file);
        return ds41_fail(err, "%s: path too long", path);
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0640);
    if (fd < 0) {
        int e = errno;
        free(file);
        return ds41_fail(err, "%s: cannot create a temporary file: %s", path, strerror(e));
    }
    const char *what = "write";
    int rc = 0;
    size_t half = total / 2;
    if (write_all(fd, file, half) != 0) rc = -1;
    if (rc == 0 && opts && opts->test_delay_ms) {
        struct timespec ts = {.tv_sec = opts->test_delay_ms / 1000,
                              .tv_nsec = (long)(opts->test_delay_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
    if (rc == 0 && write_all(fd, file + half, total - half) != 0) rc = -1;
    if (rc == 0 && fsync(fd) != 0) rc = -1, what = "fsync";
    int e = errno;
    free(file);
    if (close(fd) != 0 && rc == 0) rc = -1, e = errno, what = "close";
    if (rc == 0 && rename(tmp, path) != 0) rc = -1, e = errno, what = "rename";
    if (rc != 0) {
        unlink(tmp);
        return ds41_fail(err, "%s: %s failed: %s", path, what, strerror(e));
    }
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    if (file_bytes) *file_bytes = total;
    return 0;
}

/* ---- reading --------------------------------------------------------------------------------- */

/* Check the fixed head (magic, version, flags, identity, lengths) against the file length. */
static int parse_head(const uint8_t *h, uint64_t file_len, const char *label,
                      const uint8_t model_id[DS41_SNAPSHOT_ID_BYTES], ds41_snapshot *out,
                      uint64_t *payload_len, ds41_error *err) {
    /* magic and version first (12 bytes): an older format's head is shorter */
    if (file_len < 12)
        return ds41_fail(err, "%s: truncated (%llu bytes, the head alone is %d)", label,
                         (unsigned long long)file_len, DS41_SNAPSHOT_HEAD_BYTES);
    if (memcmp(h, SNAP_MAGIC, 8) != 0) return ds41_fail(err, "%s: not a ds41 snapshot (bad magic)", label);
    out->version = get32(h + 8);
    if (out->version == 1)
        return ds41_fail(err,
                         "%s: format version 1 has no cache partition (written before issue 13: its owner is "
                         "unknown), this build reads %u",
                         label, DS41_SNAPSHOT_VERSION);
    if (out->version != DS41_SNAPSHOT_VERSION)
        return ds41_fail(err, "%s: format version %u, this build reads %u", label, out->version,
                         DS41_SNAPSHOT_VERSION);
    if (file_len < DS41_SNAPSHOT_HEAD_BYTES)
        return ds41_fail(err, "%s: truncated (%llu bytes, the head alone is %d)", label,
                         (unsigned long long)file_len, DS41_SNAPSHOT_HEAD_BYTES);
    out->flags = get32(h + 12);
    if (out->flags & ~DS41_SNAPSHOT_FLAG_SAMPLER)
        return ds41_fail(err, "%s: unknown flags 0x%x", label, out->flags);
    memcpy(out->model_id, h + 16, DS41_SNAPSHOT_ID_BYTES);
    const uint64_t n_ids = get64(h + 48), kv_len = get64(h + 56), sampler_len = get64(h + 64);
    *payload_len = get64(h + 72);
    out->created = (int64_t)get64(h + 80);
    memcpy(out->owner.key, h + 88, DS41_SNAPSHOT_KEY_BYTES);
    out->owner.uid = (int64_t)get64(h + 120);
    if (out->owner.uid < -1 || out->owner.uid > UINT32_MAX)
        return ds41_fail(err, "%s: owner uid %lld out of range", label, (long long)out->owner.uid);
    if (n_ids == 0 || n_ids > DS41_SNAPSHOT_MAX_IDS)
        return ds41_fail(err, "%s: %llu token ids (1..%u)", label, (unsigned long long)n_ids,
                         DS41_SNAPSHOT_MAX_IDS);
    if (kv_len == 0 || kv_len > (1ull << 48))
        return ds41_fail(err, "%s: KV state of %llu bytes", label, (unsigned long long)kv_len);
    if (sampler_len > (1ull << 32) || (sampler_len != 0) != ((out->flags & DS41_SNAPSHOT_FLAG_SAMPLER) != 0))
        return ds41_fail(err, "%s: sampler state of %llu bytes with flags 0x%x", label,
                         (unsigned long long)sampler_len, out->flags);
    if (*payload_len == 0 || *payload_len > (1ull << 48))
        return ds41_fail(err, "%s: payload of %llu bytes", label, (unsigned long long)*payload_len);
    const uint64_t want = DS41_SNAPSHOT_HEAD_BYTES + 4 * n_ids + *payload_len + 8;
    if (file_len < want)
        return ds41_fail(err, "%s: truncated (%llu bytes, the head describes %llu)", label,
                         (unsigned long long)file_len, (unsigned long long)want);
    if (file_len > want)
        return ds41_fail(err, "%s: %llu bytes, the head describes %llu (trailing data)", label,
                         (unsigned long long)file_len, (unsigned long long)want);
    if (model_id && memcmp(model_id, out->model_id, DS41_SNAPSHOT_ID_BYTES) != 0)
        return ds41_fail(err, "%s: made for another model (identity differs)", label);
    out->n_ids = (size_t)n_ids;
    out->kv_len = (size_t)kv_len;
    out->sampler_len = (size_t)sampler_len;
    out->file_bytes = file_len;
    return 0;
}

/* head_check, then the ids (each must fit an int32). */
static int parse_ids(const uint8_t *buf, const char *label, ds41_snapshot *out, ds41_error *err) {
    uint64_t hc = ds41_crc64(0, buf, HEAD_CHECK_AT);
    hc = ds41_crc64(hc, buf + DS41_SNAPSHOT_HEAD_BYTES, 4 * out->n_ids);
    if (hc != get64(buf + HEAD_CHECK_AT))
        return ds41_fail(err, "%s: head checksum mismatch (file corrupted)", label);
    out->ids = malloc(out->n_ids * sizeof *out->ids);
    if (!out->ids) return ds41_fail(err, "%s: out of memory", label);
    for (size_t i = 0; i < out->n_ids; i++) {
        uint32_t v = get32(buf + DS41_SNAPSHOT_HEAD_BYTES + 4 * i);
        if (v > INT32_MAX) return ds41_fail(err, "%s: token id %u at %zu out of range", label, v, i);
        out->ids[i] = (int32_t)v;
    }
    return 0;
}

int ds41_snapshot_parse(const uint8_t *buf, size_t len, const char *label,
                        const uint8_t model_id[DS41_SNAPSHOT_ID_BYTES], uint64_t max_raw, ds41_snapshot *out,
                        ds41_error *err) {
    memset(out, 0, sizeof *out);
    uint64_t payload_len = 0;
    if (!buf) return ds41_fail(err, "%s: no data", label);
    if (parse_head(buf, len, label, model_id, out, &payload_len, err) != 0) goto fail;
    if (get64(buf + len - 8) != ds41_crc64(0, buf, len - 8)) {
        ds41_fail(err, "%s: checksum mismatch (file corrupted)", label);
        goto fail;
    }
    if (parse_ids(buf, label, out, err) != 0) goto fail;
    const uint64_t raw_len = (uint64_t)out->kv_len + out->sampler_len;
    if (raw_len > max_raw) {
        ds41_fail(err, "%s: state of %llu bytes exceeds the %llu this model's snapshot can have", label,
                  (unsigned long long)raw_len, (unsigned long long)max_raw);
        goto fail;
    }
    const uint8_t *payload = buf + DS41_SNAPSHOT_HEAD_BYTES + 4 * out->n_ids;
    unsigned long long content = ZSTD_getFrameContentSize(payload, (size_t)payload_len);
    if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN || content != raw_len) {
        ds41_fail(err, "%s: the compressed payload does not declare %llu bytes", label,
                  (unsigned long long)raw_len);
        goto fail;
    }
    size_t frame = ZSTD_findFrameCompressedSize(payload, (size_t)payload_len);
    if (ZSTD_isError(frame) || frame != payload_len) {
        ds41_fail(err, "%s: the payload is not exactly one zstd frame", label);
        goto fail;
    }
    uint8_t *raw = malloc(raw_len ? (size_t)raw_len : 1);
    if (!raw) {
        ds41_fail(err, "%s: out of memory (%llu bytes)", label, (unsigned long long)raw_len);
        goto fail;
    }
    size_t got = ZSTD_decompress(raw, (size_t)raw_len, payload, (size_t)payload_len);
    if (ZSTD_isError(got) || got != raw_len) {
        free(raw);
        ds41_fail(err, "%s: zstd: %s", label, ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short output");
        goto fail;
    }
    if (out->sampler_len) {
        out->sampler = malloc(out->sampler_len);
        if (!out->sampler) {
            free(raw);
            ds41_fail(err, "%s: out of memory", label);
            goto fail;
        }
        memcpy(out->sampler, raw + out->kv_len, out->sampler_len);
    }
    out->kv = raw;
    return 0;
fail:
    ds41_snapshot_free(out);
    return -1;
}

/* The whole file, at most max bytes. */
static int slurp(const char *path, uint64_t max, uint8_t **data, size_t *len, ds41_error *err) {
    *data = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ds41_fail(err, "%s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return ds41_fail(err, "%s: not a regular file", path);
    }
    if ((uint64_t)st.st_size > max) {
        close(fd);
        return ds41_fail(err, "%s: %lld bytes is more than a snapshot of this model can be", path,
                         (long long)st.st_size);
    }
    uint8_t *b = malloc(st.st_size ? (size_t)st.st_size : 1);
    if (!b) {
        close(fd);
        return ds41_fail(err, "%s: out of memory", path);
    }
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t n = read(fd, b + got, (size_t)st.st_size - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    *data = b;
    *len = got;
    return 0;
}

int ds41_snapshot_read(const char *path, const uint8_t model_id[DS41_SNAPSHOT_ID_BYTES], uint64_t max_raw,
                       ds41_snapshot *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    uint8_t *data;
    size_t len;
    const uint64_t max_file = DS41_SNAPSHOT_HEAD_BYTES + 4ull * DS41_SNAPSHOT_MAX_IDS + 8 +
                              (max_raw < (1ull << 48) ? ZSTD_compressBound((size_t)max_raw) : (1ull << 49));
    if (slurp(path, max_file, &data, &len, err) != 0) return -1;
    int rc = ds41_snapshot_parse(data, len, path, model_id, max_raw, out, err);
    free(data);
    return rc;
}

int ds41_snapshot_read_head(const char *path, const uint8_t model_id[DS41_SNAPSHOT_ID_BYTES],
                            ds41_snapshot *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ds41_fail(err, "%s: %s", path, strerror(errno));
    struct stat st;
    uint8_t head[DS41_SNAPSHOT_HEAD_BYTES];
    uint64_t payload_len;
    int rc = 0;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        rc = ds41_fail(err, "%s: not a regular file", path);
    else {
        /* a shorter read is fine when the file is shorter: parse_head names an older version or
         * the truncation, reading no byte past the file's length */
        ssize_t got = pread(fd, head, sizeof head, 0);
        uint64_t len = (uint64_t)st.st_size;
        if (got < 0 || (uint64_t)got < (len < sizeof head ? len : sizeof head))
            rc = ds41_fail(err, "%s: truncated (%lld bytes, the head alone is %d)", path,
                           (long long)st.st_size, DS41_SNAPSHOT_HEAD_BYTES);
        else
            rc = parse_head(head, len, path, model_id, out, &payload_len, err);
    }
    if (rc == 0) {
        size_t n = DS41_SNAPSHOT_HEAD_BYTES + 4 * out->n_ids;
        uint8_t *b = malloc(n);
        if (!b)
            rc = ds41_fail(err, "%s: out of memory", path);
        else if (pread(fd, b, n, 0) != (ssize_t)n)
            rc = ds41_fail(err, "%s: truncated ids", path);
        else
            rc = parse_ids(b, path, out, err);
        free(b);
    }
    close(fd);
    if (rc != 0) ds41_snapshot_free(out);
    return rc;
}

int ds41_snapshot_clean_temp(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, ".tmp-", 5) != 0) continue;
        char p[PATH_MAX];
        if (snprintf(p, sizeof p, "%s/%s", dir, e->d_name) >= (int)sizeof p) continue;
        if (unlink(p) == 0) n++;
    }
    closedir(d);
    return n;
}
