/* engine/scheduler's snapshot hooks over the real forward pass of a generated tiny checkpoint: the
 * disk tier callbacks (a finished conversation goes to `evicted` when the scheduler stops; a
 * later scheduler restores it on a miss and the next turn is the same as without it, with the
 * restored tokens reported as cached), export of cache entries and running requests, import. */
#include "engine/forward/forward.h"
#include "engine/serve/generate.h"
#include "engine/model/model_gen.h"
#include "engine/serve/scheduler.h"
#include "engine/text/tokenizer.h"
#include "tap.h"
#include "tmpdir.h"

#include <ftw.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static ds41_engine *E;
static ds41_tokenizer *TOK;
static ds41_vocab *VOCAB;
static uint32_t NV;

typedef struct rec {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t tokens[512];
    size_t n_tokens;
    int n_done;
    ds41_sched_status status;
    size_t cached;
    int32_t all[1024]; /* prompt + generated at the end */
    size_t n_all;
} rec;

static void on_delta(void *ctx, const ds41_generation *g, const ds41_generation_delta *d) {
    (void)g;
    rec *r = ctx;
    pthread_mutex_lock(&r->mu);
    if (r->n_tokens < 512) r->tokens[r->n_tokens++] = (int32_t)d->token;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static void on_done(void *ctx, const ds41_generation *g, ds41_sched_status status, const char *message) {
    (void)message;
    rec *r = ctx;
    pthread_mutex_lock(&r->mu);
    r->n_done++;
    r->status = status;
    r->cached = ds41_generation_cached_tokens(g);
    size_t n;
    const int32_t *t = ds41_generation_tokens(g, &n);
    r->n_all = n < 1024 ? n : 1024;
    memcpy(r->all, t, r->n_all * sizeof *t);
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static void rec_init(rec *r) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
}

static bool wait_for(rec *r, size_t deltas, int seconds) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += seconds;
    pthread_mutex_lock(&r->mu);
    while ((deltas ? r->n_tokens < deltas : true) && r->n_done == 0)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &t) != 0) break;
    bool ok = deltas ? r->n_tokens >= deltas : r->n_done > 0;
    pthread_mutex_unlock(&r->mu);
    return ok;
}

static int submit_in(ds41_scheduler *s, const ds41_sched_partition *part, const int32_t *ids, size_t n,
                     uint32_t max_tokens, rec *r, uint64_t *id) {
    ds41_generation_params p = ds41_generation_params_default();
    p.kind = DS41_GENERATION_IDS;
    uint32_t u[1024];
    for (size_t i = 0; i < n; i++) u[i] = (uint32_t)ids[i];
    p.ids = u;
    p.n_ids = n;
    p.sampler.temperature = 0; /* greedy */
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    ds41_generation *g = NULL;
    ds41_error err;
    if (ds41_generation_new(TOK, &p, NV, &g, &err) != 0) return -1;
    ds41_sched_sink sink = {.delta = on_delta, .done = on_done, .ctx = r};
    return (part ? ds41_scheduler_submit_in(s, part, g, &sink, id, &err)
                 : ds41_scheduler_submit(s, g, &sink, id, &err)) == DS41_SCHED_DONE
               ? 0
               : -1;
}

static int submit(ds41_scheduler *s, const int32_t *ids, size_t n, uint32_t max_tokens, rec *r,
                  uint64_t *id) {
    return submit_in(s, NULL, ids, n, max_tokens, r, id);
}

/* ---- a disk tier in memory -------------------------------------------------------------------- */

typedef struct mem_disk {
    uint8_t *kv;
    size_t kv_len;
    int32_t ids[1024];
    size_t n_ids;
    ds41_sched_partition part;         /* of the stored entry: a restore matches it, as the real store does */
    ds41_sched_partition restore_part; /* what the last restore asked for */
    int evicted_calls, restore_calls;
} mem_disk;

