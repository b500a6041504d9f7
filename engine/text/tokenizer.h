/* ds41_tokenizer: text -> ids and ids -> text for Hugging Face byte-level BPE
 * `tokenizer.json` models (DeepSeek-V4.1 and the synthetic ones of
 * engine/text/synth_tokenizer.h), id for id what Hugging Face `tokenizers`
 * (0.22, Rust, through @anush008/tokenizers@0.6.0) gives for
 * `encode(text, add_special_tokens=false)` and `decode(ids, skip_special)`.
 *
 * Encoding (REFERENCE §5), in Hugging Face's order:
 *   1. Added tokens are cut out first, leftmost-longest (a trie walk from each
 *      position; the first position with any match wins, and the longest
 *      token starting there), non-overlapping, the search going on after the
 *      end of each match.  As in HF there are two passes: tokens with
 *      normalized=false on the raw text, then tokens with normalized=true on
 *      each remaining piece (the normalizer must be the identity, so that is
 *      the same text).  Flags as HF's AddedVocabulary::find_matches:
 *      single_word drops a match that touches a word character (Rust regex
 *      \w: Alphabetic, M, Nd, Pc, Join_Control) on either side (the search
 *      still goes on after it); lstrip widens the match leftwards over
 *      Unicode White_Space, but not into the previous match; rstrip widens
 *      it rightwards, and the search goes on from the unwidened end (so a
 *      following token may overlap the stripped spaces, both are emitted).
 *   2. The pre-tokenizer: a Sequence of Split steps (Regex or String
 *      pattern; behaviors Removed / Isolated / MergedWithPrevious /
 *      MergedWithNext / Contiguous; invert) followed by one ByteLevel step
 *      (add_prefix_space: a space is put before every piece that does not
 *      start with one; use_regex: the GPT-2 split, Isolated).  Each step runs
 *      on every piece separately, empty pieces vanish.
 *   3. Each piece's bytes map to the GPT-2 byte alphabet and BPE merges them,
 *      lowest merge rank first (leftmost among equal ranks), with a binary
 *      heap over a linked symbol list: O(n log n) in the piece length.  With
 *      model.ignore_merges a piece that is a model.vocab entry as a whole is
 *      that token.
 *   Not applied: the post_processor (with add_special_tokens=false none of
 *   HF's processors adds a token); BOS is the caller's business.
 *
 * Regexes.  Hugging Face compiles Split patterns with Oniguruma (Oniguruma
 * syntax: `$`/`^` are line anchors, (?m) means dot-all, \h is a hex digit,
 * \uHHHH, {,n}); ds41 translates them to PCRE2 (UTF, UCP, JIT) and gives every
 * class the meaning Oniguruma gives it, from its own Unicode 16.0 tables
 * (engine/text/unicode_tables.h) rather than PCRE2's: \s = White_Space; \d =
 * Nd; \w = Alphabetic|M|Nd|Pc, outside brackets also the Latin-1 digits
 * ² ³ ¹ ¼ ½ ¾ (an Oniguruma quirk); \b/\B on that \w; \p{..} / \P{..} /
 * \p{^..} with a general category (one or two letters or the long name,
 * any case, spaces/underscores/hyphens ignored), Alphabetic or White_Space.
 * Other property names (scripts, ...) are passed to PCRE2 and use its
 * Unicode tables.  Refused with a message naming the construct: nested
 * classes and class set operations (&&), POSIX brackets, {n}? (Oniguruma's
 * optional fixed repeat), absent groups (?~..), callouts, (*VERB)s, \O \y
 * \Y and other escapes PCRE2 reads differently.  Matches are enumerated as
 * the onig crate's find_iter does: after a match ending at e, an empty match
 * at e is skipped and the search restarts one character later.
 *
 * Input text.  Hugging Face takes Rust strings, so its input is valid UTF-8.
 * ds41 accepts any bytes and first replaces each maximal invalid subpart by
 * U+FFFD (as String::from_utf8_lossy, which is what a client's bytes would
 * become on their way into HF), so encoding never fails on the text itself.
 *
 * Decoding: every id's string (the added token's content for added ids,
 * else the model.vocab string) through the ByteLevel decoder
 * (ds41_vocab_decode_id), concatenated, made valid UTF-8 as from_utf8_lossy
 * does.  Ids that are holes or >= the vocabulary size are skipped, as HF's
 * decode skips ids it cannot name; skip_special drops added tokens marked
 * special (and only those: V4.1's <｜System｜> and <|EOT|> are not special).
 *
 * Streaming (ds41_detok): the same text, given back a token at a time,
 * never cutting a UTF-8 sequence: bytes that may still become a valid
 * character are held back; a sequence that can no longer become valid
 * (Unicode's maximal subpart) is emitted as one U+FFFD as soon as the byte
 * that rules it out arrives; ds41_detok_finish turns a held incomplete tail
 * into one U+FFFD.  The concatenation of everything it emits equals
 * ds41_tokenizer_decode of the same ids.
 *
 * Refused at load (ds41_tokenizer_new), with a message naming the component:
 * a normalizer other than an empty one, a pre_tokenizer step other than Split
 * / ByteLevel / Sequence, no ByteLevel step or more than one, a Split after
 * ByteLevel, a regex the translation above refuses or PCRE2 cannot compile,
 * a model.vocab without all 256 byte tokens (HF would then need unk_token or
 * drop bytes).  The model type, dropout, byte_fallback and the decoder are
 * checked by engine/text/vocab.h.
 *
 * Thread safety: a tokenizer is immutable after ds41_tokenizer_new; encode and
 * decode may run concurrently on it (each call has its own scratch).  A
 * ds41_detok belongs to one thread at a time. */
