/* Continuous batching over one engine (see scheduler.h). */
#include "engine/serve/scheduler.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "config/sha256.h"

const unsigned ds41_sched_hist_bounds[DS41_SCHED_HIST_BUCKETS - 1] = {1, 2, 4, 8, 16, 32, 64, 128, 256};

typedef enum req_phase { PH_QUEUED = 0, PH_PREFILL, PH_DECODE } req_phase;

typedef struct req {
    uint64_t id;
    ds41_generation *g;
    ds41_sched_sink sink;
    ds41_kv_seq *seq;
    ds41_sched_partition part; /* whose prefix-cache entries it may use and makes */
    req_phase phase;
    bool cancel;       /* asked (under mu) */
    bool snapshot_due; /* take a prefix-cache snapshot at prompt - 1 tokens */
    uint64_t admitted; /* admission order (preemption picks the latest) */
    int64_t created, last_used;
    /* published under mu for listings (the engine thread owns the live values) */
    uint64_t pub_kv_tokens, pub_kv_pages, pub_kv_bytes, pub_generated;
    bool failed; /* sampling failed in this step (engine thread) */
    ds41_spec_seq ss; /* speculative decoding: the planned draft block, back-off, counters */
    char failure[256];
    /* how it ended (set when it joins the endings list) */
    ds41_sched_status end_status;
    char end_message[256];
    struct req *next; /* queue link, then endings link */
} req;

typedef struct cache_entry {
    uint64_t n; /* its number ("c<n>") */
    ds41_sched_partition part; /* only requests of the same key reuse it */
    ds41_kv_seq *seq;
    int32_t *ids; /* the ids the sequence consumed */
    size_t n_ids;
    uint64_t last_use; /* LRU clock */
    int64_t created, last_used;
    uint64_t bytes; /* page bytes referenced */
    bool persist;   /* computed here (not restored from the disk tier / imported): goes to the disk
                       tier when it leaves */
} cache_entry;

/* Work the engine thread does between two steps for another thread (export of a running
 * request, import into the cache), which then waits for `done`. */
typedef enum job_kind { JOB_EXPORT = 0, JOB_IMPORT } job_kind;
typedef struct sched_job {
    job_kind kind;
    uint64_t req_id;                 /* EXPORT */
    ds41_sched_export *out;          /* EXPORT */
    const uint8_t *kv;               /* IMPORT */
    size_t kv_len;
    const ds41_sched_partition *part; /* IMPORT */
    const int32_t *ids;
    size_t n_ids;
    uint64_t entry_n;                /* IMPORT result */
    bool done;
    int rc;
    ds41_error err;
    struct sched_job *next;
} sched_job;

struct ds41_scheduler {
    ds41_engine *engine;
    ds41_sched_config cfg;
    ds41_kv_pool *pool;
    const ds41_kv_layout *layout;
    uint32_t n_vocab;

    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_t thread;
    bool thread_started;
    bool stopping;
    struct timespec deadline;

    req *queue_head, *queue_tail;
    uint32_t n_queued;
    req **running; /* [max_sequences] */
    uint32_t n_running;
    uint64_t next_id, admit_clock;

    cache_entry *cache;
    size_t n_cache;
    uint64_t cache_clock, cache_numbers;

    ds41_sched_stats st;
    sched_job *jobs; /* pending, under mu */
    pthread_cond_t jobs_done;
    /* generated tokens per second: 10 one-second buckets */
    int64_t tps_sec[10];
    uint64_t tps_count[10];

    /* engine thread scratch */
    ds41_sampler_scratch *scratch;
    ds41_fwd_item *items;
    req **item_req;
    size_t *item_n;
    size_t *item_slot; /* logits slot + 1, 0 = no logits */
    /* speculative decoding: the provider's requests and answers of a step */
    ds41_draft_request *spec_rq;
    ds41_draft *spec_out;
    req **spec_req;
    float *logits;
    size_t logits_slots;
    /* ended requests whose sink has not been told yet (linked through req.next), delivered
     * without the lock: no memory needed to end a request */
    req *endings_head, *endings_tail;
    size_t n_endings;
};

/* ---- time and logging -------------------------------------------------------------------------- */

static struct timespec mono_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts;
}

static int64_t wall_now(void) { return (int64_t)time(NULL); }

static bool past(struct timespec deadline) {
    struct timespec n = mono_now();
    return n.tv_sec > deadline.tv_sec || (n.tv_sec == deadline.tv_sec && n.tv_nsec >= deadline.tv_nsec);
}

__attribute__((format(printf, 2, 3))) static void slog(ds41_scheduler *s, const char *fmt, ...) {
    if (!s->cfg.log) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    s->cfg.log(s->cfg.log_ctx, line);
}

/* ---- page arithmetic (the same rule ds41_forward checks) ----------------------------------- */

/* Pages a sequence at position p0 may take to consume n more tokens. */
static uint64_t pages_for(const ds41_kv_layout *l, uint64_t p0, uint64_t n) {
    uint64_t need = 0;
    const uint64_t p1 = p0 + n, epp = l->entries_per_page;
    for (int s = 0; s < l->n_sources; s++) {
        const uint64_t r = (uint64_t)l->source_ratio[s];
        const uint64_t e0 = p0 / r, e1 = p1 / r;
        need += (e1 + epp - 1) / epp - (e0 + epp - 1) / epp;
        if (e1 > e0 && e0 % epp != 0) need++;
    }
    return need;
}

static uint64_t pages_free(ds41_scheduler *s) {
    ds41_kv_pool_stats ps;
    ds41_kv_pool_get_stats(s->pool, &ps);
    if (!ps.pages_max) return UINT64_MAX;
    return ps.pages_max > ps.pages_in_use ? ps.pages_max - ps.pages_in_use : 0;
}

static uint64_t pages_max(ds41_scheduler *s) {
    ds41_kv_pool_stats ps;
    ds41_kv_pool_get_stats(s->pool, &ps);
    return ps.pages_max ? ps.pages_max : UINT64_MAX;
}

/* The most tokens a generation's sequence ever consumes: every token but the last one (prompt +
 * max_tokens, clipped to the context); with neither limit, the prompt and one more. */
static uint64_t worst_tokens(const ds41_generation *g) {
    const uint64_t n_prompt = ds41_generation_prompt_tokens(g), max_tokens = ds41_generation_max_tokens(g),
                   max_context = ds41_generation_max_context(g);
    uint64_t total = max_tokens ? n_prompt + max_tokens : UINT64_MAX;
    if (max_context && max_context < total) total = max_context;
    return total == UINT64_MAX ? n_prompt + 1 : total - 1;
}

