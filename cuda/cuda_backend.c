/* The CUDA backend's host side (cuda/cuda_backend.h): device memory behind
 * be->mem, weight placement, the KV pool, the op context.  The op table is
 * given by the caller (cuda/cuda_backend_new.c picks the device or the
 * emulated one; tests wrap the reference).
 *
 * Streams: every op, every be->mem call and the metadata copies go on one
 * compute stream, so they are ordered among themselves without events;
 * placement copies go on a copy stream, overlapping the next staging read.
 *
 * be->mem's ordering (engine/backend/memory.h): upload returns when src may
 * be reused (queued, then the stream synced: the host's buffers are not
 * pinned), download when the bytes are there (synced), copy / copy_2d are
 * queued on the compute stream (ordered with the ops and later downloads),
 * free syncs first (queued work may still name the bytes, as cudaFree
 * waits for the device). */
#define _DEFAULT_SOURCE
#include "cuda/cuda_backend.h"
#include "cuda/cuda_backend_internal.h"
#include "cuda/cuda_ctx.h"
#include "cuda/placement.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define RING_SEGS 4
#define STAGE_BYTES ((size_t)8 << 20)
#define DIO_ALIGN 4096

typedef struct cuda_be cuda_be;

typedef struct tagged_mem {
    ds41_memory m;
    cuda_be *be;
    ds41_cuda_mem_kind kind;
} tagged_mem;

/* A ring of device bytes (and, for metadata, their pinned host twins) in
 * RING_SEGS segments; a segment is entered again only after the event
 * recorded on the compute stream when it was left has passed, i.e. the ops
 * that read its bytes (and the copies into them) have run. */
typedef struct ring_buf {
    unsigned char *dev, *host;
    size_t cap;
} ring_buf;

typedef struct ring {
    unsigned char *dev, *host; /* host: NULL for the scratch ring */
    size_t cap, seg, off;
    int cur;
    ds41_gpu_event *ev[RING_SEGS];
    bool recorded[RING_SEGS];
    /* Buffers a growth replaced: the op being queued may still name them
     * (it took bytes before the growth), so they go only once the ring has
     * gone round and synced a record made after the growth. */
    ring_buf old[8];
    int n_old, old_countdown;
} ring;

struct cuda_be {
    ds41_backend be;
    ds41_gpu *gpu;
    ds41_gpu_stream *compute, *copy;
    bool emulated, buffered;
    tagged_mem mem[DS41_CUDA_MEM_KINDS];
    pthread_mutex_t mu; /* counters, rings */
    uint64_t kind_bytes[DS41_CUDA_MEM_KINDS];
    uint64_t scratch_bytes, pinned_bytes;
    ds41_placement pl;
    bool placed;
    unsigned char *arena[DS41_ARENA_COUNT];
    uint64_t direct_bytes, mapped_bytes;
    ring meta, scr;
    ds41_cuda_ctx ctx;
};

static uint64_t round256(size_t n) {
    return ((uint64_t)n + 255) & ~(uint64_t)255;
}

static _Noreturn void fatal(const char *what, const ds41_error *err) {
    fprintf(stderr, "ds41: cuda backend: %s: %s\n", what, err ? err->msg : "");
    abort();
}

static void sync_compute(cuda_be *b) {
    ds41_error err = {0};
    if (b->gpu->stream_sync(b->gpu, b->compute, &err) != 0) fatal("compute stream", &err);
}

/* --------------------------------------------------------------- memory */

static cuda_be *mem_be(const ds41_memory *m) {
    return ((const tagged_mem *)m->ctx)->be;
}

static void *m_alloc(const ds41_memory *m, size_t n) {
    const tagged_mem *t = m->ctx;
    cuda_be *b = t->be;
    ds41_error err = {0};
    void *p = n ? b->gpu->dev_alloc(b->gpu, n, &err) : NULL;
    if (p) {
        pthread_mutex_lock(&b->mu);
        b->kind_bytes[t->kind] += round256(n);
        pthread_mutex_unlock(&b->mu);
    }
    return p;
}

static void m_free(const ds41_memory *m, void *p, size_t n) {
    if (!p) return;
    const tagged_mem *t = m->ctx;
    cuda_be *b = t->be;
    sync_compute(b);
    b->gpu->dev_free(b->gpu, p, n);
    pthread_mutex_lock(&b->mu);
    b->kind_bytes[t->kind] -= round256(n);
    pthread_mutex_unlock(&b->mu);
}

