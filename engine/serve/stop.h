/* When generation ends: stop strings matched on the streamed text, and stop token ids, EOS and
 * max_tokens on the sampled ids.
 *
 * Stop strings (OpenAI `stop`): the matcher is fed the detokenized text piece by piece as it
 * streams and says how many bytes are safe to send to the client now.  It holds back only the
 * longest suffix of the text that is still the beginning of some stop string (KMP automata, one
 * per stop string, so the work is linear in the text however long the stop strings are).  When a
 * stop string completes, the text from its first byte on is never emitted, and neither is
 * anything fed after it.
 *
 * Which stop wins is defined on the whole text, so it never depends on how the text was cut into
 * pieces: the match is the one that COMPLETES first (smallest end offset); among stop strings
 * completing at the same byte, the longest (it starts earliest) wins, then the lowest index.  The
 * emitted text is everything before that match's start.
 *
 * UTF-8: stop strings must be valid UTF-8.  Pieces are expected to be whole UTF-8 sequences (the
 * streaming detokenizer guarantees it); in any case the matcher never ends an emitted chunk inside
 * a multi-byte sequence it can see: when the held-back suffix would start on a continuation byte,
 * up to three more bytes are held so the sequence leaves in one piece.  Bytes themselves are never
 * altered or dropped (invalid input passes through as is). */
#ifndef DS41_ENGINE_STOP_H
#define DS41_ENGINE_STOP_H

#include <stddef.h>
#include <stdint.h>

#include "config/error.h"

/* Most stop strings (OpenAI accepts 4) and their total length. */
#define DS41_STOP_MAX_STRINGS 64u
#define DS41_STOP_MAX_TOTAL_BYTES (64u * 1024u)

typedef struct ds41_stop_matcher ds41_stop_matcher;

typedef struct ds41_stop_output {
    const char *text; /* bytes safe to emit now (never NULL, not NUL-terminated); owned by the matcher, valid
                         until the next call on it */
    size_t len;
    int stopped;    /* 1 once a stop string has completed: generation is over */
    int stop_index; /* that stop string's index in the list given at creation, else -1 */
} ds41_stop_output;

/* Creates a matcher for n stop strings stops[i] of lens[i] bytes (copied; may contain NUL).
 * n == 0 gives a matcher that passes everything through.  Errors: more than
 * DS41_STOP_MAX_STRINGS strings or DS41_STOP_MAX_TOTAL_BYTES bytes, an empty string, invalid
 * UTF-8 (the message names the string's index), out of memory.  *out is NULL on error. */
int ds41_stop_matcher_new(ds41_stop_matcher **out, const char *const *stops, const size_t *lens, size_t n,
                          ds41_error *err);
void ds41_stop_matcher_free(ds41_stop_matcher *m);

/* Forgets all text for a new generation with the same stop strings. */
void ds41_stop_matcher_reset(ds41_stop_matcher *m);

/* Appends piece[len] to the text and fills *out with what may be emitted now (possibly nothing,
 * possibly held bytes of earlier pieces too).  Once stopped, further pieces are ignored (out is
 * empty and stopped).  Errors: piece NULL with len > 0, out of memory (nothing is consumed). */
int ds41_stop_matcher_feed(ds41_stop_matcher *m, const char *piece, size_t len, ds41_stop_output *out,
                           ds41_error *err);

/* Generation ended for another reason (EOS, stop token, max_tokens): releases the held-back bytes,
 * which can no longer become a stop string.  After a stop, out is empty.  Further feeds are ignored
 * until ds41_stop_matcher_reset. */
void ds41_stop_matcher_finish(ds41_stop_matcher *m, ds41_stop_output *out);

/* Bytes currently held back. */
size_t ds41_stop_matcher_held(const ds41_stop_matcher *m);

/* ---------------------------------------------------------------------------------------------
 * Token-level limits.  Sampled ids are checked in order:
 *   - an EOS id or a stop token id ends generation; its text is NOT emitted (REFERENCE §4: the
 *     output is cut at the first EOS, EOS excluded; vLLM treats stop_token_ids the same way);
 *   - any other token is emitted, and when it is the max_tokens-th sampled token, generation ends
 *     with reason "length" (max_tokens 0 = no limit here; the context limit is the caller's).
 * Every sampled token counts toward max_tokens and n_sampled, the final EOS / stop id included
 * (it was generated: OpenAI's completion_tokens counts it). */
#define DS41_GEN_MAX_EOS 8u
#define DS41_GEN_MAX_STOP_IDS 256u

typedef enum ds41_gen_verdict {
    DS41_GEN_CONTINUE = 0, /* emit the token, keep going */
    DS41_GEN_LENGTH,       /* emit the token, then stop: max_tokens reached (finish_reason "length") */
    DS41_GEN_EOS,          /* do not emit; stop (finish_reason "stop") */
    DS41_GEN_STOP_TOKEN,   /* do not emit; stop on a stop token id (finish_reason "stop") */
} ds41_gen_verdict;

typedef struct ds41_gen_limits {
    uint32_t max_tokens; /* 0 = unlimited */
    uint32_t n_sampled;  /* tokens checked so far */
    uint32_t n_eos;
    uint32_t eos_ids[DS41_GEN_MAX_EOS];
    uint32_t n_stop_ids;
    uint32_t stop_ids[DS41_GEN_MAX_STOP_IDS]; /* sorted ascending, distinct */
    ds41_gen_verdict final_verdict;           /* CONTINUE until a stopping verdict was returned */
} ds41_gen_limits;

/* Fills *lim.  eos_ids[n_eos] (the tokenizer's EOS, e.g. id 1 for V4.1) and stop_ids[n_stop] may
 * overlap and repeat; stop_ids are kept sorted.  Errors: too many ids, NULL arrays with n > 0. */
int ds41_gen_limits_init(ds41_gen_limits *lim, uint32_t max_tokens, const uint32_t *eos_ids, uint32_t n_eos,
                         const uint32_t *stop_ids, uint32_t n_stop, ds41_error *err);

/* Checks the next sampled token (see above).  Callers stop at the first verdict other than
 * CONTINUE; a call after that counts nothing and returns the same verdict again. */
ds41_gen_verdict ds41_gen_limits_step(ds41_gen_limits *lim, uint32_t token);

/* 1 when the verdict means the token's text is emitted (CONTINUE, LENGTH). */
int ds41_gen_verdict_emits(ds41_gen_verdict v);

#endif