/* The most tokens a sequence holding at most `pages` pages can consume. */
static uint64_t tokens_in_pages(const ds41_kv_layout *l, uint64_t pages) {
    uint64_t lo = 0, hi = 1ull << 40;
    while (lo < hi) {
        const uint64_t mid = lo + (hi - lo + 1) / 2;
        if (ds41_kv_pages_for_tokens(l, mid) <= pages)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* ---- prefix cache (callers hold mu) ---------------------------------------------------------- */

static void cache_drop(ds41_scheduler *s, size_t i) {
    ds41_kv_seq_free(s->cache[i].seq);
    free(s->cache[i].ids);
    s->cache[i] = s->cache[--s->n_cache];
}

static uint64_t cache_bytes(const ds41_scheduler *s) {
    uint64_t b = 0;
    for (size_t i = 0; i < s->n_cache; i++) b += s->cache[i].bytes;
    return b;
}

/* Evict the least recently used entry other than `keep` (SIZE_MAX: none kept).  false when
 * there is nothing to evict. */
static bool cache_evict_one(ds41_scheduler *s, size_t keep) {
    size_t victim = SIZE_MAX;
    for (size_t i = 0; i < s->n_cache; i++)
        if (i != keep && (victim == SIZE_MAX || s->cache[i].last_use < s->cache[victim].last_use)) victim = i;
    if (victim == SIZE_MAX) return false;
    const cache_entry *e = &s->cache[victim];
    if (e->persist && s->cfg.disk.evicted)
        s->cfg.disk.evicted(s->cfg.disk.ctx, e->seq, &e->part, e->ids, e->n_ids);
    cache_drop(s, victim);
    return true;
}

static void cache_trim(ds41_scheduler *s) {
    while (s->n_cache > DS41_SCHED_MAX_CACHE_ENTRIES ||
           (s->cfg.prefix_cache_max_bytes && s->n_cache && cache_bytes(s) > s->cfg.prefix_cache_max_bytes))
        if (!cache_evict_one(s, SIZE_MAX)) break;
}

static bool same_partition(const cache_entry *e, const ds41_sched_partition *part) {
    return memcmp(e->part.key, part->key, sizeof part->key) == 0;
}

/* Keep seq (taken over) with the ids it consumed, in partition part.  An entry of the same
 * partition with the same ids is replaced. */
static cache_entry *cache_insert(ds41_scheduler *s, const ds41_sched_partition *part, ds41_kv_seq *seq,
                                 const int32_t *ids, size_t n, bool persist) {
    if (!s->cfg.prefix_cache || n == 0) {
        ds41_kv_seq_free(seq);
        return NULL;
    }
    for (size_t i = 0; i < s->n_cache; i++) {
        if (s->cache[i].n_ids == n && same_partition(&s->cache[i], part) &&
            memcmp(s->cache[i].ids, ids, n * sizeof *ids) == 0) {
            cache_drop(s, i);
            break;
        }
    }
    int32_t *copy = malloc(n * sizeof *copy);
    if (!copy || s->n_cache >= DS41_SCHED_MAX_CACHE_ENTRIES + 1) {
        free(copy);
        ds41_kv_seq_free(seq);
        return NULL;
    }
    memcpy(copy, ids, n * sizeof *ids);
    cache_entry *e = &s->cache[s->n_cache++];
    e->n = ++s->cache_numbers;
    e->part = *part;
    e->seq = seq;
    e->ids = copy;
    e->n_ids = n;
    e->last_use = ++s->cache_clock;
    e->created = e->last_used = wall_now();
    e->bytes = ds41_kv_seq_page_bytes(seq);
    e->persist = persist;
    const uint64_t number = e->n;
    cache_trim(s);
    for (size_t i = 0; i < s->n_cache; i++) /* trimming may move or drop it */
        if (s->cache[i].n == number) return &s->cache[i];
    return NULL;
}

/* The longest entry of partition part whose ids are a proper prefix of ids[0..n).  SIZE_MAX when
 * none.  Entries of other partitions are never candidates, whatever their ids. */
static size_t cache_lookup(ds41_scheduler *s, const ds41_sched_partition *part, const int32_t *ids,
                           size_t n) {
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < s->n_cache; i++) {
        const cache_entry *e = &s->cache[i];
        if (e->n_ids >= n || (best != SIZE_MAX && e->n_ids <= s->cache[best].n_ids)) continue;
        if (!same_partition(e, part)) continue;
        if (memcmp(e->ids, ids, e->n_ids * sizeof *ids) == 0) best = i;
    }
    return best;
}

/* ---- endings ----------------------------------------------------------------------------------- */

static void add_ending(ds41_scheduler *s, req *r, ds41_sched_status status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void add_ending(ds41_scheduler *s, req *r, ds41_sched_status status, const char *fmt, ...) {
    r->end_status = status;
    r->end_message[0] = 0;
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->end_message, sizeof r->end_message, fmt, ap);
        va_end(ap);
    }
    r->next = NULL;
    if (s->endings_tail)
        s->endings_tail->next = r;
    else
        s->endings_head = r;
    s->endings_tail = r;
    s->n_endings++;
}

/* Count a finished request (under mu). */
static void count_end(ds41_scheduler *s, const req *r, ds41_sched_status status) {
    ds41_sched_stats *st = &s->st;
    switch (status) {
    case DS41_SCHED_DONE: {
        const char *f = ds41_generation_finish_name(r->g);
        if (strcmp(f, "length") == 0)
            st->requests_length++;
        else if (strcmp(f, "tool_calls") == 0)
            st->requests_tool_calls++;
        else
            st->requests_stop++;
        break;
    }
    case DS41_SCHED_CANCELLED: st->requests_cancelled++; break;
    case DS41_SCHED_KV_FULL: st->requests_kv_full++; break;
    default: st->requests_error++; break;
    }
    st->prompt_tokens += ds41_generation_prompt_tokens(r->g);
}

/* Deliver the collected endings (called with the lock held; sinks run without it: they may call
 * cancel). */
static void deliver_endings(ds41_scheduler *s) {
    req *r = s->endings_head;
    s->endings_head = s->endings_tail = NULL;
    s->n_endings = 0;
    pthread_mutex_unlock(&s->mu);
    while (r) {
        req *next = r->next;
        r->sink.done(r->sink.ctx, r->g, r->end_status, r->end_status == DS41_SCHED_DONE ? NULL : r->end_message);
        ds41_generation_free(r->g);
        ds41_kv_seq_free(r->seq);
        free(r);
        r = next;
    }
    pthread_mutex_lock(&s->mu);
}

/* Remove running[i] (under mu), keeping admission order irrelevant (swap with last). */
static void running_remove(ds41_scheduler *s, uint32_t i) {
    s->running[i] = s->running[--s->n_running];
    s->running[s->n_running] = NULL;
}

/* ---- admission (under mu) ------------------------------------------------------------------- */

static void publish(req *r) {
    if (r->seq) {
        r->pub_kv_tokens = ds41_kv_seq_tokens(r->seq);
        r->pub_kv_pages = ds41_kv_seq_pages(r->seq);
        r->pub_kv_bytes = ds41_kv_seq_page_bytes(r->seq);
    }
    r->pub_generated = ds41_generation_completion_tokens(r->g);
}

/* The disk tier: restore the longest stored prefix of a prompt into the in-memory cache.  Returns
 * the new entry's index, or SIZE_MAX. */
static size_t disk_restore(ds41_scheduler *s, const ds41_sched_partition *part, const int32_t *ids,
                           size_t n_prompt) {
    size_t n_cached = 0;
    /* Reading and verifying a file takes a while: other threads (submit, stats, listings) go on
     * meanwhile.  Nothing this thread relies on changes: only the engine thread takes requests
     * off the queue or runs forward passes, and no cache index is held across the call. */
    pthread_mutex_unlock(&s->mu);
    ds41_kv_seq *seq = s->cfg.disk.restore(s->cfg.disk.ctx, s->pool, part, ids, n_prompt, &n_cached);
    pthread_mutex_lock(&s->mu);
    if (!seq) return SIZE_MAX;
    if (n_cached == 0 || n_cached >= n_prompt || ds41_kv_seq_tokens(seq) != n_cached) {
        slog(s, "disk prefix cache: a restored sequence of %llu tokens does not fit a prefix of %zu",
             (unsigned long long)ds41_kv_seq_tokens(seq), n_cached);
        ds41_kv_seq_free(seq);
        return SIZE_MAX;
    }
    if (!cache_insert(s, part, seq, ids, n_cached, false)) return SIZE_MAX;
    s->st.disk_hits++;
    s->st.disk_cached_tokens += n_cached;
    return cache_lookup(s, part, ids, n_prompt);
}