/* Page-locked host memory for the storage tiers (the expert cache's host
 * slots, the Engram row cache; engine/backend/memory.h host_alloc): the
 * device copies from it without a staging bounce. */
static void *m_host_alloc(const ds41_memory *m, size_t n) {
    cuda_be *b = mem_be(m);
    ds41_error err = {0};
    void *p = n ? b->gpu->host_alloc(b->gpu, n, &err) : NULL;
    if (p) {
        pthread_mutex_lock(&b->mu);
        b->pinned_bytes += n;
        pthread_mutex_unlock(&b->mu);
    }
    return p;
}

static void m_host_free(const ds41_memory *m, void *p, size_t n) {
    if (!p) return;
    cuda_be *b = mem_be(m);
    sync_compute(b); /* an upload from p may still be queued */
    b->gpu->host_free(b->gpu, p, n);
    pthread_mutex_lock(&b->mu);
    b->pinned_bytes -= n;
    pthread_mutex_unlock(&b->mu);
}

static void m_upload(const ds41_memory *m, void *dst, const void *src, size_t n) {
    cuda_be *b = mem_be(m);
    if (!n) return;
    b->gpu->h2d(b->gpu, b->compute, dst, src, n);
    sync_compute(b); /* src is the caller's (unpinned) buffer: reusable on return */
}

static void m_download(const ds41_memory *m, void *dst, const void *src, size_t n) {
    cuda_be *b = mem_be(m);
    if (!n) return;
    b->gpu->d2h(b->gpu, b->compute, dst, src, n);
    sync_compute(b);
}

static void m_copy(const ds41_memory *m, void *dst, const void *src, size_t n) {
    cuda_be *b = mem_be(m);
    if (n) b->gpu->d2d(b->gpu, b->compute, dst, src, n);
}

static void m_copy_2d(const ds41_memory *m, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                      size_t width, size_t rows) {
    cuda_be *b = mem_be(m);
    if (width && rows) b->gpu->d2d_2d(b->gpu, b->compute, dst, dst_pitch, src, src_pitch, width, rows);
}

static const char *const mem_names[DS41_CUDA_MEM_KINDS] = {"cuda", "cuda-pool", "cuda-experts",
                                                           "cuda-scratch"};

/* ----------------------------------------------------------------- rings */

static void ring_free_buffers(cuda_be *b, unsigned char *dev, unsigned char *host, size_t cap) {
    if (dev) {
        b->gpu->dev_free(b->gpu, dev, cap);
        b->scratch_bytes -= round256(cap);
    }
    if (host) {
        b->gpu->host_free(b->gpu, host, cap);
        b->pinned_bytes -= cap;
    }
}

static void ring_free_old(cuda_be *b, ring *r) {
    for (int i = 0; i < r->n_old; i++) ring_free_buffers(b, r->old[i].dev, r->old[i].host, r->old[i].cap);
    r->n_old = 0;
}

/* Everything the ring holds (the compute stream has run what used it). */
static void ring_release(cuda_be *b, ring *r) {
    ring_free_old(b, r);
    ring_free_buffers(b, r->dev, r->host, r->cap);
    r->dev = r->host = NULL;
    r->cap = r->seg = r->off = 0;
}

/* Resize r to segments of at least n bytes.  The old buffers are retired,
 * not freed: the op being queued may hold bytes of them. */
static void ring_grow(cuda_be *b, ring *r, size_t n, bool with_host) {
    if (r->n_old == (int)(sizeof r->old / sizeof r->old[0])) {
        sync_compute(b);
        ring_free_old(b, r);
    }
    if (r->dev) r->old[r->n_old++] = (ring_buf){r->dev, r->host, r->cap};
    r->dev = r->host = NULL;
    size_t seg = 64 << 10;
    while (seg < n) seg *= 2;
    ds41_error err = {0};
    r->cap = seg * RING_SEGS;
    r->seg = seg;
    if (!(r->dev = b->gpu->dev_alloc(b->gpu, r->cap, &err))) fatal("op scratch / metadata ring", &err);
    b->scratch_bytes += round256(r->cap);
    if (with_host) {
        if (!(r->host = b->gpu->host_alloc(b->gpu, r->cap, &err))) fatal("pinned metadata ring", &err);
        b->pinned_bytes += r->cap;
    }
    r->cur = 0;
    r->off = 0;
    r->old_countdown = r->n_old ? RING_SEGS : 0;
    for (int i = 0; i < RING_SEGS; i++) r->recorded[i] = false;
}

