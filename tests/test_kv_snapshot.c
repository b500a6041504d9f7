/* engine/kv_cache serialization: a sequence (and its sampler) snapshotted in the middle of a
 * generation and restored into another pool continues exactly like the uninterrupted one (same
 * logits bit for bit, same tokens), in the fast and the reference arithmetic; every malformed
 * snapshot is refused with a message and nothing leaks. */
#include "engine/forward/forward.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model_gen.h"
#include "engine/serve/sampler.h"
#include "tap.h"
#include "tmpdir.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROMPT 37 /* crosses ratio-2 groups and the window of 8 several times */
#define STEPS 10  /* generated tokens */
#define CUT 4     /* snapshot after this many generated tokens */

static uint32_t NV;

static ds41_sampler *new_sampler(ds41_error *err) {
    ds41_sampler_params sp = ds41_sampler_params_default();
    sp.temperature = 0.9f;
    sp.top_k = 40;
    sp.repetition_penalty = 1.1f;
    sp.frequency_penalty = 0.3f;
    sp.seed = 7;
    sp.has_seed = 1;
    ds41_sampler *s = NULL;
    ds41_sampler_new(&s, &sp, NV, err);
    return s;
}

/* Feed ids into seq, logits of the last position into out. */
static int feed(ds41_engine *e, ds41_kv_seq *seq, const int32_t *ids, size_t n, float *out, ds41_error *err) {
    ds41_fwd_item it = {.seq = seq, .ids = ids, .n_ids = n, .logits = out, .logits_last_only = true};
    return ds41_forward(e, &it, 1, NULL, err);
}

/* Sample + accept one token from logits. */
static int step(ds41_sampler *sm, ds41_sampler_scratch *sc, const float *logits, int32_t *tok,
                ds41_error *err) {
    ds41_sample_result r;
    if (ds41_sampler_sample(sm, sc, logits, NV, &r, err) != 0) return -1;
    *tok = (int32_t)r.token;
    return ds41_sampler_accept(sm, r.token, err);
}

/* Is the snapshot with n bytes replaced (offs[i] = vals[i]) refused with a
 * message containing want?  Copies the message into msg either way. */
static int bytes_refused(ds41_kv_pool *pool, const uint8_t *snap, size_t len, const size_t *offs,
                         const uint8_t *vals, int n, const char *want, char *msg, size_t msg_size) {
    uint8_t *b = malloc(len);
    memcpy(b, snap, len);
    for (int i = 0; i < n; i++) b[offs[i]] = vals[i];
    ds41_kv_seq *s = NULL;
    ds41_error err = {{0}};
    int rc = ds41_kv_seq_deserialize(pool, b, len, &s, &err);
    free(b);
    snprintf(msg, msg_size, "%.200s", err.msg);
    if (rc == 0) {
        ds41_kv_seq_free(s);
        return 0;
    }
    return s == NULL && strstr(err.msg, want) != NULL;
}

static int mutate_refused(ds41_kv_pool *pool, const uint8_t *snap, size_t len, size_t off, uint8_t val,
                          const char *want, char *msg, size_t msg_size) {
    return bytes_refused(pool, snap, len, &off, &val, 1, want, msg, msg_size);
}

/* An index-key block (32 codes, 16 bytes) of entry 0 with every code set to
 * `code` and its ue8m0 scale byte set to `scale`. */
static int index_block_refused(ds41_kv_pool *pool, const uint8_t *snap, size_t len, size_t entry_off,
                               uint8_t code, uint8_t scale, char *msg, size_t msg_size) {
    const ds41_kv_layout *l = ds41_kv_pool_layout(pool);
    size_t offs[17];
    uint8_t vals[17];
    for (int i = 0; i < 16; i++) {
        offs[i] = entry_off + l->latent_bytes + (size_t)i;
        vals[i] = (uint8_t)(code | code << 4);
    }
    offs[16] = entry_off + l->latent_bytes + l->index_dim / 2;
    vals[16] = scale;
    return bytes_refused(pool, snap, len, offs, vals, 17, "index-key value 0 overflows", msg, msg_size);
}