/* Admit queue heads while there is a slot and room.  Returns with every admitted request in
 * running[] (phase PREFILL). */
static void admit(ds41_scheduler *s) {
    const uint32_t reserve = s->cfg.admit_reserve_tokens ? s->cfg.admit_reserve_tokens : 256;
    while (s->queue_head && s->n_running < s->cfg.max_sequences) {
        req *r = s->queue_head;
        size_t n_prompt = ds41_generation_prompt_tokens(r->g);
        const int32_t *ids = ds41_generation_tokens(r->g, NULL);
        size_t hit = s->cfg.prefix_cache ? cache_lookup(s, &r->part, ids, n_prompt) : SIZE_MAX;
        if (hit == SIZE_MAX && s->cfg.prefix_cache && s->cfg.disk.restore && n_prompt >= 2)
            hit = disk_restore(s, &r->part, ids, n_prompt);
        size_t cached = hit == SIZE_MAX ? 0 : s->cache[hit].n_ids;
        /* Never ask for more than the request can ever consume (worst_tokens: prompt +
         * max_tokens - 1, the last token is not fed back): the submit check admits exactly
         * that much, so a request that fits the whole pool only there must be admitted here. */
        const bool bounded = ds41_generation_max_tokens(r->g) || ds41_generation_max_context(r->g);
        const uint64_t worst = bounded ? worst_tokens(r->g) : UINT64_MAX;
        const uint64_t upto = n_prompt + reserve < worst ? n_prompt + reserve : worst;
        const uint64_t upto_min = n_prompt + 1 < worst ? n_prompt + 1 : worst;
        uint64_t need = pages_for(s->layout, cached, upto - cached);
        /* evict other entries (swap-removal may move the hit: look it up again) */
        while (pages_free(s) < need && cache_evict_one(s, hit))
            if (hit != SIZE_MAX) hit = cache_lookup(s, &r->part, ids, n_prompt);
        if (pages_free(s) < need) {
            if (s->n_running > 0) return; /* wait for memory */
            /* Nothing runs and it still does not fit: try without the reserve, else refuse. */
            if (pages_free(s) < pages_for(s->layout, cached, upto_min - cached)) {
                s->queue_head = r->next;
                if (!s->queue_head) s->queue_tail = NULL;
                s->n_queued--;
                count_end(s, r, DS41_SCHED_KV_FULL);
                add_ending(s, r, DS41_SCHED_KV_FULL, "the KV cache cannot hold a prompt of %zu tokens", n_prompt);
                continue;
            }
        }
        ds41_error err;
        ds41_kv_seq *seq = hit != SIZE_MAX ? ds41_kv_seq_fork(s->cache[hit].seq, &err) : ds41_kv_seq_new(s->pool, &err);
        if (!seq) {
            if (s->n_running > 0) return;
            s->queue_head = r->next;
            if (!s->queue_head) s->queue_tail = NULL;
            s->n_queued--;
            count_end(s, r, DS41_SCHED_ERROR);
            add_ending(s, r, DS41_SCHED_ERROR, "%s", err.msg);
            continue;
        }
        ds41_generation_mark_started(r->g);
        if (hit != SIZE_MAX) {
            if (ds41_generation_mark_cached(r->g, cached, &err) != 0) {
                ds41_kv_seq_free(seq);
                seq = ds41_kv_seq_new(s->pool, &err);
                cached = 0;
                if (!seq) return;
            } else {
                s->cache[hit].last_use = ++s->cache_clock;
                s->cache[hit].last_used = wall_now();
            }
        }
        if (s->cfg.prefix_cache) {
            if (cached) {
                s->st.prefix_hits++;
                s->st.cached_tokens += cached;
            } else {
                s->st.prefix_misses++;
            }
        }
        s->queue_head = r->next;
        if (!s->queue_head) s->queue_tail = NULL;
        s->n_queued--;
        r->next = NULL;
        r->seq = seq;
        r->phase = PH_PREFILL;
        r->admitted = ++s->admit_clock;
        r->snapshot_due = s->cfg.prefix_cache && n_prompt >= 2 && cached < n_prompt - 1;
        r->last_used = wall_now();
        publish(r);
        s->running[s->n_running++] = r;
        if (s->n_running > s->st.max_running_seen) s->st.max_running_seen = s->n_running;
    }
}

/* ---- the engine thread ------------------------------------------------------------------------ */

static int grow_logits(ds41_scheduler *s, size_t slots) {
    if (slots <= s->logits_slots) return 0;
    float *nl = realloc(s->logits, slots * (size_t)s->n_vocab * sizeof *nl);
    if (!nl) return -1;
    s->logits = nl;
    s->logits_slots = slots;
    return 0;
}

static void count_tokens_per_s(ds41_scheduler *s, uint64_t n) {
    int64_t now = (int64_t)mono_now().tv_sec;
    size_t b = (size_t)(now % 10);
    if (s->tps_sec[b] != now) {
        s->tps_sec[b] = now;
        s->tps_count[b] = 0;
    }
    s->tps_count[b] += n;
}

/* Preempt the most recently admitted running request (under mu). */
static bool preempt_one(ds41_scheduler *s) {
    if (s->n_running == 0) return false;
    uint32_t victim = 0;
    for (uint32_t i = 1; i < s->n_running; i++)
        if (s->running[i]->admitted > s->running[victim]->admitted) victim = i;
    req *r = s->running[victim];
    running_remove(s, victim);
    ds41_kv_seq_free(r->seq);
    r->seq = NULL;
    s->st.preemptions++;
    count_end(s, r, DS41_SCHED_KV_FULL);
    add_ending(s, r, DS41_SCHED_KV_FULL, "the KV cache is full: the request was preempted after %zu tokens",
               ds41_generation_completion_tokens(r->g));
    slog(s, "KV cache full: preempted request %llu", (unsigned long long)r->id);
    return true;
}

/* Plan the step's batch (under mu): decode tokens first, then prefill chunks; make sure the pool
 * holds it.  Returns the number of items. */