static void disk_evicted(void *ctx, const ds41_kv_seq *seq, const ds41_sched_partition *part,
                         const int32_t *ids, size_t n) {
    mem_disk *d = ctx;
    d->evicted_calls++;
    d->part = *part;
    free(d->kv);
    d->kv_len = ds41_kv_seq_serialized_size(seq);
    d->kv = malloc(d->kv_len);
    ds41_error err;
    size_t w;
    ds41_kv_seq_serialize(seq, d->kv, d->kv_len, &w, &err);
    d->n_ids = n < 1024 ? n : 1024;
    memcpy(d->ids, ids, d->n_ids * sizeof *ids);
}

static ds41_kv_seq *disk_restore(void *ctx, ds41_kv_pool *pool, const ds41_sched_partition *part,
                                 const int32_t *ids, size_t n, size_t *n_cached) {
    mem_disk *d = ctx;
    d->restore_calls++;
    d->restore_part = *part;
    *n_cached = 0;
    if (!d->kv || d->n_ids >= n || memcmp(d->ids, ids, d->n_ids * sizeof *ids) != 0 ||
        memcmp(d->part.key, part->key, sizeof part->key) != 0)
        return NULL;
    ds41_kv_seq *seq = NULL;
    ds41_error err;
    if (ds41_kv_seq_deserialize(pool, d->kv, d->kv_len, &seq, &err) != 0) return NULL;
    *n_cached = d->n_ids;
    return seq;
}

static ds41_sched_config config(mem_disk *d) {
    ds41_sched_config c = {.max_sequences = 4,
                           .max_batch_tokens = 256,
                           .prefill_chunk = 64,
                           .max_queue = 16,
                           .prefix_cache = true};
    if (d) c.disk = (ds41_sched_disk){.restore = disk_restore, .evicted = disk_evicted, .ctx = d};
    return c;
}

static void test_disk_tier(void) {
    mem_disk d = {0};
    ds41_sched_config c = config(&d);
    ds41_scheduler *s = NULL;
    ds41_error err = {{0}};
    int32_t turn1[60];
    for (int i = 0; i < 60; i++) turn1[i] = 3 + (i * 37) % 700;
    rec r1;
    rec_init(&r1);
    if (!TAP_CHECK(ds41_scheduler_new(E, &c, &s, &err) == 0, "scheduler with a disk tier (%s)", err.msg))
        return;
    uint64_t id;
    submit(s, turn1, 60, 12, &r1, &id);
    wait_for(&r1, 0, 60);
    ds41_scheduler_free(s, 1000);
    TAP_CHECK(
        r1.n_done == 1 && r1.status == DS41_SCHED_DONE && d.evicted_calls == 2 && d.n_ids == 60 + 11,
        "stopping hands the cached prefixes to the disk tier (%d calls: the prompt less its last token, then "
        "the conversation of %zu ids: prompt + answer less the last token)",
        d.evicted_calls, d.n_ids);

    /* turn 2 = turn 1 + its answer + new user tokens, on a fresh scheduler with / without the disk */
    int32_t turn2[120];
    size_t n2 = 0;
    memcpy(turn2, r1.all, r1.n_all * sizeof *turn2);
    n2 = r1.n_all;
    for (int i = 0; i < 20; i++) turn2[n2++] = 5 + (i * 91) % 600;
    rec a, b;
    rec_init(&a);
    rec_init(&b);
    ds41_sched_config plain = config(NULL);
    if (ds41_scheduler_new(E, &plain, &s, &err) == 0) {
        submit(s, turn2, n2, 10, &a, &id);
        wait_for(&a, 0, 60);
        ds41_scheduler_free(s, 1000);
    }
    d.restore_calls = 0;
    const size_t stored = d.n_ids; /* freeing the next scheduler stores turn 2 */
    if (ds41_scheduler_new(E, &c, &s, &err) == 0) {
        submit(s, turn2, n2, 10, &b, &id);
        wait_for(&b, 0, 60);
        ds41_sched_stats st;
        ds41_scheduler_stats(s, &st);
        TAP_CHECK(st.disk_hits == 1 && st.disk_cached_tokens == stored,
                  "stats count the disk hit (%llu, %llu tokens)", (unsigned long long)st.disk_hits,
                  (unsigned long long)st.disk_cached_tokens);
        ds41_scheduler_free(s, 1000);
    }
    TAP_CHECK(a.n_done == 1 && b.n_done == 1 && a.cached == 0 && b.cached == stored && d.restore_calls == 1 &&
                  d.evicted_calls == 4,
              "a miss of the memory cache restores from the disk tier (cached_tokens %zu of %zu)", b.cached,
              n2);
    TAP_CHECK(a.n_tokens == 10 && b.n_tokens == 10 && memcmp(a.tokens, b.tokens, sizeof(int32_t) * 10) == 0,
              "the next turn after a restore gives the same tokens as a full prefill");
    free(d.kv);
}