static void run_mode(const char *dir, bool reference) {
    const char *mode = reference ? "reference" : "fast";
    ds41_error err = {{0}};
    ds41_engine_opts eo = {.reference = reference, .cpu = {.threads = 2}};
    ds41_engine *e = ds41_engine_load(dir, &eo, &err);
    if (!TAP_CHECK(e != NULL, "%s: engine (%s)", mode, e ? "ok" : err.msg)) return;
    NV = (uint32_t)ds41_engine_config(e)->vocab_size;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    ds41_kv_pool *pool4 = ds41_engine_new_pool(e, 0, 4, &err); /* another page size */
    ds41_sampler_scratch *sc = NULL;
    ds41_sampler_scratch_new(&sc, NV, &err);
    int32_t prompt[PROMPT];
    for (int i = 0; i < PROMPT; i++) prompt[i] = 3 + (int32_t)((i * 7919u + 13u) % (NV - 3));
    float *ref_logits = malloc((size_t)(STEPS + 1) * NV * sizeof(float));
    float *logits = malloc((size_t)NV * sizeof(float));
    int32_t ref_tok[STEPS], tok[STEPS];

    /* uninterrupted */
    ds41_kv_seq *a = ds41_kv_seq_new(pool, &err);
    ds41_sampler *sa = new_sampler(&err);
    int rc = feed(e, a, prompt, PROMPT, ref_logits, &err);
    for (int k = 0; k < STEPS && rc == 0; k++) {
        rc = step(sa, sc, ref_logits + (size_t)k * NV, &ref_tok[k], &err);
        if (rc == 0) rc = feed(e, a, &ref_tok[k], 1, ref_logits + (size_t)(k + 1) * NV, &err);
    }
    TAP_CHECK(rc == 0, "%s: uninterrupted run (%s)", mode, rc ? err.msg : "ok");

    /* interrupted at CUT: snapshot, free everything, restore into pool4 */
    ds41_kv_seq *b = ds41_kv_seq_new(pool, &err);
    ds41_sampler *sb = new_sampler(&err);
    rc = feed(e, b, prompt, PROMPT, logits, &err);
    for (int k = 0; k < CUT && rc == 0; k++) {
        rc = step(sb, sc, logits, &tok[k], &err);
        if (rc == 0) rc = feed(e, b, &tok[k], 1, logits, &err);
    }
    size_t len = ds41_kv_seq_serialized_size(b), written = 0;
    uint8_t *snap = malloc(len);
    size_t slen = ds41_sampler_snapshot_size(sb), swritten = 0;
    uint8_t *ssnap = malloc(slen);
    int src = ds41_kv_seq_serialize(b, snap, len, &written, &err);
    if (src == 0) src = ds41_sampler_snapshot(sb, ssnap, slen, &swritten, &err);
    TAP_CHECK(rc == 0 && src == 0 && written == len && swritten == slen,
              "%s: serialize after %d generated tokens (%zu bytes, size exact)", mode, CUT, len);
    ds41_error e2 = {{0}};
    TAP_CHECK(ds41_kv_seq_serialize(b, snap, len - 1, &written, &e2) == -1 && strstr(e2.msg, "buffer"),
              "%s: a buffer one byte short is refused", mode);
    ds41_kv_seq_free(b);
    ds41_sampler_free(sb);

    ds41_kv_seq *c = NULL;
    ds41_sampler *scs = NULL;
    rc = ds41_kv_seq_deserialize(pool4, snap, len, &c, &err);
    if (rc == 0) rc = ds41_sampler_restore(&scs, ssnap, slen, &err);
    TAP_CHECK(rc == 0 && ds41_kv_seq_tokens(c) == PROMPT + CUT,
              "%s: restore into a pool of 4-entry pages (%s)", mode, rc ? err.msg : "ok");
    if (rc == 0) {
        size_t len2 = ds41_kv_seq_serialized_size(c), w2 = 0;
        uint8_t *snap2 = malloc(len2);
        ds41_kv_seq_serialize(c, snap2, len2, &w2, &err);
        TAP_CHECK(len2 == len && memcmp(snap, snap2, len) == 0,
                  "%s: the restored sequence serializes to the same bytes", mode);
        free(snap2);
        bool same = memcmp(tok, ref_tok, CUT * sizeof *tok) == 0;
        int first_diff = -1;
        for (int k = CUT; k < STEPS && rc == 0; k++) {
            rc = step(scs, sc, logits, &tok[k], &err);
            if (rc == 0) rc = feed(e, c, &tok[k], 1, logits, &err);
            if (rc == 0 && first_diff < 0 &&
                (tok[k] != ref_tok[k] ||
                 memcmp(logits, ref_logits + (size_t)(k + 1) * NV, NV * sizeof(float)) != 0))
                first_diff = k;
        }
        TAP_CHECK(rc == 0 && same && first_diff < 0,
                  "%s: restored session continues bit for bit like the uninterrupted one (%d steps; first "
                  "difference at %d)",
                  mode, STEPS - CUT, first_diff);
    }
    ds41_kv_seq_free(c);
    ds41_sampler_free(scs);

    /* ---- untrusted input ---- */
    char msg[1100];
    bool all = true;
    long long bad_cut = -1;
    for (size_t n = 0; n < len; n += n < 160 ? 1 : 97) {
        ds41_kv_seq *t = NULL;
        ds41_error te = {{0}};
        if (ds41_kv_seq_deserialize(pool, snap, n, &t, &te) == 0 || t || !te.msg[0]) {
            all = false;
            bad_cut = (long long)n;
            ds41_kv_seq_free(t);
            break;
        }
    }
    TAP_CHECK(all, "%s: every truncation is refused with a message (first accepted: %lld)", mode, bad_cut);
    {
        uint8_t *longer = malloc(len + 1);
        memcpy(longer, snap, len);
        longer[len] = 0;
        ds41_kv_seq *t = NULL;
        ds41_error te = {{0}};
        int r = ds41_kv_seq_deserialize(pool, longer, len + 1, &t, &te);
        TAP_CHECK(r == -1 && !t && strstr(te.msg, "bytes, the header describes"),
                  "%s: a trailing byte is refused (%s)", mode, te.msg);
        free(longer);
    }
    TAP_CHECK(mutate_refused(pool, snap, len, 0, 'X', "magic", msg, sizeof msg), "%s: bad magic (%s)", mode,
              msg);
    TAP_CHECK(mutate_refused(pool, snap, len, 8, 2, "version 2", msg, sizeof msg), "%s: other version (%s)",
              mode, msg);
    TAP_CHECK(mutate_refused(pool, snap, len, 12, 9, "kv sources", msg, sizeof msg),
              "%s: other source count (%s)", mode, msg);
    TAP_CHECK(mutate_refused(pool, snap, len, 16 + 4 * 4, 9, "window is 9", msg, sizeof msg),
              "%s: other window (%s)", mode, msg);
    const ds41_kv_layout *l = ds41_kv_pool_layout(pool);
    const size_t tok_off = 16 + 7 * 4 + (size_t)l->n_sources * 4;
    TAP_CHECK(
        mutate_refused(pool, snap, len, tok_off, (uint8_t)(snap[tok_off] + 1), "entries", msg, sizeof msg) ||
            mutate_refused(pool, snap, len, tok_off, (uint8_t)(snap[tok_off] + 1), "bytes", msg, sizeof msg),
        "%s: token count inconsistent with the entries (%s)", mode, msg);
    TAP_CHECK(mutate_refused(pool, snap, len, tok_off + 7, 0x7F, "beyond any context", msg, sizeof msg),
              "%s: absurd token count (%s)", mode, msg);
    const size_t body = tok_off + 8 + (size_t)l->n_sources * 8;
    TAP_CHECK(mutate_refused(pool, snap, len, body + l->latent_dim / 2, 0x7F, "latent scale 0 is NaN", msg,
                             sizeof msg),
              "%s: NaN latent scale (%s)", mode, msg);
    TAP_CHECK(mutate_refused(pool, snap, len, body + l->latent_bytes + l->index_dim / 2, 0xFF,
                             "index-key scale", msg, sizeof msg),
              "%s: NaN index-key scale (%s)", mode, msg);
    /* Scale 2^127: code 1.0 decodes to 1.7e38, code 2.0 to 2^128 = inf. */
    TAP_CHECK(!index_block_refused(pool, snap, len, body, 2, 0xFE, msg, sizeof msg) && !msg[0],
              "%s: an index-key block at 2^127 that stays finite is accepted (%s)", mode, msg);
    TAP_CHECK(index_block_refused(pool, snap, len, body, 4, 0xFE, msg, sizeof msg),
              "%s: an index-key value that overflows float is refused (%s)", mode, msg);
    size_t ent_bytes = 0;
    for (int s = 0; s < l->n_sources; s++)
        ent_bytes += (PROMPT + CUT) / (size_t)l->source_ratio[s] * l->entry_bytes;
    const size_t ring_off = body + ent_bytes;
    TAP_CHECK(
        mutate_refused(pool, snap, len, ring_off + 3, 0xFF, "ring 0 slot 0: value 3 is NaN", msg, sizeof msg),
        "%s: NaN ring value (%s)", mode, msg);
    {
        /* Block 0 of ring 0 slot 0 zero but value 3 = 448, scale 2^127: inf. */
        size_t offs[33];
        uint8_t vals[33];
        for (int i = 0; i < 32; i++) {
            offs[i] = ring_off + (size_t)i;
            vals[i] = i == 3 ? 0x7E : 0;
        }
        offs[32] = ring_off + l->latent_dim;
        vals[32] = 0xFE;
        TAP_CHECK(bytes_refused(pool, snap, len, offs, vals, 33, "ring 0 slot 0: value 3 overflows", msg,
                                sizeof msg),
                  "%s: a ring value that overflows float is refused (%s)", mode, msg);
    }
    const size_t carry_off = ring_off + (size_t)l->n_rings * l->window * l->ring_row_bytes;
    if (l->n_carries > 0) {
        bool ok = mutate_refused(pool, snap, len, carry_off + 3, 0x7F, "carry", msg, sizeof msg);
        /* 0x7F in the top byte of a float with any mantissa gives inf or NaN */
        uint8_t *b2 = malloc(len);
        memcpy(b2, snap, len);
        memset(b2 + carry_off, 0xFF, 4);
        ds41_kv_seq *t = NULL;
        ds41_error te = {{0}};
        ok = ok && ds41_kv_seq_deserialize(pool, b2, len, &t, &te) == -1 && !t;
        free(b2);
        TAP_CHECK(ok, "%s: non-finite carry values are refused (%s)", mode, msg);
    } else {
        TAP_SKIP("%s: no carries in this model", mode);
    }
    const size_t eng_off = len - (8 + 4 * DS41_ENGRAM_MAX_NGRAM);
    TAP_CHECK(mutate_refused(pool, snap, len, eng_off, (uint8_t)(snap[eng_off] + 1), "Engram history has",
                             msg, sizeof msg),
              "%s: Engram position count inconsistent (%s)", mode, msg);
    TAP_CHECK(
        mutate_refused(pool, snap, len, eng_off + 8 + 3, 0x80, "Engram history slot 0", msg, sizeof msg),
        "%s: Engram id below DEAD (%s)", mode, msg);

    /* a short sequence: ring slots beyond the tokens must stay empty */
    {
        ds41_kv_seq *sh = ds41_kv_seq_new(pool, &err);
        feed(e, sh, prompt, 3, logits, &err);
        size_t sl = ds41_kv_seq_serialized_size(sh), sw;
        uint8_t *sb2 = malloc(sl);
        ds41_kv_seq_serialize(sh, sb2, sl, &sw, &err);
        size_t sbody = tok_off + 8 + (size_t)l->n_sources * 8;
        for (int s = 0; s < l->n_sources; s++) sbody += 3 / (size_t)l->source_ratio[s] * l->entry_bytes;
        TAP_CHECK(mutate_refused(pool, sb2, sl, sbody + 5 * l->ring_row_bytes, 1, "beyond the tokens", msg,
                                 sizeof msg),
                  "%s: a written ring slot beyond the tokens is refused (%s)", mode, msg);
        TAP_CHECK(mutate_refused(pool, sb2, sl, sl - 4, 1, "Engram history slot 7", msg, sizeof msg),
                  "%s: an Engram slot beyond the positions must be zero (%s)", mode, msg);
        free(sb2);
        ds41_kv_seq_free(sh);
    }

    /* a pool too small for the snapshot: KV cache full, nothing kept */
    {
        ds41_kv_pool *small = ds41_engine_new_pool(e, (uint64_t)l->page_bytes * 1, 0, &err);
        ds41_kv_seq *t = NULL;
        ds41_error te = {{0}};
        int r = small ? ds41_kv_seq_deserialize(small, snap, len, &t, &te) : 0;
        ds41_kv_pool_stats ps = {0};
        if (small) ds41_kv_pool_get_stats(small, &ps);
        TAP_CHECK(r == -1 && !t && strstr(te.msg, "KV cache full") && ps.pages_in_use == 0 &&
                      ps.sequences == 0,
                  "%s: a pool without room refuses and keeps nothing (%s)", mode, te.msg);
        ds41_kv_pool_free(small);
    }

    free(snap);
    free(ssnap);
    free(ref_logits);
    free(logits);
    ds41_kv_seq_free(a);
    ds41_sampler_free(sa);
    ds41_sampler_scratch_free(sc);
    ds41_kv_pool_free(pool);
    ds41_kv_pool_free(pool4);
    ds41_engine_free(e);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    char root[512];
    snprintf(root, sizeof root, "%s/ds41-kvsnap-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root)) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    char dir[600];
    snprintf(dir, sizeof dir, "%s/tiny", root);
    ds41_error err = {{0}};
    ds41_model_gen_opts mo = {.preset = "tiny", .seed = 3};
    if (TAP_CHECK(ds41_model_generate(dir, &mo, NULL, &err) == 0, "tiny checkpoint (%s)",
                  err.msg[0] ? err.msg : "ok")) {
        run_mode(dir, false);
        run_mode(dir, true);
    }
    tmpdir_remove(root);
    return tap_done();
}