static size_t plan_batch(ds41_scheduler *s) {
    for (;;) {
        size_t n_items = 0;
        uint64_t tokens = 0, need = 0;
        /* decode: one row per sequence, plus its draft rows (speculative decoding) while the
         * step's token budget has room for them */
        uint64_t n_decode = 0;
        for (uint32_t i = 0; i < s->n_running; i++) n_decode += s->running[i]->phase == PH_DECODE;
        uint64_t draft_room = s->cfg.max_batch_tokens > n_decode ? s->cfg.max_batch_tokens - n_decode : 0;
        for (uint32_t i = 0; i < s->n_running; i++) {
            req *r = s->running[i];
            if (r->phase != PH_DECODE) continue;
            const int32_t *ids;
            size_t n = ds41_generation_pending(r->g, &ids);
            if (n == 0) continue;
            if (r->ss.k > draft_room) r->ss.k = (uint32_t)draft_room; /* a prefix of a block is a block */
            draft_room -= r->ss.k;
            const size_t rows = 1 + r->ss.k;
            s->items[n_items] = (ds41_fwd_item){.seq = r->seq,
                                                .ids = r->ss.k ? r->ss.ids : ids,
                                                .n_ids = rows,
                                                .logits_last_only = r->ss.k == 0,
                                                .spec_taps = s->cfg.draft.taps};
            s->item_req[n_items] = r;
            s->item_n[n_items] = rows;
            n_items++;
            tokens += rows;
            need += ds41_kv_seq_pages_to_grow(r->seq, rows);
        }
        /* prefill, oldest admission first */
        for (;;) {
            req *pick = NULL;
            for (uint32_t i = 0; i < s->n_running; i++) {
                req *r = s->running[i];
                if (r->phase != PH_PREFILL) continue;
                bool planned = false;
                for (size_t k = 0; k < n_items; k++) planned |= s->item_req[k] == r;
                if (!planned && (!pick || r->admitted < pick->admitted)) pick = r;
            }
            if (!pick || tokens >= s->cfg.max_batch_tokens) break;
            const int32_t *ids;
            size_t n = ds41_generation_pending(pick->g, &ids);
            size_t k = n;
            if (k > s->cfg.prefill_chunk) k = s->cfg.prefill_chunk;
            if (k > s->cfg.max_batch_tokens - tokens) k = (size_t)(s->cfg.max_batch_tokens - tokens);
            if (pick->snapshot_due) {
                size_t fed = ds41_kv_seq_tokens(pick->seq);
                size_t upto = ds41_generation_prompt_tokens(pick->g) - 1;
                if (fed < upto && k > upto - fed) k = upto - fed;
            }
            pick->ss.k = 0; /* drafts follow sampled tokens only */
            s->items[n_items] = (ds41_fwd_item){
                .seq = pick->seq, .ids = ids, .n_ids = k, .logits_last_only = true, .spec_taps = s->cfg.draft.taps};
            s->item_req[n_items] = pick;
            s->item_n[n_items] = k;
            n_items++;
            tokens += k;
            need += ds41_kv_seq_pages_to_grow(pick->seq, k);
        }
        if (n_items == 0 || need <= pages_free(s)) return n_items;
        if (cache_evict_one(s, SIZE_MAX)) continue;
        if (!preempt_one(s)) return 0;
    }
}

static void finish_request(ds41_scheduler *s, req *r, uint32_t idx) {
    /* under mu: leaves running[], its KV goes to the prefix cache */
    running_remove(s, idx);
    count_end(s, r, DS41_SCHED_DONE);
    if (r->seq && s->cfg.prefix_cache && ds41_generation_finish_reason(r->g) != DS41_GENERATION_ABORTED) {
        size_t n;
        const int32_t *ids = ds41_generation_tokens(r->g, &n);
        uint64_t consumed = ds41_kv_seq_tokens(r->seq);
        if (consumed <= n) {
            cache_insert(s, &r->part, r->seq, ids, (size_t)consumed, true);
            r->seq = NULL;
        }
    }
    add_ending(s, r, DS41_SCHED_DONE, NULL);
}

static uint32_t running_index(ds41_scheduler *s, const req *r) {
    for (uint32_t i = 0; i < s->n_running; i++)
        if (s->running[i] == r) return i;
    return UINT32_MAX;
}

/* Run the pending jobs (engine thread, under mu, no forward pass in flight). */
static void run_jobs(ds41_scheduler *s) {
    if (!s->jobs) return;
    for (sched_job *j = s->jobs; j; j = j->next) {
        j->rc = -1;
        if (j->kind == JOB_EXPORT) {
            req *r = NULL;
            for (uint32_t i = 0; i < s->n_running; i++)
                if (s->running[i]->id == j->req_id) r = s->running[i];
            if (!r) {
                ds41_fail(&j->err, "request %llu is not running", (unsigned long long)j->req_id);
            } else if (!r->seq || ds41_kv_seq_tokens(r->seq) == 0) {
                ds41_fail(&j->err, "request %llu has not fed any token yet", (unsigned long long)j->req_id);
            } else {
                size_t n_tokens;
                const int32_t *ids = ds41_generation_tokens(r->g, &n_tokens);
                const size_t n = (size_t)ds41_kv_seq_tokens(r->seq);
                const ds41_sampler *sm = ds41_generation_sampler(r->g);
                ds41_sched_export *x = j->out;
                x->seq = n <= n_tokens ? ds41_kv_seq_fork(r->seq, &j->err) : NULL;
                x->ids = malloc(n * sizeof *x->ids);
                x->sampler_len = ds41_sampler_snapshot_size(sm);
                x->sampler = malloc(x->sampler_len ? x->sampler_len : 1);
                if (!x->seq || !x->ids || !x->sampler ||
                    ds41_sampler_snapshot(sm, x->sampler, x->sampler_len, &x->sampler_len, &j->err) != 0) {
                    if (!j->err.msg[0]) ds41_fail(&j->err, "out of memory");
                    ds41_scheduler_export_free(x);
                } else {
                    memcpy(x->ids, ids, n * sizeof *ids);
                    x->n_ids = n;
                    x->part = r->part;
                    j->rc = 0;
                }
            }
        } else {
            ds41_kv_seq *seq = NULL;
            if (ds41_kv_seq_deserialize(s->pool, j->kv, j->kv_len, &seq, &j->err) == 0) {
                if (ds41_kv_seq_tokens(seq) != j->n_ids) {
                    ds41_fail(&j->err, "the state holds %llu tokens, the snapshot lists %zu ids",
                              (unsigned long long)ds41_kv_seq_tokens(seq), j->n_ids);
                    ds41_kv_seq_free(seq);
                } else {
                    cache_entry *e = cache_insert(s, j->part, seq, j->ids, j->n_ids, false);
                    if (e) {
                        j->entry_n = e->n;
                        j->rc = 0;
                    } else {
                        ds41_fail(&j->err, "the prefix cache cannot keep it (full or off)");
                    }
                }
            }
        }
        j->done = true;
    }
    s->jobs = NULL;
    pthread_cond_broadcast(&s->jobs_done);
}

static void fail_jobs(ds41_scheduler *s) {
    for (sched_job *j = s->jobs; j; j = j->next) {
        j->rc = -1;
        ds41_fail(&j->err, "the scheduler is stopping");
        j->done = true;
    }
    s->jobs = NULL;
    pthread_cond_broadcast(&s->jobs_done);
}

/* A verified token's delta goes to its request's sink. */
static void sched_emit(void *ctx, const ds41_generation *g, const ds41_generation_delta *d,
                       const float *logits) {
    (void)logits;
    req *r = ctx;
    r->sink.delta(r->sink.ctx, g, d);
}

static void spec_stats_diff(ds41_spec_stats *to, const ds41_spec_stats *now, const ds41_spec_stats *before) {
    to->steps += now->steps - before->steps;
    to->drafted += now->drafted - before->drafted;
    to->accepted += now->accepted - before->accepted;
    for (unsigned a = 0; a <= DS41_SPEC_MAX_K; a++) to->hist[a] += now->hist[a] - before->hist[a];
}

/* Speculative decoding (engine thread, unlocked, right after the step that sampled the tokens
 * the drafts follow): ask the provider, in one call, for the next drafts of every sequence of
 * the step that goes on decoding; the next plan feeds them.  A provider error only means no
 * drafts this step. */
