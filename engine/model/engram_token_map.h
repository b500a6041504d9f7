/* Engram compressed token map (REFERENCE.md §6.1).
 *
 * Every tokenizer id gets a compressed id: ids whose decoded text normalises to the same key
 * share one.  Key of an id, from its lossy-decoded text (what `tokenizers` returns for
 * decode([id], skip_special_tokens=false)) and its raw vocabulary string:
 *   - text contains U+FFFD (a partial UTF-8 byte token): key = the raw vocabulary string;
 *   - else key = normalize(text), or text itself when that is empty.
 * normalize = NFKC -> NFD and drop every combining mark (general category M*) -> lowercase each
 * code point -> runs of [ \t\r\n]+ become one space -> a string that is exactly " " becomes
 * U+E000 -> strip Unicode White_Space at both ends -> U+E000 becomes " ".
 * Compressed ids are 0, 1, 2, ... in order of first appearance scanning ids upward.
 *
 * Unicode tables are utf8proc's (NFKC = COMPAT|COMPOSE, NFD with STRIPMARK, utf8proc_tolower;
 * the simple lowercase equals Rust's full char::to_lowercase here because U+0130, the only
 * character whose full lowercase differs, never survives the mark stripping).  The module does
 * not know the tokenizer: ids come through a callback. */
#ifndef DS41_ENGINE_ENGRAM_TOKEN_MAP_H
#define DS41_ENGINE_ENGRAM_TOKEN_MAP_H

#include <stddef.h>
#include <stdint.h>

#include "config/error.h"

/* The released DeepSeek-V4.1-Flash tokenizer (129,280 ids) gives 99,092 compressed ids and a
 * map whose ds41_engram_token_map_digest() is this (a load-time check for the release). */
#define DS41_ENGRAM_V41_TOKEN_IDS 129280u
#define DS41_ENGRAM_V41_COMPRESSED_IDS 99092u
#define DS41_ENGRAM_V41_TOKEN_MAP_SHA256 "de40bcdd71f24430ba82752ef385093be962adbf845a1c97db39161597d5dc28"

/* Limits on untrusted input. */
#define DS41_ENGRAM_MAX_TOKEN_IDS (1u << 24)
#define DS41_ENGRAM_MAX_TOKEN_BYTES ((size_t)1 << 20)

/* Supplies one id to ds41_engram_token_map_build.
 *   *text, *text_len: the id's lossy-decoded UTF-8 text (Rust String::from_utf8_lossy of the
 *       byte-level decoded bytes; may contain NUL bytes).  Heap memory: ownership passes to the
 *       builder, which releases it with free() (NULL is allowed when *text_len is 0).
 *   *raw, *raw_len: the id's raw vocabulary string (tokenizers' id_to_token), any bytes;
 *       borrowed, must stay valid until the callback is called again or the build returns.
 * Returns 0, or -1 with err filled (the build then fails with that message). */
typedef int (*ds41_engram_text_fn)(void *ctx, uint32_t id, char **text, size_t *text_len, const char **raw,
                                   size_t *raw_len, ds41_error *err);

/* normalize() above on UTF-8 input text[len] (NUL bytes allowed).  On success *out is a new
 * NUL-terminated heap string (release with free()) of *out_len bytes (not counting the NUL).
 * Errors: invalid UTF-8, len > DS41_ENGRAM_MAX_TOKEN_BYTES, out of memory. */
int ds41_engram_normalize(const char *text, size_t len, char **out, size_t *out_len, ds41_error *err);

/* The map key of one id (see the top of this file).  *key is a new NUL-terminated heap string of
 * *key_len bytes (free()).  raw may be NULL only when raw_len is 0.  Errors as for
 * ds41_engram_normalize (raw is used as bytes and never validated). */
int ds41_engram_token_key(const char *text, size_t text_len, const char *raw, size_t raw_len, char **key,
                          size_t *key_len, ds41_error *err);

/* Builds the map for ids 0..n_ids-1 into map_out[n_ids] and stores the number of distinct keys
 * in *n_compressed.  n_ids must be 1..DS41_ENGRAM_MAX_TOKEN_IDS.  Errors (callback failure,
 * invalid UTF-8 text, oversized text, out of memory) name the token id; map_out is then
 * partly written and must not be used.  Temporary memory is about the size of the keys. */
int ds41_engram_token_map_build(uint32_t n_ids, ds41_engram_text_fn get_text, void *ctx, int32_t *map_out,
                                uint32_t *n_compressed, ds41_error *err);

/* SHA-256 of the map written as ASCII "[m0, m1, ..., mN-1]" (decimal ids joined by ", ",
 * no trailing newline; Python json.dumps(list)), the format of the published digest above.
 * Returns -1 (and leaves out untouched) if map is NULL while n > 0. */
int ds41_engram_token_map_digest(const int32_t *map, uint32_t n, uint8_t out[32]);

#endif
