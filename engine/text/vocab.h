/* ds41_vocab: a Hugging Face byte-level BPE `tokenizer.json`, loaded and
 * checked, with the single-id byte-level decoder that REFERENCE §5/§6.1 need.
 *
 * What is kept from the file:
 *   - model.vocab (string -> id) and model.merges (in file order = rank order,
 *     each resolved to left id, right id, merged id);
 *   - added_tokens (id, content, flags), in file order;
 *   - normalizer, pre_tokenizer, post_processor and decoder as compact JSON
 *     text, plus the pre-tokenizer's Split patterns and ByteLevel flags (the
 *     encoder, a later module, interprets them);
 *   - from tokenizer_config.json (optional): bos/eos/pad ids, add_bos/add_eos,
 *     model_max_length.
 *
 * Ids.  The vocabulary size is max id + 1 over model.vocab and added_tokens;
 * ids below it that nothing names are holes (allowed, counted by
 * ds41_vocab_n_tokens).  Hugging Face `tokenizers` does not trust the "id"
 * field of added_tokens: on load it assigns each added token the id of the
 * same string in model.vocab if there is one, otherwise the next id after
 * max(len(model.vocab), largest added id so far) - and only warns when the
 * file disagrees.  A file whose ids disagree would therefore mean different
 * things to HF and to ds41, so ds41 rejects it ("added_tokens[i].id").  When
 * HF's rule puts an added token on an id that model.vocab also uses for a
 * different string (possible only when model.vocab has holes), the added
 * token wins for id -> string and decoding, exactly as in HF
 * (`Tokenizer::decode` asks the added vocabulary first); the model string
 * still maps to that id in ds41_vocab_find, as in HF's token_to_id.
 *
 * Decoding one id (HF's ByteLevel decoder, `decode([id])`): the token string
 * (the added token's content for added ids, else the model.vocab string) is
 * read as Unicode characters; if every character is in the GPT-2 byte
 * alphabet, each maps back to its byte; if any character is outside it, the
 * whole string's UTF-8 bytes are used unchanged.  That rule applies to added
 * tokens too (an added token "Ġx" decodes to " x"; DeepSeek's added tokens are
 * ASCII or use U+FF5C/U+2581, so they decode to their content).  The text
 * form replaces invalid UTF-8 like Rust's String::from_utf8_lossy (one U+FFFD
 * per maximal invalid subpart), which is what HF returns.
 *
 * Errors name the file (the label) and the field, e.g.
 *   "tokenizer.json: model.merges[17]: 'Ġq' is not in model.vocab".
 *
 * Thread safety: a loaded vocabulary is immutable (except through
 * ds41_vocab_load_config/ds41_vocab_parse_config, which must not race with
 * readers); all const functions may be called concurrently. */
#ifndef DS41_ENGINE_VOCAB_H
#define DS41_ENGINE_VOCAB_H

#include "config/error.h"
#include "config/utf8.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Ids must be below this (4,194,304): far above any released vocabulary
 * (DeepSeek 129,280; the largest common ones ~262k), low enough that a hostile
 * file cannot make the per-id tables huge. */
#define DS41_VOCAB_MAX_IDS (1u << 22)
/* tokenizer.json files larger than this are refused (the real one is 6.3 MB). */
#define DS41_VOCAB_MAX_FILE_BYTES ((size_t)1 << 30)

typedef struct ds41_vocab ds41_vocab;

typedef struct ds41_added_token {
    uint32_t id;
    const char *content; /* UTF-8, NUL-terminated, owned by the vocabulary */
    size_t content_len;
    bool single_word, lstrip, rstrip, normalized, special;
} ds41_added_token;

typedef struct ds41_merge {
    uint32_t left, right, merged; /* model.vocab ids; rank = index in the array */
} ds41_merge;

/* One Split step of the pre-tokenizer (in the order they run). */
typedef struct ds41_vocab_split {
    const char *pattern; /* NUL-terminated, owned by the vocabulary */
    size_t pattern_len;
    bool is_regex;        /* pattern was {"Regex": ...}; else {"String": ...} */
    const char *behavior; /* "Isolated", "Removed", "MergedWithPrevious", ... */
    bool invert;
} ds41_vocab_split;