static void plan_drafts(ds41_scheduler *s, size_t n_items) {
    if (!s->cfg.draft.draft || s->cfg.spec.max_k == 0) return;
    size_t n = 0;
    for (size_t k = 0; k < n_items; k++) {
        req *r = s->item_req[k];
        r->ss.k = 0;
        const int32_t *pending = NULL;
        /* (the pending token must be a sampled one: not the last prompt token a snapshot left) */
        if (r->failed || ds41_generation_finished(r->g) || ds41_generation_completion_tokens(r->g) == 0 ||
            ds41_generation_pending(r->g, &pending) != 1)
            continue;
        const uint32_t want = ds41_spec_want(&s->cfg.spec, &r->ss, r->g);
        if (want == 0) continue;
        size_t n_ctx = 0;
        const int32_t *ctx = ds41_generation_tokens(r->g, &n_ctx);
        s->spec_rq[n] = (ds41_draft_request){
            .seq = r->seq, .context = ctx, .n_context = n_ctx, .last = pending[0], .max_k = want};
        s->spec_req[n] = r;
        memset(&s->spec_out[n], 0, sizeof s->spec_out[n]);
        n++;
    }
    if (n == 0) return;
    ds41_error err = {{0}};
    if (s->cfg.draft.draft(s->cfg.draft.ctx, s->spec_rq, n, s->spec_out, &err) != 0) {
        slog(s, "draft provider %s: %s", s->cfg.draft.name ? s->cfg.draft.name : "?", err.msg);
        return;
    }
    for (size_t i = 0; i < n; i++)
        ds41_spec_take(&s->cfg.spec, &s->spec_req[i]->ss, s->spec_req[i]->g, &s->spec_out[i]);
}

static void *engine_main(void *arg) {
    ds41_scheduler *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        run_jobs(s);
        /* cancellations */
        bool drain_over = s->stopping && past(s->deadline);
        for (req **pp = &s->queue_head, *prev = NULL; *pp;) {
            req *r = *pp;
            if (r->cancel || drain_over) {
                *pp = r->next;
                if (s->queue_tail == r) s->queue_tail = prev;
                s->n_queued--;
                count_end(s, r, DS41_SCHED_CANCELLED);
                add_ending(s, r, DS41_SCHED_CANCELLED, "cancelled");
            } else {
                prev = r;
                pp = &r->next;
            }
        }
        for (uint32_t i = 0; i < s->n_running;) {
            req *r = s->running[i];
            if (r->cancel || drain_over) {
                running_remove(s, i);
                ds41_generation_abort(r->g, NULL, NULL);
                ds41_kv_seq_free(r->seq); /* freed at once, never cached */
                r->seq = NULL;
                count_end(s, r, DS41_SCHED_CANCELLED);
                add_ending(s, r, DS41_SCHED_CANCELLED, "cancelled");
            } else {
                i++;
            }
        }
        admit(s);
        if (s->n_endings) {
            deliver_endings(s);
            continue;
        }
        if (s->n_running == 0) {
            if (s->stopping && !s->queue_head) break;
            if (s->stopping) {
                pthread_cond_timedwait(&s->wake, &s->mu, &s->deadline);
            } else {
                pthread_cond_wait(&s->wake, &s->mu);
            }
            continue;
        }
        size_t n_items = plan_batch(s);
        if (s->n_endings) continue; /* preemptions to deliver first */
        if (n_items == 0) {
            /* Nothing can run (should not happen: every running request has a token to feed);
             * do not spin. */
            struct timespec t = mono_now();
            t.tv_nsec += 1000000L;
            if (t.tv_nsec >= 1000000000L) {
                t.tv_sec++;
                t.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&s->wake, &s->mu, &t);
            continue;
        }
        size_t n_logits = 0;
        for (size_t k = 0; k < n_items; k++) {
            req *r = s->item_req[k];
            const bool spec = r->phase == PH_DECODE && r->ss.k > 0;
            if (spec && ds41_spec_begin(&r->ss, r->seq, &(ds41_error){{0}}) != 0) {
                /* no journal (out of memory): a plain step */
                r->ss.k = 0;
                (void)ds41_generation_pending(r->g, &s->items[k].ids);
                s->items[k].n_ids = s->item_n[k] = 1;
                s->items[k].logits_last_only = true;
            }
            const size_t rows = r->phase == PH_DECODE ? s->item_n[k] : 1;
            s->item_slot[k] = spec || s->item_n[k] == ds41_generation_pending(r->g, NULL) ? n_logits + 1 : 0;
            if (s->item_slot[k]) n_logits += rows;
            r->failed = false;
        }
        pthread_mutex_unlock(&s->mu);

        /* ---- the forward step, unlocked ---- */
        ds41_error err = {{0}};
        int rc = grow_logits(s, n_logits) == 0 ? 0 : ds41_fail(&err, "out of memory (logits)");
        size_t n_decode = 0, n_prefill_tokens = 0;
        for (size_t k = 0; k < n_items; k++) {
            s->items[k].logits = s->item_slot[k] && rc == 0 ? s->logits + (s->item_slot[k] - 1) * (size_t)s->n_vocab : NULL;
            if (s->item_req[k]->phase == PH_DECODE)
                n_decode++;
            else
                n_prefill_tokens += s->item_n[k];
        }
        if (rc == 0) rc = ds41_forward(s->engine, s->items, n_items, NULL, &err);

        pthread_mutex_lock(&s->mu);
        s->st.steps++;
        s->st.prefill_tokens += rc == 0 ? n_prefill_tokens : 0;
        if (n_decode && rc == 0) {
            s->st.decode_steps++;
            s->st.decode_seqs_sum += n_decode;
            size_t b = 0;
            while (b < DS41_SCHED_HIST_BUCKETS - 1 && n_decode > ds41_sched_hist_bounds[b]) b++;
            s->st.decode_hist[b]++;
        }
        if (rc != 0) {
            slog(s, "forward step failed: %s", err.msg);
            for (size_t k = 0; k < n_items; k++) {
                req *r = s->item_req[k];
                ds41_kv_seq_journal_end(r->seq);
                r->ss.k = 0;
                uint32_t idx = running_index(s, r);
                if (idx == UINT32_MAX) continue;
                running_remove(s, idx);
                ds41_generation_abort(r->g, NULL, NULL);
                count_end(s, r, DS41_SCHED_ERROR);
                add_ending(s, r, DS41_SCHED_ERROR, "%s", err.msg);
            }
            continue;
        }
        /* (a draft block's drafts are marked fed by the verification, as they stand) */
        for (size_t k = 0; k < n_items; k++)
            ds41_generation_mark_fed(s->item_req[k]->g, s->item_req[k]->ss.k ? 1 : s->item_n[k]);
        pthread_mutex_unlock(&s->mu);

        /* ---- sampling and text, unlocked (sinks run here) ---- */
        uint64_t sampled = 0;
        ds41_spec_stats spec_st;
        memset(&spec_st, 0, sizeof spec_st);
        for (size_t k = 0; k < n_items; k++) {
            req *r = s->item_req[k];
            if (!s->items[k].logits || !ds41_generation_wants_logits(r->g)) continue;
            if (r->ss.k) {
                /* a draft block: step row by row, the sink sees each token that stands */
                const ds41_spec_stats before = r->ss.st;
                size_t n_steps = 0;
                int vrc = ds41_spec_verify(&r->ss, r->g, r->seq, s->items[k].logits, s->n_vocab, s->scratch,
                                           sched_emit, r, &n_steps, &err);
                sampled += n_steps;
                spec_stats_diff(&spec_st, &r->ss.st, &before);
                if (vrc != 0) {
                    r->failed = true;
                    snprintf(r->failure, sizeof r->failure, "%.255s", err.msg);
                    slog(s, "request %llu: %s", (unsigned long long)r->id, err.msg);
                    ds41_generation_abort(r->g, NULL, NULL);
                    continue;
                }
                const int32_t *next = NULL;
                if (!ds41_generation_finished(r->g) && ds41_generation_pending(r->g, &next) == 1) {
                    ds41_error perr;
                    (void)ds41_engine_prefetch(s->engine, r->seq, next[0], &perr);
                }
                continue;
            }
            ds41_generation_delta d;
            if (ds41_generation_step(r->g, s->items[k].logits, s->scratch, &d, &err) != 0) {
                r->failed = true;
                snprintf(r->failure, sizeof r->failure, "%.255s", err.msg);
                slog(s, "request %llu: %s", (unsigned long long)r->id, err.msg);
                ds41_generation_abort(r->g, NULL, NULL);
                continue;
            }
            sampled++;
            /* The next step's Engram rows start loading now, under the text work (a no-op
             * when the tables are resident; a failed prefetch only means the step reads them). */
            const int32_t *next = NULL;
            if (!ds41_generation_finished(r->g) && ds41_generation_pending(r->g, &next) == 1) {
                ds41_error perr;
                (void)ds41_engine_prefetch(s->engine, r->seq, next[0], &perr);
            }
            r->sink.delta(r->sink.ctx, r->g, &d);
        }
        plan_drafts(s, n_items);

        pthread_mutex_lock(&s->mu);
        s->st.generated_tokens += sampled;
        s->st.spec_steps += spec_st.steps;
        s->st.spec_drafted += spec_st.drafted;
        s->st.spec_accepted += spec_st.accepted;
        for (unsigned a = 0; a <= DS41_SPEC_MAX_K; a++) s->st.spec_hist[a] += spec_st.hist[a];
        count_tokens_per_s(s, sampled);
        for (size_t k = 0; k < n_items; k++) {
            req *r = s->item_req[k];
            uint32_t idx = running_index(s, r);
            if (idx == UINT32_MAX) continue;
            r->last_used = wall_now();
            if (r->failed) {
                running_remove(s, idx);
                count_end(s, r, DS41_SCHED_ERROR);
                add_ending(s, r, DS41_SCHED_ERROR, "%s", r->failure);
                continue;
            }
            if (ds41_generation_finished(r->g)) {
                finish_request(s, r, idx);
                continue;
            }
            size_t n_prompt = ds41_generation_prompt_tokens(r->g);
            uint64_t fed = ds41_kv_seq_tokens(r->seq);
            if (r->snapshot_due && fed == n_prompt - 1) {
                ds41_kv_seq *snap = ds41_kv_seq_fork(r->seq, &err);
                if (snap)
                    cache_insert(s, &r->part, snap, ds41_generation_tokens(r->g, NULL), n_prompt - 1, true);
                r->snapshot_due = false;
            }
            if (fed >= n_prompt) r->phase = PH_DECODE;
            publish(r);
        }
    }
    /* stopping: everything queued or running has ended */
    deliver_endings(s);
    fail_jobs(s);
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- public API ------------------------------------------------------------------------------- */