/* n bytes (256-aligned) of the ring for the op being queued: their offset. */
static size_t ring_take(cuda_be *b, ring *r, size_t n, bool with_host) {
    n = (size_t)round256(n);
    if (n > r->seg) ring_grow(b, r, n, with_host);
    if (r->off + n > (size_t)(r->cur + 1) * r->seg) {
        /* Leave the segment: what was queued so far on the compute stream
         * (the copies into it and the ops reading them) is behind this
         * record.  Enter the next one once its last record has passed. */
        b->gpu->event_record(b->gpu, r->ev[r->cur], b->compute);
        r->recorded[r->cur] = true;
        r->cur = (r->cur + 1) % RING_SEGS;
        r->off = (size_t)r->cur * r->seg;
        if (r->recorded[r->cur]) b->gpu->event_sync(b->gpu, r->ev[r->cur]);
        /* Round once since a growth: that record was made after it. */
        if (r->old_countdown && --r->old_countdown == 0) ring_free_old(b, r);
    }
    const size_t off = r->off;
    r->off += n;
    return off;
}

/* ------------------------------------------------------------------ ctx */

static const void *ctx_weight(ds41_cuda_ctx *c, const void *p, size_t n) {
    cuda_be *b = c->impl;
    const ds41_place_entry *e = NULL;
    uint64_t off = 0;
    switch (ds41_placement_find(&b->pl, p, n, &e, &off)) {
    case DS41_PLACE_NOT_A_WEIGHT:
        return p; /* an expert slot view or backend memory: device already */
    case DS41_PLACE_FOUND:
        return b->arena[e->arena] + off;
    case DS41_PLACE_PAST_END:
        fprintf(stderr,
                "ds41: cuda backend: an op reads %zu bytes at %p, past the end of layer %d %s (%llu bytes)\n",
                n, p, e->layer, e->what, (unsigned long long)e->bytes);
        abort();
    case DS41_PLACE_UNPLACED:
        fprintf(stderr,
                "ds41: cuda backend: an op reads layer %d %s from the host mapping, but it was left to its "
                "streaming tier (not placed)\n",
                e->layer, e->what);
        abort();
    }
    return p;
}

static void *ctx_meta(ds41_cuda_ctx *c, const void *host, size_t n) {
    cuda_be *b = c->impl;
    pthread_mutex_lock(&b->mu);
    const size_t off = ring_take(b, &b->meta, n, true);
    memcpy(b->meta.host + off, host, n);
    b->gpu->h2d(b->gpu, b->compute, b->meta.dev + off, b->meta.host + off, n);
    pthread_mutex_unlock(&b->mu);
    /* An emulated op computes at call time: the stream reaches it now. */
    if (b->emulated) sync_compute(b);
    return b->meta.dev + off;
}

static void *ctx_scratch(ds41_cuda_ctx *c, size_t n) {
    cuda_be *b = c->impl;
    pthread_mutex_lock(&b->mu);
    const size_t off = ring_take(b, &b->scr, n, false);
    pthread_mutex_unlock(&b->mu);
    return b->scr.dev + off;
}

/* ------------------------------------------------------------ placement */

/* The file a mapped address comes from (/proc/self/maps), to read it with
 * O_DIRECT: path and the file offset of p; 0 or -1 (anonymous memory: a
 * copy the binder made). */
typedef struct map_line {
    uintptr_t lo, hi;
    uint64_t off;
    char path[512];
} map_line;

typedef struct maps {
    map_line *v;
    size_t n;
} maps;

static void maps_load(maps *mp) {
    mp->v = NULL;
    mp->n = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return;
    char line[1024];
    size_t cap = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        unsigned long long off;
        char perms[8];
        int pos = 0;
        if (sscanf(line, "%lx-%lx %7s %llx %*s %*s%n", &lo, &hi, perms, &off, &pos) < 4) continue;
        const char *path = line + pos;
        while (*path == ' ') path++;
        if (*path != '/') continue;
        if (mp->n == cap) {
            cap = cap ? 2 * cap : 64;
            map_line *nv = realloc(mp->v, cap * sizeof *nv);
            if (!nv) break;
            mp->v = nv;
        }
        map_line *m = &mp->v[mp->n++];
        m->lo = lo, m->hi = hi, m->off = off;
        snprintf(m->path, sizeof m->path, "%s", path);
        m->path[strcspn(m->path, "\n")] = 0;
    }
    fclose(f);
}

