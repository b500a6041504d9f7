/* Stop strings and token-level generation limits (see stop.h for the exact rules). */
#include "engine/serve/stop.h"

#include "config/utf8.h"

#include <stdlib.h>
#include <string.h>

typedef struct stop_string {
    unsigned char *bytes;
    size_t len;
    size_t *fallback; /* KMP: fallback[q] = longest proper border of bytes[0..q] */
} stop_string;

struct ds41_stop_matcher {
    stop_string *stops;
    size_t n_stops;
    size_t *matched;    /* per stop: length of the longest suffix of the text that is its prefix */
    unsigned char *buf; /* text not yet handed out: buf[returned..len) */
    size_t len, cap;
    size_t returned; /* bytes of buf handed out by the last call (dropped at the next) */
    int stopped, stop_index, finished;
};

int ds41_stop_matcher_new(ds41_stop_matcher **out, const char *const *stops, const size_t *lens, size_t n,
                          ds41_error *err) {
    if (!out) return ds41_fail(err, "stop strings: no output pointer");
    *out = NULL;
    if (n > DS41_STOP_MAX_STRINGS)
        return ds41_fail(err, "stop strings: %zu given, at most %u are accepted", n, DS41_STOP_MAX_STRINGS);
    if (n > 0 && (!stops || !lens)) return ds41_fail(err, "stop strings: %zu announced but no array", n);
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (lens[i] == 0) return ds41_fail(err, "stop strings: string %zu is empty", i);
        if (!stops[i]) return ds41_fail(err, "stop strings: string %zu is NULL", i);
        if (lens[i] > DS41_STOP_MAX_TOTAL_BYTES - total)
            return ds41_fail(err, "stop strings: more than %u bytes in total (at string %zu)",
                             DS41_STOP_MAX_TOTAL_BYTES, i);
        total += lens[i];
        if (!ds41_utf8_valid(stops[i], lens[i], NULL))
            return ds41_fail(err, "stop strings: string %zu is not valid UTF-8", i);
    }
    ds41_stop_matcher *m = calloc(1, sizeof *m);
    if (!m) return ds41_fail(err, "stop strings: out of memory");
    m->stop_index = -1;
    if (n > 0) {
        m->stops = calloc(n, sizeof *m->stops);
        m->matched = calloc(n, sizeof *m->matched);
        if (!m->stops || !m->matched) goto oom;
    }
    m->n_stops = n;
    for (size_t i = 0; i < n; i++) {
        stop_string *s = &m->stops[i];
        s->len = lens[i];
        s->bytes = malloc(lens[i]);
        s->fallback = malloc(lens[i] * sizeof *s->fallback);
        if (!s->bytes || !s->fallback) goto oom;
        memcpy(s->bytes, stops[i], lens[i]);
        /* prefix function */
        s->fallback[0] = 0;
        for (size_t q = 1, k = 0; q < s->len; q++) {
            while (k > 0 && s->bytes[q] != s->bytes[k]) k = s->fallback[k - 1];
            if (s->bytes[q] == s->bytes[k]) k++;
            s->fallback[q] = k;
        }
    }
    *out = m;
    return 0;
oom:
    ds41_stop_matcher_free(m);
    return ds41_fail(err, "stop strings: out of memory");
}

void ds41_stop_matcher_free(ds41_stop_matcher *m) {
    if (!m) return;
    for (size_t i = 0; m->stops && i < m->n_stops; i++) {
        free(m->stops[i].bytes);
        free(m->stops[i].fallback);
    }
    free(m->stops);
    free(m->matched);
    free(m->buf);
    free(m);
}

void ds41_stop_matcher_reset(ds41_stop_matcher *m) {
    for (size_t i = 0; i < m->n_stops; i++) m->matched[i] = 0;
    m->len = 0;
    m->returned = 0;
    m->stopped = 0;
    m->stop_index = -1;
    m->finished = 0;
}

size_t ds41_stop_matcher_held(const ds41_stop_matcher *m) {
    return m->len - m->returned;
}

/* Drops the bytes handed out by the previous call. */
static void drop_returned(ds41_stop_matcher *m) {
    if (m->returned == 0) return;
    memmove(m->buf, m->buf + m->returned, m->len - m->returned);
    m->len -= m->returned;
    m->returned = 0;
}

static void set_output(ds41_stop_matcher *m, size_t n, ds41_stop_output *out) {
    m->returned = n;
    out->text = m->buf ? (const char *)m->buf : ""; /* never NULL, so callers may memcpy from it */
    out->len = n;
    out->stopped = m->stopped;
    out->stop_index = m->stop_index;
}

/* Bytes a UTF-8 sequence starting with lead byte b claims (1 for ASCII and for bytes that cannot
 * start a sequence: those pass through unchanged). */
static size_t sequence_length(unsigned char b) {
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 1;
}

/* Moves an emit boundary b (<= m->len) back so it does not cut the UTF-8 sequence that holds byte
 * b-1: when that sequence's lead byte (at most 3 bytes back) claims bytes at or after b. */
static size_t utf8_boundary(const ds41_stop_matcher *m, size_t b) {
    if (b == 0) return 0;
    size_t i = b - 1;
    while (i > 0 && b - i < 4 && (m->buf[i] & 0xC0) == 0x80) i--;
    return i + sequence_length(m->buf[i]) > b ? i : b;
}