/* Issue 13: the disk tier gets each entry's partition to record, and each restore the partition
 * of the request that missed: another user's stored conversation is not restored for it. */
static void test_disk_partitions(void) {
    ds41_sched_partition pa, pb;
    ds41_scheduler_partition_make(1000, false, NULL, 0, &pa);
    ds41_scheduler_partition_make(1001, false, NULL, 0, &pb);
    mem_disk d = {0};
    ds41_sched_config c = config(&d);
    ds41_scheduler *s = NULL;
    ds41_error err = {{0}};
    int32_t turn1[30];
    for (int i = 0; i < 30; i++) turn1[i] = 11 + (i * 41) % 650;
    rec r1;
    rec_init(&r1);
    uint64_t id;
    if (ds41_scheduler_new(E, &c, &s, &err) != 0) return;
    submit_in(s, &pa, turn1, 30, 4, &r1, &id);
    wait_for(&r1, 0, 60);
    ds41_scheduler_free(s, 1000);
    TAP_CHECK(d.evicted_calls == 2 && memcmp(d.part.key, pa.key, sizeof pa.key) == 0 &&
                  d.part.owner_uid == 1000,
              "the disk tier gets the partition of the entries it stores (owner %lld)",
              (long long)d.part.owner_uid);
    int32_t turn2[64];
    memcpy(turn2, d.ids, d.n_ids * sizeof *turn2);
    size_t n2 = d.n_ids;
    for (int i = 0; i < 6; i++) turn2[n2++] = 9 + i;
    const size_t stored = d.n_ids;
    d.restore_calls = 0;
    rec rb, ra;
    rec_init(&rb);
    rec_init(&ra);
    if (ds41_scheduler_new(E, &c, &s, &err) != 0) return;
    submit_in(s, &pb, turn2, n2, 3, &rb, &id);
    wait_for(&rb, 0, 60);
    bool asked_b = memcmp(d.restore_part.key, pb.key, sizeof pb.key) == 0;
    submit_in(s, &pa, turn2, n2, 3, &ra, &id);
    wait_for(&ra, 0, 60);
    bool asked_a = memcmp(d.restore_part.key, pa.key, sizeof pa.key) == 0;
    ds41_scheduler_free(s, 1000);
    TAP_CHECK(rb.n_done == 1 && rb.cached == 0 && asked_b,
              "another uid's miss asks the disk tier for its own partition and gets nothing (cached %zu)",
              rb.cached);
    TAP_CHECK(ra.n_done == 1 && ra.cached == stored && asked_a && d.restore_calls == 2,
              "the owner's miss is served from the disk tier (cached %zu of %zu; %d restores)", ra.cached, n2,
              d.restore_calls);
    free(d.kv);
}

static ds41_kv_seq *disk_restore_whole(void *ctx, ds41_kv_pool *pool, const ds41_sched_partition *part,
                                       const int32_t *ids, size_t n, size_t *n_cached) {
    mem_disk *d = ctx;
    d->restore_calls++;
    d->restore_part = *part;
    *n_cached = 0;
    if (!d->kv || d->n_ids > n || memcmp(d->ids, ids, d->n_ids * sizeof *ids) != 0) return NULL;
    ds41_kv_seq *seq = NULL;
    ds41_error err;
    if (ds41_kv_seq_deserialize(pool, d->kv, d->kv_len, &seq, &err) != 0) return NULL;
    *n_cached = d->n_ids;
    return seq;
}

