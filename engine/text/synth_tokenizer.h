/* Synthetic DeepSeek-style tokenizer: a valid byte-level BPE tokenizer.json
 * (+ tokenizer_config.json) of any size from DS41_SYNTH_VOCAB_MIN to
 * DS41_SYNTH_VOCAB_MAX ids, for tiny test checkpoints and the bench preset.
 *
 * The file has the real DeepSeek-V4.1 file's structure and layout (2-space
 * indented JSON, keys in the same order, the same normalizer / pre_tokenizer
 * / post_processor / decoder blocks byte for byte, merges as "a b" strings,
 * one trailing newline).  Ids, for vocab_size V:
 *
 *   0, 1, 2      <｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜>, <｜▁pad▁｜>
 *                (in model.vocab and added_tokens, special, as in the real file)
 *   3 .. 258     the 256 byte tokens, in the GPT-2 alphabet order
 *                (id = 3 + ds41_byte_level_rank(byte)), as in the real file
 *   259 .. V-K-1 tokens made by BPE merges, in merge order (as in HF's
 *                trainer, a merge whose result already exists adds no token,
 *                so there can be more merges than these tokens)
 *   V-K .. V-1   K added tokens at the top, a sub-list of the real file's
 *                added tokens 128000..129279 in their order with their flags:
 *                  V >= 129,280: all K = 1,280 (at V = 129,280 every added id,
 *                                content and flag equals the real file's);
 *                  512 <= V < 129,280: the K = 59 named ones (128799..128846,
 *                                129262..129264, 129271..129278);
 *                  V < 512: K = 17 (System, fim▁begin, User, Assistant, EOT,
 *                                tool▁calls▁begin, think, /think, DSML,
 *                                latest_reminder, action, query, authority,
 *                                domain, title, read_url, deepseek_image).
 *
 * So `<｜System｜>` (DSpark noise token) and `<｜deepseek_image｜>` (image
 * token) exist in every layout; ds41_synth_tokenizer_special_id gives their
 * ids, and the engram pad id is 2.  model.vocab holds V-K entries, so Hugging
 * Face tokenizers assigns the added tokens exactly the ids written.
 *
 * Merges are learned by BPE training (most frequent pair first, ties to the
 * lower (left, right) ids) on a corpus drawn from a seeded generator: English-
 * like words with and without a leading space, capitalised words, numbers of
 * 1-3 digits, punctuation runs with newlines, whitespace runs, CJK and kana
 * runs, accented Latin, Greek and Cyrillic words, and a few symbols and emoji,
 * already split the way the real pre-tokenizer splits text.  If that corpus
 * runs out of pairs before V-K-259 tokens exist, the rest are seeded merges
 * of an existing token with a byte token (valid BPE; each makes a new
 * string).  Everything is integer arithmetic on a splitmix64 stream: the same
 * (V, seed) gives the same bytes on every machine.  The real vocabulary size
 * (129,280) takes about a second. */
#ifndef DS41_ENGINE_SYNTH_TOKENIZER_H
#define DS41_ENGINE_SYNTH_TOKENIZER_H

#include "config/error.h"

#include <stddef.h>
#include <stdint.h>

#define DS41_SYNTH_VOCAB_MIN 300u
#define DS41_SYNTH_VOCAB_MAX 262144u

/* Contents of the special tokens every layout has. */
#define DS41_SYNTH_BOS "<｜begin▁of▁sentence｜>"
#define DS41_SYNTH_EOS "<｜end▁of▁sentence｜>"
#define DS41_SYNTH_PAD "<｜▁pad▁｜>"
#define DS41_SYNTH_SYSTEM "<｜System｜>"
#define DS41_SYNTH_DEEPSEEK_IMAGE "<｜deepseek_image｜>"

/* Write DIR/tokenizer.json and DIR/tokenizer_config.json (DIR must exist;
 * files are replaced).  Returns 0, or -1 with err naming the file or the
 * bad argument (vocab_size outside [MIN, MAX]). */
int ds41_synth_tokenizer_write(const char *dir, uint32_t vocab_size, uint64_t seed, ds41_error *err);

/* The tokenizer.json text in memory: malloc'd, NUL-terminated, length in
 * *len (if not NULL); NULL with err on a bad size or out of memory. */
char *ds41_synth_tokenizer_json(uint32_t vocab_size, uint64_t seed, size_t *len, ds41_error *err);

/* Knobs for tests. */
typedef struct ds41_synth_options {
    /* Word types to draw for the training corpus; 0 = automatic (enough for
     * the vocabulary size, at least 4096).  A small corpus runs out of pairs
     * early and leaves the rest to the filler merges. */
    uint32_t corpus_words;
    /* Out: how many merges were learned from the corpus (the others, if
     * any, are filler merges). */
    uint32_t trained_merges;
} ds41_synth_options;

/* ds41_synth_tokenizer_json with options (OPTS may be NULL). */
char *ds41_synth_tokenizer_json_opts(uint32_t vocab_size, uint64_t seed, ds41_synth_options *opts,
                                     size_t *len, ds41_error *err);

/* The tokenizer_config.json text (the real V4.1 file's, byte for byte:
 * bos `<｜begin▁of▁sentence｜>`, eos and pad `<｜end▁of▁sentence｜>`,
 * add_bos_token false, model_max_length 1048576).  Static storage. */
const char *ds41_synth_tokenizer_config_json(size_t *len);

/* The id of the added token with CONTENT in the layout for VOCAB_SIZE, or -1
 * when that layout does not have it (or the size is out of range).  Needs no
 * file: the layout depends on the size only, not on the seed. */
int32_t ds41_synth_tokenizer_special_id(uint32_t vocab_size, const char *content);

#endif