#ifndef DS41_ENGINE_TOKENIZER_H
#define DS41_ENGINE_TOKENIZER_H

#include "config/error.h"
#include "engine/text/vocab.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ds41_tokenizer ds41_tokenizer;

/* A growable array of token ids (zero-initialise it; free with
 * ds41_token_ids_free). */
typedef struct ds41_token_ids {
    uint32_t *ids;
    size_t n, cap;
} ds41_token_ids;

void ds41_token_ids_free(ds41_token_ids *ids);

/* ---- building ------------------------------------------------------------ */

/* A tokenizer over VOCAB, which it borrows: VOCAB must outlive it.  Returns
 * NULL with err filled ("pre_tokenizer.pretokenizers[1].pattern: ...") when a
 * component is not supported (see above; also more than 64 Split steps) or
 * memory runs out.  Builds the merge table, the added-token tries,
 * the decode table and compiles (and JIT-compiles) the regexes. */
ds41_tokenizer *ds41_tokenizer_new(const ds41_vocab *vocab, ds41_error *err);

/* Load PATH (a tokenizer.json) and build a tokenizer that owns the
 * vocabulary; errors start with PATH. */
ds41_tokenizer *ds41_tokenizer_load(const char *path, ds41_error *err);

/* NULL is allowed.  Frees the vocabulary only if the tokenizer owns it. */
void ds41_tokenizer_free(ds41_tokenizer *t);

const ds41_vocab *ds41_tokenizer_vocab(const ds41_tokenizer *t);

/* ---- encoding -------------------------------------------------------------- */

/* Append the ids of TEXT (LEN bytes, any bytes, need not be NUL-terminated;
 * NULL allowed when LEN is 0) to OUT.  Returns 0, or -1 with err filled when
 * memory runs out or a regex match fails (PCRE2's match or stack limits; the
 * message names the pre-tokenizer step); OUT then holds what it held before
 * (its n is restored). */
int ds41_tokenizer_encode(const ds41_tokenizer *t, const char *text, size_t len, ds41_token_ids *out,
                          ds41_error *err);

/* ---- decoding -------------------------------------------------------------- */

/* The bytes of one id after the ByteLevel decoder (not yet made valid
 * UTF-8), owned by the tokenizer, length in *len; NULL (and *len 0) for a
 * hole or an id >= the vocabulary size. */
const uint8_t *ds41_tokenizer_token_bytes(const ds41_tokenizer *t, uint32_t id, size_t *len);

/* The ids of the tokens that are not special and have bytes, sorted by their bytes (shorter
 * first on a common prefix), *n of them; lcp[i] is how many leading bytes token i shares with
 * token i - 1 (lcp[0] = 0).  Walking this order walks the vocabulary's byte trie. */
const uint32_t *ds41_tokenizer_byte_order(const ds41_tokenizer *t, const uint32_t **lcp, size_t *n);

/* Whether ID is an added token marked special (what skip_special drops). */
bool ds41_tokenizer_is_special(const ds41_tokenizer *t, uint32_t id);

/* HF's decode(ids, skip_special): a malloc'd NUL-terminated valid UTF-8
 * string (the caller frees it), its length in *out_len (if not NULL).  NULL
 * only when memory runs out.  IDS may be NULL when N is 0. */
char *ds41_tokenizer_decode(const ds41_tokenizer *t, const uint32_t *ids, size_t n, bool skip_special,
                            size_t *out_len);

/* ---- streaming decoder ------------------------------------------------------ */

typedef struct ds41_detok ds41_detok;

/* A streaming decoder over T (borrowed; must outlive it).  NULL when memory
 * runs out. */
ds41_detok *ds41_detok_new(const ds41_tokenizer *t, bool skip_special);
void ds41_detok_free(ds41_detok *d);

/* Feed one id.  Returns 0 and sets *text / *len to the text that is now
 * complete (valid UTF-8, possibly empty, not NUL-terminated), owned by the
 * decoder and valid until its next call; -1 when memory runs out (the id is
 * then not consumed).  Ids that decode() would skip give "". */
int ds41_detok_push(ds41_detok *d, uint32_t id, const char **text, size_t *len);

/* End of stream: the held-back tail, as U+FFFD if there is one (else "").
 * The decoder is then empty and may be reused.  Returns 0. */
int ds41_detok_finish(ds41_detok *d, const char **text, size_t *len);

/* Bytes currently held back (0..3). */
size_t ds41_detok_pending(const ds41_detok *d);

/* ---- helpers (exposed for tests) -------------------------------------------- */

/* Translate an Oniguruma-syntax pattern (LEN bytes) to the PCRE2 pattern
 * ds41 compiles (see "Regexes" above).  Returns a malloc'd NUL-terminated
 * string, or NULL with err naming the construct that is refused. */
char *ds41_tokenizer_translate_regex(const char *pattern, size_t len, ds41_error *err);

#endif