int ds41_scheduler_new(ds41_engine *engine, const ds41_sched_config *cfg, ds41_scheduler **out, ds41_error *err) {
    if (!out) return ds41_fail(err, "scheduler: no output");
    *out = NULL;
    if (!engine || !cfg) return ds41_fail(err, "scheduler: no engine or config");
    if (cfg->max_sequences < 1 || cfg->max_sequences > 65536)
        return ds41_fail(err, "scheduler: max_sequences %u outside 1..65536", cfg->max_sequences);
    if (cfg->prefill_chunk < 1) return ds41_fail(err, "scheduler: prefill_chunk must be >= 1");
    if (cfg->max_batch_tokens < cfg->max_sequences)
        return ds41_fail(err, "scheduler: max_batch_tokens %u below max_sequences %u", cfg->max_batch_tokens,
                         cfg->max_sequences);
    if (cfg->max_queue < 1) return ds41_fail(err, "scheduler: max_queue must be >= 1");
    ds41_scheduler *s = calloc(1, sizeof *s);
    if (!s) return ds41_fail(err, "out of memory");
    s->engine = engine;
    s->cfg = *cfg;
    s->n_vocab = (uint32_t)ds41_engine_config(engine)->vocab_size;
    s->pool = ds41_engine_new_pool(engine, cfg->kv_budget_bytes, cfg->entries_per_page, err);
    if (!s->pool) {
        free(s);
        return -1;
    }
    s->layout = ds41_kv_pool_layout(s->pool);
    s->running = calloc(cfg->max_sequences, sizeof *s->running);
    s->items = calloc(cfg->max_sequences, sizeof *s->items);
    s->item_req = calloc(cfg->max_sequences, sizeof *s->item_req);
    s->item_n = calloc(cfg->max_sequences, sizeof *s->item_n);
    s->item_slot = calloc(cfg->max_sequences, sizeof *s->item_slot);
    s->cache = calloc(DS41_SCHED_MAX_CACHE_ENTRIES + 1, sizeof *s->cache);
    s->spec_rq = calloc(cfg->max_sequences, sizeof *s->spec_rq);
    s->spec_out = calloc(cfg->max_sequences, sizeof *s->spec_out);
    s->spec_req = calloc(cfg->max_sequences, sizeof *s->spec_req);
    if (cfg->draft.draft && ds41_spec_config_check(&cfg->spec, "speculative", err) != 0) goto fail;
    if (!s->running || !s->items || !s->item_req || !s->item_n || !s->item_slot || !s->cache || !s->spec_rq ||
        !s->spec_out || !s->spec_req || ds41_sampler_scratch_new(&s->scratch, s->n_vocab, err) != 0) {
        if (!err || !err->msg[0]) ds41_fail(err, "out of memory");
        goto fail;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->wake, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->jobs_done, NULL);
    int e = pthread_create(&s->thread, NULL, engine_main, s);
    if (e != 0) {
        pthread_cond_destroy(&s->wake);
        pthread_cond_destroy(&s->jobs_done);
        pthread_mutex_destroy(&s->mu);
        ds41_fail(err, "scheduler: cannot start the engine thread: %s", strerror(e));
        goto fail;
    }
    s->thread_started = true;
    *out = s;
    return 0;
fail:
    ds41_sampler_scratch_free(s->scratch);
    free(s->running);
    free(s->items);
    free(s->item_req);
    free(s->item_n);
    free(s->item_slot);
    free(s->cache);
    free(s->spec_rq);
    free(s->spec_out);
    free(s->spec_req);
    ds41_kv_pool_free(s->pool);
    free(s);
    return -1;
}