static const map_line *maps_find(const maps *mp, const void *p, uint64_t n) {
    for (size_t i = 0; i < mp->n; i++)
        if ((uintptr_t)p >= mp->v[i].lo && (uintptr_t)p + n <= mp->v[i].hi) return &mp->v[i];
    return NULL;
}

/* One O_DIRECT descriptor per shard path (-1: O_DIRECT not possible there). */
typedef struct dio_file {
    char path[512];
    int fd;
} dio_file;

typedef struct placer {
    cuda_be *b;
    maps mp;
    dio_file *files;
    size_t n_files;
    unsigned char *stage[2];
    ds41_gpu_event *ev[2];
    bool busy[2];
    int cur;
} placer;

static int dio_fd(placer *pc, const char *path) {
    for (size_t i = 0; i < pc->n_files; i++)
        if (strcmp(pc->files[i].path, path) == 0) return pc->files[i].fd;
    dio_file *nf = realloc(pc->files, (pc->n_files + 1) * sizeof *nf);
    if (!nf) return -1;
    pc->files = nf;
    dio_file *f = &nf[pc->n_files++];
    snprintf(f->path, sizeof f->path, "%s", path);
    f->fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    return f->fd;
}

/* The next staging buffer, once the copy that last read it has run. */
static unsigned char *next_stage(placer *pc) {
    pc->cur ^= 1;
    if (pc->busy[pc->cur]) pc->b->gpu->event_sync(pc->b->gpu, pc->ev[pc->cur]);
    return pc->stage[pc->cur];
}

static void send_stage(placer *pc, void *dst, const unsigned char *src, size_t n) {
    cuda_be *b = pc->b;
    b->gpu->h2d(b->gpu, b->copy, dst, src, n);
    b->gpu->event_record(b->gpu, pc->ev[pc->cur], b->copy);
    pc->busy[pc->cur] = true;
}

/* Copy one tensor's bytes to dst: O_DIRECT reads of the aligned file range
 * around it when its mapping names a file that takes them, else the
 * mapping's (or the binder's copy's) bytes. */
static void place_one(placer *pc, const ds41_place_entry *e, unsigned char *dst) {
    cuda_be *b = pc->b;
    const map_line *ml = maps_find(&pc->mp, e->host, e->bytes);
    int fd = ml && !b->buffered ? dio_fd(pc, ml->path) : -1;
    const uint64_t file_off = ml ? ml->off + ((uintptr_t)e->host - ml->lo) : 0;
    uint64_t done = 0;
    while (done < e->bytes) {
        unsigned char *st = next_stage(pc);
        if (fd >= 0) {
            const uint64_t at = file_off + done, a0 = at / DIO_ALIGN * DIO_ALIGN, lead = at - a0;
            uint64_t take = e->bytes - done;
            if (take > STAGE_BYTES - lead) take = STAGE_BYTES - lead;
            const size_t span = (size_t)((lead + take + DIO_ALIGN - 1) / DIO_ALIGN * DIO_ALIGN);
            size_t got = 0;
            while (got < span) {
                const ssize_t r = pread(fd, st + got, span - got, (off_t)(a0 + got));
                if (r <= 0) break;
                got += (size_t)r;
            }
            if (got >= lead + take) {
                send_stage(pc, dst + done, st + lead, (size_t)take);
                b->direct_bytes += take;
                done += take;
                continue;
            }
            fd = -1; /* a short read or EINVAL: the mapping from here on */
        }
        uint64_t take = e->bytes - done;
        if (take > STAGE_BYTES) take = STAGE_BYTES;
        memcpy(st, (const unsigned char *)e->host + done, (size_t)take);
        send_stage(pc, dst + done, st, (size_t)take);
        b->mapped_bytes += take;
        done += take;
    }
}

static void release_arenas(cuda_be *b) {
    sync_compute(b);
    for (int a = 0; a < DS41_ARENA_COUNT; a++)
        if (b->arena[a]) b->gpu->dev_free(b->gpu, b->arena[a], b->pl.arena_bytes[a]);
    memset(b->arena, 0, sizeof b->arena);
    ds41_placement_free(&b->pl);
    b->placed = false;
}