typedef enum ds41_vocab_component {
    DS41_VOCAB_NORMALIZER,
    DS41_VOCAB_PRE_TOKENIZER,
    DS41_VOCAB_POST_PROCESSOR,
    DS41_VOCAB_DECODER,
} ds41_vocab_component;

/* ---- loading ------------------------------------------------------------ */

/* Read and check PATH (a tokenizer.json).  Returns a new vocabulary (free
 * with ds41_vocab_free) or NULL with err filled ("PATH: field: problem").
 * Checks: JSON object, version "1.0" if present, model.type "BPE", no dropout,
 * no continuing_subword_prefix/end_of_word_suffix, no byte_fallback;
 * model.vocab ids integers in [0, DS41_VOCAB_MAX_IDS), no two strings on one
 * id, no duplicate keys anywhere; every merge ("a b" string with exactly one
 * space, or ["a","b"]) names two model.vocab strings whose concatenation is
 * also in model.vocab, and no pair twice; added_tokens entries have an integer
 * id, a non-empty string content unique among added tokens, the five boolean
 * flags (all required, as HF requires them) and the id HF would assign (see
 * above); decoder is ByteLevel or
 * a Sequence whose only step is ByteLevel (any other step would change what a
 * single id decodes to); pre_tokenizer Split patterns are strings. */
ds41_vocab *ds41_vocab_load(const char *path, ds41_error *err);

/* Same from memory: JSON (LEN bytes, need not be NUL-terminated).  LABEL names
 * the source in messages (e.g. a path); NULL means "tokenizer.json". */
ds41_vocab *ds41_vocab_parse(const char *json, size_t len, const char *label, ds41_error *err);

/* Load DIR/tokenizer.json and, when it exists, DIR/tokenizer_config.json. */
ds41_vocab *ds41_vocab_load_dir(const char *dir, ds41_error *err);

/* NULL is allowed. */
void ds41_vocab_free(ds41_vocab *v);

/* ---- tokenizer_config.json ---------------------------------------------- */

/* Read bos_token / eos_token / pad_token (a string, an {"content": ...}
 * object, or null), add_bos_token / add_eos_token (booleans, default false)
 * and model_max_length (a number, default 0 = unknown) from PATH and resolve
 * the tokens to ids with ds41_vocab_find.  A named token that is not in the
 * vocabulary is an error ("PATH: field 'bos_token': ..."); on error the
 * vocabulary keeps its previous settings.  Note: DeepSeek's pad_token is the
 * EOS string (id 1), while the model config's engram pad id is 2. */
int ds41_vocab_load_config(ds41_vocab *v, const char *path, ds41_error *err);
int ds41_vocab_parse_config(ds41_vocab *v, const char *json, size_t len, const char *label, ds41_error *err);

/* Ids from the config, -1 when not set (no config loaded, or null there). */
int32_t ds41_vocab_bos_id(const ds41_vocab *v);
int32_t ds41_vocab_eos_id(const ds41_vocab *v);
int32_t ds41_vocab_pad_id(const ds41_vocab *v);
bool ds41_vocab_add_bos(const ds41_vocab *v);
bool ds41_vocab_add_eos(const ds41_vocab *v);
/* Saturates at UINT64_MAX (configs write values like 1e30). */
uint64_t ds41_vocab_model_max_length(const ds41_vocab *v);

/* ---- ids and strings ---------------------------------------------------- */

/* Max id + 1 (129,280 for DeepSeek-V4.1). */
uint32_t ds41_vocab_size(const ds41_vocab *v);
/* Ids below ds41_vocab_size that exist (size minus holes). */
uint32_t ds41_vocab_n_tokens(const ds41_vocab *v);
/* Entries of model.vocab (128,000 for DeepSeek-V4.1). */
uint32_t ds41_vocab_model_entries(const ds41_vocab *v);
/* Longest token string in bytes: a buffer this large holds any decode_id. */
size_t ds41_vocab_max_token_bytes(const ds41_vocab *v);

/* The raw string of ID (the added token's content for added ids, else the
 * model.vocab string), NUL-terminated, owned by the vocabulary; *len (if not
 * NULL) gets its length.  NULL for a hole or an id >= size. */
const char *ds41_vocab_token_string(const ds41_vocab *v, uint32_t id, size_t *len);