static void test_disk_whole_prompt(void) {
    /* Store a conversation, then ask for exactly its ids: the restored sequence covers the
     * whole prompt and is refused; the request is prefilled in full (issue 19). */
    mem_disk d = {0};
    ds41_sched_config c = config(&d);
    ds41_scheduler *s = NULL;
    ds41_error err = {{0}};
    int32_t turn1[40];
    for (int i = 0; i < 40; i++) turn1[i] = 9 + (i * 53) % 600;
    rec r1, a, b;
    rec_init(&r1);
    rec_init(&a);
    rec_init(&b);
    uint64_t id;
    if (ds41_scheduler_new(E, &c, &s, &err) != 0) return;
    submit(s, turn1, 40, 6, &r1, &id);
    wait_for(&r1, 0, 60);
    ds41_scheduler_free(s, 1000);
    const size_t n = d.n_ids;
    int32_t whole[1024];
    memcpy(whole, d.ids, n * sizeof *whole);
    ds41_sched_config plain = config(NULL);
    if (ds41_scheduler_new(E, &plain, &s, &err) == 0) {
        submit(s, whole, n, 4, &a, &id);
        wait_for(&a, 0, 60);
        ds41_scheduler_free(s, 0);
    }
    c.disk.restore = disk_restore_whole;
    d.restore_calls = 0;
    ds41_sched_stats st = {0};
    if (ds41_scheduler_new(E, &c, &s, &err) == 0) {
        submit(s, whole, n, 4, &b, &id);
        wait_for(&b, 0, 60);
        ds41_scheduler_stats(s, &st);
        ds41_scheduler_free(s, 0);
    }
    TAP_CHECK(
        n > 0 && d.restore_calls == 1 && st.disk_hits == 0 && st.disk_cached_tokens == 0 && b.n_done == 1 &&
            b.status == DS41_SCHED_DONE && b.cached == 0 && b.n_tokens == 4 && a.n_tokens == 4 &&
            memcmp(a.tokens, b.tokens, 4 * sizeof *a.tokens) == 0,
        "a restored sequence covering the whole prompt (%zu ids) is not used: full prefill, the same tokens "
        "(%zu cached)",
        n, b.cached);
    free(d.kv);
}