static int cuda_place(ds41_backend *be, const ds41_model_config *cfg, ds41_weights *w, ds41_error *err) {
    cuda_be *b = be->impl;
    if (b->placed) release_arenas(b);
    /* What the engine streams (ds41_weights.experts_streamed / engram_streamed)
     * stays out of device memory; an op handed one of those tensors from the
     * mapping is a bug weight() reports. */
    const ds41_placement_opts po = {.experts = !w->experts_streamed, .engram_tables = !w->engram_streamed};
    if (ds41_placement_plan(&b->pl, cfg, w, &po, err) != 0) return -1;
    for (int a = 0; a < DS41_ARENA_COUNT; a++)
        if (b->pl.arena_bytes[a] && !(b->arena[a] = b->gpu->dev_alloc(b->gpu, b->pl.arena_bytes[a], err))) {
            ds41_error_prefix(err, "placing %llu bytes of %s weights",
                              (unsigned long long)b->pl.arena_bytes[a], ds41_arena_name((ds41_arena)a));
            release_arenas(b);
            return -1;
        }
    placer pc = {.b = b};
    maps_load(&pc.mp);
    int rc = 0;
    for (int i = 0; i < 2 && rc == 0; i++) {
        if (!(pc.stage[i] = b->gpu->host_alloc(b->gpu, STAGE_BYTES, err)) ||
            !(pc.ev[i] = b->gpu->event_new(b->gpu, err)))
            rc = -1;
        else
            b->pinned_bytes += STAGE_BYTES;
    }
    b->direct_bytes = b->mapped_bytes = 0;
    for (size_t i = 0; i < b->pl.n && rc == 0; i++) {
        const ds41_place_entry *e = &b->pl.e[i];
        if (e->placed) place_one(&pc, e, b->arena[e->arena] + e->offset);
    }
    if (rc == 0) rc = b->gpu->stream_sync(b->gpu, b->copy, err);
    for (int i = 0; i < 2; i++) {
        if (pc.stage[i]) {
            b->gpu->host_free(b->gpu, pc.stage[i], STAGE_BYTES);
            b->pinned_bytes -= STAGE_BYTES;
        }
        if (pc.ev[i]) b->gpu->event_free(b->gpu, pc.ev[i]);
    }
    for (size_t i = 0; i < pc.n_files; i++)
        if (pc.files[i].fd >= 0) close(pc.files[i].fd);
    free(pc.files);
    free(pc.mp.v);
    if (rc != 0) {
        release_arenas(b);
        return -1;
    }
    b->placed = true;
    return 0;
}

static void cuda_release(ds41_backend *be, ds41_weights *w) {
    (void)w;
    release_arenas(be->impl);
}

/* ------------------------------------------------------------- the rest */

static ds41_kv_pool *cuda_new_pool(ds41_backend *be, const ds41_model_config *cfg, uint64_t budget_bytes,
                                   uint32_t entries_per_page, ds41_error *err) {
    cuda_be *b = be->impl;
    return ds41_kv_pool_new_in(&b->mem[DS41_CUDA_MEM_POOL].m, cfg, budget_bytes, entries_per_page, err);
}

static void cuda_stats(ds41_backend *be, ds41_backend_stats *out, bool reset) {
    cuda_be *b = be->impl;
    *out = b->ctx.stats;
    if (reset) memset(&b->ctx.stats, 0, sizeof b->ctx.stats);
}

static void cuda_destroy(ds41_backend *be) {
    cuda_be *b = be->impl;
    if (b->gpu) {
        if (b->compute) sync_compute(b);
        if (b->placed) release_arenas(b);
        ring_release(b, &b->meta);
        ring_release(b, &b->scr);
        for (int i = 0; i < RING_SEGS; i++) {
            if (b->meta.ev[i]) b->gpu->event_free(b->gpu, b->meta.ev[i]);
            if (b->scr.ev[i]) b->gpu->event_free(b->gpu, b->scr.ev[i]);
        }
        if (b->copy) b->gpu->stream_free(b->gpu, b->copy);
        if (b->compute) b->gpu->stream_free(b->gpu, b->compute);
        ds41_gpu_free(b->gpu);
    }
    pthread_mutex_destroy(&b->mu);
    free(b);
}