int ds41_stop_matcher_feed(ds41_stop_matcher *m, const char *piece, size_t len, ds41_stop_output *out,
                           ds41_error *err) {
    if (!out) return ds41_fail(err, "stop strings: no output");
    if (!piece && len > 0) return ds41_fail(err, "stop strings: piece of %zu bytes is NULL", len);
    drop_returned(m);
    if (m->stopped || m->finished) {
        set_output(m, 0, out);
        return 0;
    }
    if (len > m->cap - m->len) {
        if (len > SIZE_MAX / 2 - m->len)
            return ds41_fail(err, "stop strings: piece of %zu bytes is too long", len);
        size_t cap = m->cap ? m->cap : 64;
        while (cap < m->len + len) cap *= 2;
        unsigned char *buf = realloc(m->buf, cap);
        if (!buf) return ds41_fail(err, "stop strings: out of memory for a %zu-byte piece", len);
        m->buf = buf;
        m->cap = cap;
    }
    if (len > 0) memcpy(m->buf + m->len, piece, len);
    const size_t old_len = m->len;
    m->len += len;

    for (size_t at = old_len; at < m->len; at++) {
        const unsigned char c = m->buf[at];
        size_t best_len = 0;
        int best = -1;
        for (size_t i = 0; i < m->n_stops; i++) {
            const stop_string *s = &m->stops[i];
            size_t q = m->matched[i];
            while (q > 0 && s->bytes[q] != c) q = s->fallback[q - 1];
            if (s->bytes[q] == c) q++;
            if (q == s->len) {
                if (s->len > best_len) {
                    best_len = s->len;
                    best = (int)i;
                }
                q = s->fallback[q - 1];
            }
            m->matched[i] = q;
        }
        if (best >= 0) {
            /* the match starts inside buf (its earlier bytes were held back as a partial match),
             * so buf[0, start) is exactly the text still to emit */
            m->stopped = 1;
            m->stop_index = best;
            set_output(m, at + 1 - best_len, out);
            m->len = m->returned; /* the stop string and anything after it are gone */
            return 0;
        }
    }

    size_t hold = 0;
    for (size_t i = 0; i < m->n_stops; i++)
        if (m->matched[i] > hold) hold = m->matched[i];
    set_output(m, utf8_boundary(m, m->len - hold), out);
    return 0;
}

void ds41_stop_matcher_finish(ds41_stop_matcher *m, ds41_stop_output *out) {
    drop_returned(m);
    if (m->stopped || m->finished) {
        set_output(m, 0, out);
        return;
    }
    m->finished = 1;
    set_output(m, m->len, out);
}

/* --------------------------------------------------------------------------------------------- */

static int cmp_u32(const void *a, const void *b) {
    const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

int ds41_gen_limits_init(ds41_gen_limits *lim, uint32_t max_tokens, const uint32_t *eos_ids, uint32_t n_eos,
                         const uint32_t *stop_ids, uint32_t n_stop, ds41_error *err) {
    if (!lim) return ds41_fail(err, "generation limits: no output");
    if (n_eos > DS41_GEN_MAX_EOS)
        return ds41_fail(err, "generation limits: %u EOS ids, at most %u are accepted", n_eos,
                         DS41_GEN_MAX_EOS);
    if (n_stop > DS41_GEN_MAX_STOP_IDS)
        return ds41_fail(err, "generation limits: %u stop token ids, at most %u are accepted", n_stop,
                         DS41_GEN_MAX_STOP_IDS);
    if ((n_eos > 0 && !eos_ids) || (n_stop > 0 && !stop_ids))
        return ds41_fail(err, "generation limits: ids announced but no array");
    memset(lim, 0, sizeof *lim);
    lim->max_tokens = max_tokens;
    lim->n_eos = n_eos;
    if (n_eos > 0) memcpy(lim->eos_ids, eos_ids, n_eos * sizeof *eos_ids);
    uint32_t sorted[DS41_GEN_MAX_STOP_IDS];
    if (n_stop > 0) memcpy(sorted, stop_ids, n_stop * sizeof *stop_ids);
    qsort(sorted, n_stop, sizeof sorted[0], cmp_u32);
    for (uint32_t i = 0; i < n_stop; i++)
        if (i == 0 || sorted[i] != sorted[i - 1]) lim->stop_ids[lim->n_stop_ids++] = sorted[i];
    lim->final_verdict = DS41_GEN_CONTINUE;
    return 0;
}

static int is_stop_id(const ds41_gen_limits *lim, uint32_t token) {
    size_t lo = 0, hi = lim->n_stop_ids;
    while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        if (lim->stop_ids[mid] == token) return 1;
        if (lim->stop_ids[mid] < token)
            lo = mid + 1;
        else
            hi = mid;
    }
    return 0;
}

ds41_gen_verdict ds41_gen_limits_step(ds41_gen_limits *lim, uint32_t token) {
    if (lim->final_verdict != DS41_GEN_CONTINUE) return lim->final_verdict;
    if (lim->n_sampled < UINT32_MAX) lim->n_sampled++;
    ds41_gen_verdict v = DS41_GEN_CONTINUE;
    for (uint32_t i = 0; i < lim->n_eos && v == DS41_GEN_CONTINUE; i++)
        if (lim->eos_ids[i] == token) v = DS41_GEN_EOS;
    if (v == DS41_GEN_CONTINUE && is_stop_id(lim, token)) v = DS41_GEN_STOP_TOKEN;
    if (v == DS41_GEN_CONTINUE && lim->max_tokens > 0 && lim->n_sampled >= lim->max_tokens)
        v = DS41_GEN_LENGTH;
    lim->final_verdict = v;
    return v;
}

int ds41_gen_verdict_emits(ds41_gen_verdict v) {
    return v == DS41_GEN_CONTINUE || v == DS41_GEN_LENGTH;
}