static void test_export_import(void) {
    ds41_sched_config c = config(NULL);
    ds41_scheduler *s = NULL;
    ds41_error err = {{0}};
    if (ds41_scheduler_new(E, &c, &s, &err) != 0) return;
    int32_t p[40];
    for (int i = 0; i < 40; i++) p[i] = 7 + (i * 53) % 800;
    rec r;
    rec_init(&r);
    uint64_t id;
    submit(s, p, 40, 300, &r, &id); /* long enough to be caught running */
    wait_for(&r, 3, 60);
    char sid[32];
    snprintf(sid, sizeof sid, "r%llu", (unsigned long long)id);
    ds41_sched_export x;
    int rc = ds41_scheduler_export(s, sid, &x, &err);
    bool live_ok = rc == 0 && x.n_ids >= 40 && ds41_kv_seq_tokens(x.seq) == x.n_ids && x.sampler_len > 0 &&
                   memcmp(x.ids, p, sizeof p) == 0;
    TAP_CHECK(live_ok, "export of a running request: its sequence, ids and sampler state (%s, %zu ids)",
              rc ? err.msg : "ok", x.n_ids);
    size_t len = 0, w = 0;
    uint8_t *kv = NULL;
    if (rc == 0) {
        len = ds41_kv_seq_serialized_size(x.seq);
        kv = malloc(len);
        ds41_kv_seq_serialize(x.seq, kv, len, &w, &err);
    }
    ds41_scheduler_cancel(s, id);
    wait_for(&r, 0, 60);
    char cid[32] = "";
    int irc = rc == 0 ? ds41_scheduler_import(s, &x.part, kv, len, x.ids, x.n_ids, cid, &err) : -1;
    TAP_CHECK(irc == 0 && cid[0] == 'c', "import puts it into the prefix cache as %s (%s)", cid,
              irc ? err.msg : "ok");
    ds41_sched_export y;
    int erc = ds41_scheduler_export(s, cid, &y, &err);
    TAP_CHECK(erc == 0 && y.n_ids == x.n_ids && !y.sampler && ds41_kv_seq_tokens(y.seq) == y.n_ids &&
                  memcmp(y.part.key, x.part.key, sizeof x.part.key) == 0 &&
                  y.part.owner_uid == x.part.owner_uid,
              "export of a cache entry, with the partition it was imported into (%s)", erc ? err.msg : "ok");
    ds41_scheduler_export_free(&y);
    TAP_CHECK(irc != 0 || ds41_scheduler_import(s, &x.part, kv, len, x.ids, x.n_ids - 1, NULL, &err) == -1,
              "import refuses ids that do not match the state (%s)", err.msg);
    if (kv && len > 20) kv[20] ^= 1;
    TAP_CHECK(!kv || ds41_scheduler_import(s, &x.part, kv, len, x.ids, x.n_ids, NULL, &err) == -1,
              "import refuses a damaged state (%s)", err.msg);
    TAP_CHECK(ds41_scheduler_export(s, "r999999", &y, &err) == -1 && strstr(err.msg, "no session"),
              "export of an unknown session (%s)", err.msg);
    TAP_CHECK(ds41_scheduler_export(s, "x1", &y, &err) == -1, "export of a malformed id (%s)", err.msg);
    /* a request that uses the imported entry -- only in the partition it was imported into */
    if (irc == 0) {
        int32_t more[400];
        memcpy(more, x.ids, x.n_ids * sizeof *more);
        more[x.n_ids] = 9;
        ds41_sched_partition other;
        ds41_scheduler_partition_make(4242, false, NULL, 0, &other);
        rec o;
        rec_init(&o);
        submit_in(s, &other, more, x.n_ids + 1, 3, &o, &id);
        wait_for(&o, 0, 60);
        TAP_CHECK(o.n_done == 1 && o.cached == 0 && x.part.owner_uid == -1,
                  "an imported entry is not reused by another partition (%zu cached)", o.cached);
        rec q;
        rec_init(&q);
        submit(s, more, x.n_ids + 1, 3, &q, &id);
        wait_for(&q, 0, 60);
        TAP_CHECK(q.n_done == 1 && q.cached == x.n_ids,
                  "a prompt extending the imported ids is served from it (%zu cached)", q.cached);
    }
    free(kv);
    ds41_scheduler_export_free(&x);
    ds41_scheduler_free(s, 1000);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    char root[512];
    snprintf(root, sizeof root, "%s/ds41-schedsnap-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root)) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    char dir[600];
    snprintf(dir, sizeof dir, "%s/tiny", root);
    ds41_error err = {{0}};
    ds41_model_gen_opts mo = {.preset = "tiny", .seed = 5};
    ds41_engine_opts eo = {.cpu = {.threads = 2}};
    if (ds41_model_generate(dir, &mo, NULL, &err) == 0) E = ds41_engine_load(dir, &eo, &err);
    if (E) VOCAB = ds41_vocab_load_dir(dir, &err);
    if (VOCAB) TOK = ds41_tokenizer_new(VOCAB, &err);
    if (TAP_CHECK(TOK != NULL, "tiny checkpoint, engine, tokenizer (%s)", TOK ? "ok" : err.msg)) {
        NV = (uint32_t)ds41_engine_config(E)->vocab_size;
        test_disk_tier();
        test_disk_partitions();
        test_disk_whole_prompt();
        test_export_import();
    }
    ds41_tokenizer_free(TOK);
    ds41_vocab_free(VOCAB);
    ds41_engine_free(E);
    tmpdir_remove(root);
    return tap_done();
}