ds41_backend *ds41_backend_cuda_new_with_ops(const ds41_cuda_opts *opts, const ds41_ops *ops,
                                             ds41_error *err) {
    if (!opts || !opts->gpu) {
        ds41_fail(err, "cuda backend: no device given");
        return NULL;
    }
    cuda_be *b = calloc(1, sizeof *b);
    if (!b) {
        ds41_gpu_free(opts->gpu);
        ds41_fail(err, "cuda backend: out of memory");
        return NULL;
    }
    pthread_mutex_init(&b->mu, NULL);
    b->gpu = opts->gpu;
    b->emulated = opts->emulated;
    for (int k = 0; k < DS41_CUDA_MEM_KINDS; k++)
        b->mem[k] = (tagged_mem){.m = {.name = mem_names[k],
                                       .ctx = &b->mem[k],
                                       .alloc = m_alloc,
                                       .free = m_free,
                                       .upload = m_upload,
                                       .download = m_download,
                                       .copy = m_copy,
                                       .copy_2d = m_copy_2d,
                                       .host_alloc = m_host_alloc,
                                       .host_free = m_host_free},
                                 .be = b,
                                 .kind = (ds41_cuda_mem_kind)k};
    int ok = (b->compute = b->gpu->stream_new(b->gpu, err)) && (b->copy = b->gpu->stream_new(b->gpu, err));
    for (int i = 0; i < RING_SEGS && ok; i++)
        ok = (b->meta.ev[i] = b->gpu->event_new(b->gpu, err)) &&
             (b->scr.ev[i] = b->gpu->event_new(b->gpu, err));
    if (!ok) {
        b->be.impl = b;
        cuda_destroy(&b->be);
        return NULL;
    }
    b->ctx = (ds41_cuda_ctx){.gpu = b->gpu,
                             .compute = b->compute,
                             .stream = b->gpu->stream_native(b->gpu, b->compute),
                             .emulated = opts->emulated,
                             .weight = ctx_weight,
                             .meta = ctx_meta,
                             .scratch = ctx_scratch,
                             .impl = b};
    b->be = (ds41_backend){.name = opts->emulated ? "cuda-emu" : "cuda",
                           .ops = *ops,
                           .mem = &b->mem[DS41_CUDA_MEM_OTHER].m,
                           .scratch_mem = &b->mem[DS41_CUDA_MEM_SCRATCH].m,
                           .expert_mem = &b->mem[DS41_CUDA_MEM_EXPERTS].m,
                           .place_weights = cuda_place,
                           .release_weights = cuda_release,
                           .new_pool = cuda_new_pool,
                           .stats = cuda_stats,
                           .destroy = cuda_destroy,
                           .impl = b};
    b->be.ops.ctx = &b->ctx;
    return &b->be;
}

bool ds41_backend_is_cuda(const ds41_backend *be) {
    return be && be->destroy == cuda_destroy;
}

ds41_gpu *ds41_backend_cuda_gpu(const ds41_backend *be) {
    return ds41_backend_is_cuda(be) ? ((cuda_be *)be->impl)->gpu : NULL;
}

void ds41_backend_cuda_set_buffered(ds41_backend *be, bool buffered) {
    if (ds41_backend_is_cuda(be)) ((cuda_be *)be->impl)->buffered = buffered;
}

ds41_cuda_ctx *ds41_backend_cuda_ctx(const ds41_backend *be) {
    return ds41_backend_is_cuda(be) ? &((cuda_be *)be->impl)->ctx : NULL;
}

const ds41_memory *ds41_backend_cuda_memory(const ds41_backend *be, ds41_cuda_mem_kind kind) {
    if (!ds41_backend_is_cuda(be) || (unsigned)kind >= DS41_CUDA_MEM_KINDS) return NULL;
    return &((cuda_be *)be->impl)->mem[kind].m;
}

void ds41_backend_cuda_mem_stats(const ds41_backend *be, ds41_cuda_mem_stats *out) {
    memset(out, 0, sizeof *out);
    if (!ds41_backend_is_cuda(be)) return;
    cuda_be *b = be->impl;
    pthread_mutex_lock(&b->mu);
    for (int a = 0; a < DS41_ARENA_COUNT; a++)
        if (b->arena[a]) out->weight_bytes += round256(b->pl.arena_bytes[a]);
    out->pool_bytes = b->kind_bytes[DS41_CUDA_MEM_POOL];
    out->expert_bytes = b->kind_bytes[DS41_CUDA_MEM_EXPERTS];
    out->scratch_bytes = b->kind_bytes[DS41_CUDA_MEM_SCRATCH] + b->scratch_bytes;
    out->other_bytes = b->kind_bytes[DS41_CUDA_MEM_OTHER];
    out->pinned_host_bytes = b->pinned_bytes;
    out->placed_direct_bytes = b->direct_bytes;
    out->placed_mapped_bytes = b->mapped_bytes;
    pthread_mutex_unlock(&b->mu);
}