void ds41_scheduler_free(ds41_scheduler *s, unsigned drain_ms) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    struct timespec d = mono_now();
    d.tv_sec += drain_ms / 1000;
    d.tv_nsec += (long)(drain_ms % 1000) * 1000000L;
    if (d.tv_nsec >= 1000000000L) {
        d.tv_sec++;
        d.tv_nsec -= 1000000000L;
    }
    s->deadline = d;
    pthread_cond_broadcast(&s->wake);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    /* cached prefixes go to the disk tier (the engine thread is gone: no lock needed) */
    for (size_t i = 0; i < s->n_cache && s->cfg.disk.evicted; i++)
        if (s->cache[i].persist)
            s->cfg.disk.evicted(s->cfg.disk.ctx, s->cache[i].seq, &s->cache[i].part, s->cache[i].ids,
                                s->cache[i].n_ids);
    while (s->n_cache) cache_drop(s, s->n_cache - 1);
    pthread_cond_destroy(&s->wake);
    pthread_cond_destroy(&s->jobs_done);
    pthread_mutex_destroy(&s->mu);
    ds41_sampler_scratch_free(s->scratch);
    free(s->running);
    free(s->items);
    free(s->item_req);
    free(s->item_n);
    free(s->item_slot);
    free(s->spec_rq);
    free(s->spec_out);
    free(s->spec_req);
    free(s->logits);
    free(s->cache);
    ds41_kv_pool_free(s->pool);
    free(s);
}

void ds41_scheduler_partition_make(int64_t uid, bool share_across_users, const char *salt, size_t salt_len,
                                   ds41_sched_partition *out) {
    /* Length-prefixed fields after a domain tag: no two (owner, salt) pairs give the same bytes. */
    char owner[32];
    int on = share_across_users ? snprintf(owner, sizeof owner, "any user")
                                : snprintf(owner, sizeof owner, "uid %lld", (long long)uid);
    ds41_sha256_ctx c;
    ds41_sha256_init(&c);
    static const char tag[] = "ds41 prefix-cache partition v1";
    ds41_sha256_update(&c, tag, sizeof tag);
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)on >> (8 * i));
    ds41_sha256_update(&c, len, 8);
    ds41_sha256_update(&c, owner, (size_t)on);
    if (!salt) salt_len = 0;
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)salt_len >> (8 * i));
    ds41_sha256_update(&c, len, 8);
    if (salt_len) ds41_sha256_update(&c, salt, salt_len);
    ds41_sha256_final(&c, out->key);
    out->owner_uid = uid;
}

ds41_sched_status ds41_scheduler_submit(ds41_scheduler *s, ds41_generation *g, const ds41_sched_sink *sink,
                                        uint64_t *id, ds41_error *err) {
    const ds41_sched_partition none = {.owner_uid = -1};
    return ds41_scheduler_submit_in(s, &none, g, sink, id, err);
}

ds41_sched_status ds41_scheduler_submit_in(ds41_scheduler *s, const ds41_sched_partition *part,
                                           ds41_generation *g, const ds41_sched_sink *sink, uint64_t *id,
                                           ds41_error *err) {
    if (id) *id = 0;
    if (!s || !part || !g || !sink || !sink->delta || !sink->done) {
        ds41_generation_free(g);
        ds41_fail(err, "scheduler: bad submission");
        return DS41_SCHED_ERROR;
    }
    req *r = calloc(1, sizeof *r);
    if (!r) {
        ds41_generation_free(g);
        ds41_fail(err, "out of memory");
        return DS41_SCHED_ERROR;
    }
    r->g = g;
    r->sink = *sink;
    r->part = *part;
    r->created = r->last_used = wall_now();
    size_t n_prompt = ds41_generation_prompt_tokens(g);
    pthread_mutex_lock(&s->mu);
    ds41_sched_status status = DS41_SCHED_DONE;
    if (s->stopping) {
        status = DS41_SCHED_STOPPING;
        ds41_fail(err, "the server is stopping");
    } else if (ds41_kv_pages_for_tokens(s->layout, worst_tokens(g)) > pages_max(s)) {
        /* checked before the queue: waiting would never help this one */
        status = DS41_SCHED_TOO_LARGE;
        s->st.rejected_kv_full++; /* refused for its KV memory, as before, only up front now */
        const uint64_t worst = worst_tokens(g), max_tokens = ds41_generation_max_tokens(g),
                       ctx = ds41_generation_max_context(g);
        char what[160];
        if (ctx && !max_tokens)
            snprintf(what, sizeof what,
                     "a prompt of %zu tokens without max_tokens (up to the context of %llu tokens)", n_prompt,
                     (unsigned long long)ctx);
        else if (ctx && ctx < n_prompt + max_tokens)
            snprintf(what, sizeof what,
                     "a prompt of %zu tokens + max_tokens %llu (clipped to the context of %llu tokens)",
                     n_prompt, (unsigned long long)max_tokens, (unsigned long long)ctx);
        else if (max_tokens)
            snprintf(what, sizeof what, "a prompt of %zu tokens + max_tokens %llu", n_prompt,
                     (unsigned long long)max_tokens);
        else
            snprintf(what, sizeof what, "a prompt of %zu tokens", n_prompt);
        ds41_fail(
            err,
            "the request can never fit in the KV pool: %s needs the KV of %llu tokens (%llu pages of %u "
            "bytes), the whole pool holds %llu pages (%llu tokens)",
            what, (unsigned long long)worst, (unsigned long long)ds41_kv_pages_for_tokens(s->layout, worst),
            s->layout->page_bytes, (unsigned long long)pages_max(s),
            (unsigned long long)tokens_in_pages(s->layout, pages_max(s)));
    } else if (s->n_queued >= s->cfg.max_queue) {
        status = DS41_SCHED_QUEUE_FULL;
        s->st.rejected_queue_full++;
        ds41_fail(err, "the request queue is full (%u waiting)", s->n_queued);
    }
    if (status != DS41_SCHED_DONE) {
        pthread_mutex_unlock(&s->mu);
        ds41_generation_free(g);
        free(r);
        return status;
    }
    r->id = ++s->next_id;
    if (id) *id = r->id;
    if (s->queue_tail)
        s->queue_tail->next = r;
    else
        s->queue_head = r;
    s->queue_tail = r;
    s->n_queued++;
    publish(r);
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
    return DS41_SCHED_DONE;
}

void ds41_scheduler_cancel(ds41_scheduler *s, uint64_t id) {
    if (!s || !id) return;
    pthread_mutex_lock(&s->mu);
    bool found = false;
    for (req *r = s->queue_head; r && !found; r = r->next)
        if (r->id == id) r->cancel = found = true;
    for (uint32_t i = 0; i < s->n_running && !found; i++)
        if (s->running[i]->id == id) s->running[i]->cancel = found = true;
    if (found) pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
}

void ds41_scheduler_stats(ds41_scheduler *s, ds41_sched_stats *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    out->queued = s->n_queued;
    out->running = s->n_running;
    out->cache_entries = s->n_cache;
    out->cache_bytes = cache_bytes(s);
    int64_t now = (int64_t)mono_now().tv_sec;
    uint64_t sum = 0;
    for (int b = 0; b < 10; b++)
        if (s->tps_sec[b] > now - 10 && s->tps_sec[b] < now) sum += s->tps_count[b];
    out->tokens_per_s = (double)sum / 9.0;
    pthread_mutex_unlock(&s->mu);
    ds41_kv_pool_stats ps;
    ds41_kv_pool_get_stats(s->pool, &ps);
    out->kv_page_bytes = ps.page_bytes;
    out->kv_pages_in_use = ps.pages_in_use;
    out->kv_pages_max = ps.pages_max;
    const ds41_kv_layout *l = s->layout;
    int min_ratio = 0;
    double bpt = 0;
    for (int k = 0; k < l->n_sources; k++) {
        bpt += (double)l->entry_bytes / (double)l->source_ratio[k];
        if (!min_ratio || l->source_ratio[k] < min_ratio) min_ratio = l->source_ratio[k];
    }
    out->kv_bytes_per_token = bpt;
    out->kv_page_tokens = (uint64_t)l->entries_per_page * (uint64_t)(min_ratio ? min_ratio : 1);
}