/* HF's token_to_id: the added token with that content, else the model.vocab
 * entry; -1 if neither. */
int32_t ds41_vocab_find(const ds41_vocab *v, const char *s, size_t len);

/* model.vocab alone (HF's BPE model lookup, which never sees added tokens):
 * the id of S, -1 if model.vocab has no such string. */
int32_t ds41_vocab_find_model(const ds41_vocab *v, const char *s, size_t len);

/* The added token on ID, or NULL. */
const ds41_added_token *ds41_vocab_added_token(const ds41_vocab *v, uint32_t id);
/* Added tokens in file order (i < ds41_vocab_n_added). */
size_t ds41_vocab_n_added(const ds41_vocab *v);
const ds41_added_token *ds41_vocab_added_at(const ds41_vocab *v, size_t i);

/* ---- merges --------------------------------------------------------------- */

size_t ds41_vocab_n_merges(const ds41_vocab *v);
/* All merges, rank order (NULL when there are none). */
const ds41_merge *ds41_vocab_merges(const ds41_vocab *v);
/* One merge; returns 0, or -1 if rank >= n_merges.  Output pointers may be NULL. */
int ds41_vocab_merge(const ds41_vocab *v, size_t rank, uint32_t *left, uint32_t *right, uint32_t *merged);
/* model.ignore_merges (default false): words found whole in the vocab skip BPE. */
bool ds41_vocab_ignore_merges(const ds41_vocab *v);

/* ---- the other components ------------------------------------------------- */

/* Compact JSON text of the component as read ("null" when absent); owned. */
const char *ds41_vocab_component_json(const ds41_vocab *v, ds41_vocab_component c);
/* True when the normalizer is absent, null, or (nested) empty Sequences. */
bool ds41_vocab_normalizer_is_identity(const ds41_vocab *v);
/* Split steps of the pre-tokenizer (top level or inside Sequences), in order. */
size_t ds41_vocab_n_splits(const ds41_vocab *v);
const ds41_vocab_split *ds41_vocab_split_at(const ds41_vocab *v, size_t i);
/* Whether the pre-tokenizer has a ByteLevel step; its flags through the
 * pointers (HF defaults when a flag is missing: add_prefix_space true,
 * use_regex true).  Pointers may be NULL. */
bool ds41_vocab_pretok_byte_level(const ds41_vocab *v, bool *add_prefix_space, bool *use_regex);

/* ---- decoding --------------------------------------------------------------- */

/* The bytes HF's ByteLevel decoder gives for the single id (before the UTF-8
 * lossy step).  Always sets *len (if not NULL) to the decoded length, 0 for a
 * hole.  Returns 0 when ID exists and the bytes fit in CAP (written to BUF,
 * not NUL-terminated); -1 when ID is a hole / >= size, or CAP is too small (BUF
 * then holds nothing useful).  The length never exceeds the token string's
 * length, so ds41_vocab_max_token_bytes bytes always suffice. */
int ds41_vocab_decode_id(const ds41_vocab *v, uint32_t id, uint8_t *buf, size_t cap, size_t *len);

/* HF's text for decode([id], skip_special_tokens=false): the bytes above made
 * valid UTF-8 as from_utf8_lossy does.  Returns a malloc'd NUL-terminated
 * string (the caller frees it) with its length in *len (if not NULL); NULL for
 * a hole / id >= size, or when memory runs out. */
char *ds41_vocab_decode_id_lossy(const ds41_vocab *v, uint32_t id, size_t *len);

/* ---- byte-level alphabet and UTF-8 helpers -------------------------------- */

/* GPT-2's byte -> character map: printable Latin-1 bytes ('!'..'~', 0xA1..0xAC,
 * 0xAE..0xFF) map to themselves, the other 68 bytes in ascending order to
 * U+0100..U+0143. */
uint32_t ds41_byte_level_char(uint8_t byte);
/* Inverse: the byte of a code point of that alphabet, -1 for any other. */
int ds41_byte_level_byte(uint32_t codepoint);
/* Position of BYTE in the alphabet's order (printable bytes first, then the
 * 68 others): a byte-level BPE's 256 base tokens usually follow this order
 * (DeepSeek: id = 3 + position). */
int ds41_byte_level_rank(uint8_t byte);


#endif