static void emit_req(const req *r, void (*emit)(void *, const ds41_sched_session *), void *acc) {
    ds41_sched_session ss = {0};
    snprintf(ss.id, sizeof ss.id, "r%llu", (unsigned long long)r->id);
    ss.state = r->phase == PH_QUEUED ? "queued" : r->phase == PH_PREFILL ? "prefill" : "decode";
    ss.request_id = r->id;
    ss.prompt_tokens = ds41_generation_prompt_tokens(r->g);
    ss.generated_tokens = r->pub_generated;
    ss.cached_tokens = ds41_generation_cached_tokens(r->g);
    ss.kv_tokens = r->pub_kv_tokens;
    ss.kv_pages = r->pub_kv_pages;
    ss.kv_bytes = r->pub_kv_bytes;
    ss.created = r->created;
    ss.last_used = r->last_used;
    ss.owner_uid = r->part.owner_uid;
    emit(acc, &ss);
}

void ds41_scheduler_sessions(ds41_scheduler *s, void (*emit)(void *acc, const ds41_sched_session *sess), void *acc) {
    pthread_mutex_lock(&s->mu);
    for (uint32_t i = 0; i < s->n_running; i++) emit_req(s->running[i], emit, acc);
    for (req *r = s->queue_head; r; r = r->next) emit_req(r, emit, acc);
    for (size_t i = 0; i < s->n_cache; i++) {
        const cache_entry *e = &s->cache[i];
        ds41_sched_session ss = {0};
        snprintf(ss.id, sizeof ss.id, "c%llu", (unsigned long long)e->n);
        ss.state = "cached";
        ss.prompt_tokens = e->n_ids;
        ss.kv_tokens = ds41_kv_seq_tokens(e->seq);
        ss.kv_pages = ds41_kv_seq_pages(e->seq);
        ss.kv_bytes = ds41_kv_seq_page_bytes(e->seq);
        ss.created = e->created;
        ss.last_used = e->last_used;
        ss.owner_uid = e->part.owner_uid;
        emit(acc, &ss);
    }
    pthread_mutex_unlock(&s->mu);
}

int ds41_scheduler_delete_session(ds41_scheduler *s, const char *id) {
    if (!s || !id || (id[0] != 'r' && id[0] != 'c') || !id[1]) return -1;
    char *end;
    errno = 0;
    unsigned long long n = strtoull(id + 1, &end, 10);
    if (errno || *end || id[1] < '0' || id[1] > '9') return -1;
    int rc = -1;
    pthread_mutex_lock(&s->mu);
    if (id[0] == 'c') {
        for (size_t i = 0; i < s->n_cache; i++) {
            if (s->cache[i].n == n) {
                cache_drop(s, i);
                rc = 0;
                break;
            }
        }
    } else {
        for (req *r = s->queue_head; r && rc; r = r->next)
            if (r->id == n) r->cancel = true, rc = 0;
        for (uint32_t i = 0; i < s->n_running && rc; i++)
            if (s->running[i]->id == n) s->running[i]->cancel = true, rc = 0;
        if (rc == 0) pthread_cond_signal(&s->wake);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

void ds41_scheduler_clear_cache(ds41_scheduler *s) {
    pthread_mutex_lock(&s->mu);
    while (s->n_cache) cache_drop(s, s->n_cache - 1);
    pthread_mutex_unlock(&s->mu);
}

/* ---- snapshots: export and import ------------------------------------------------------------- */

void ds41_scheduler_export_free(ds41_sched_export *x) {
    if (!x) return;
    ds41_kv_seq_free(x->seq);
    free(x->ids);
    free(x->sampler);
    memset(x, 0, sizeof *x);
}

/* Queue a job and wait for the engine thread (called with mu held; returns with it held). */
static void run_job_on_engine(ds41_scheduler *s, sched_job *j) {
    j->next = s->jobs;
    s->jobs = j;
    pthread_cond_signal(&s->wake);
    while (!j->done) pthread_cond_wait(&s->jobs_done, &s->mu);
}

int ds41_scheduler_export(ds41_scheduler *s, const char *id, ds41_sched_export *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    if (!s || !id || (id[0] != 'r' && id[0] != 'c') || id[1] < '0' || id[1] > '9')
        return ds41_fail(err, "no session %.40s", id ? id : "(null)");
    char *end;
    errno = 0;
    unsigned long long n = strtoull(id + 1, &end, 10);
    if (errno || *end) return ds41_fail(err, "no session %.40s", id);
    pthread_mutex_lock(&s->mu);
    int rc = -1;
    if (id[0] == 'c') {
        size_t i = 0;
        while (i < s->n_cache && s->cache[i].n != n) i++;
        if (i == s->n_cache) {
            ds41_fail(err, "no session %.40s", id);
        } else {
            const cache_entry *e = &s->cache[i];
            out->seq = ds41_kv_seq_fork(e->seq, err);
            out->ids = malloc(e->n_ids * sizeof *out->ids);
            if (!out->seq || !out->ids) {
                if (out->seq) ds41_fail(err, "out of memory");
                ds41_scheduler_export_free(out);
            } else {
                memcpy(out->ids, e->ids, e->n_ids * sizeof *e->ids);
                out->n_ids = e->n_ids;
                out->part = e->part;
                rc = 0;
            }
        }
    } else {
        bool queued = false;
        for (req *r = s->queue_head; r; r = r->next) queued |= r->id == n;
        if (queued) {
            ds41_fail(err, "session %.40s is queued: nothing to save yet", id);
        } else if (s->stopping) {
            ds41_fail(err, "the scheduler is stopping");
        } else {
            sched_job j = {.kind = JOB_EXPORT, .req_id = n, .out = out};
            run_job_on_engine(s, &j);
            rc = j.rc;
            if (rc != 0 && err) *err = j.err;
            if (rc != 0 && strstr(j.err.msg, "is not running")) ds41_fail(err, "no session %.40s", id);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int ds41_scheduler_import(ds41_scheduler *s, const ds41_sched_partition *part, const uint8_t *kv,
                          size_t kv_len, const int32_t *ids, size_t n, char entry_id[32], ds41_error *err) {
    if (entry_id) entry_id[0] = 0;
    if (!s || !part || !kv || !ids || n == 0) return ds41_fail(err, "scheduler: bad import");
    if (!s->cfg.prefix_cache) return ds41_fail(err, "the prefix cache is disabled");
    pthread_mutex_lock(&s->mu);
    int rc = -1;
    if (s->stopping) {
        ds41_fail(err, "the scheduler is stopping");
    } else {
        sched_job j = {.kind = JOB_IMPORT, .kv = kv, .kv_len = kv_len, .part = part, .ids = ids, .n_ids = n};
        run_job_on_engine(s, &j);
        rc = j.rc;
        if (rc != 0 && err) *err = j.err;
        if (rc == 0 && entry_id) snprintf(entry_id, 32, "c%llu", (unsigned long long)j.entry_n);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}
