/* Engram hash layout and n-gram hashing (REFERENCE.md §6.2, §6.3).
 *
 * From plain config values (engram_layer_ids, engram_max_ngram_size, engram_n_heads,
 * engram_vocab_size, engram_compressed_vocab_size) this derives, per Engram layer:
 *   - the 24 (= (max_ngram-1) * n_heads) table-size primes, in column order
 *     col = (n-2) * n_heads + head, n = 2..max_ngram;
 *   - the column offsets into the layer's table (exclusive prefix sums) and the row count;
 *   - the hash multipliers (numpy default_rng(10007*L).integers(0, bound) * 2 + 1).
 * Then, per token position, it computes the row ids to read from each layer's table from
 * the compressed ids of the current and previous max_ngram-1 tokens.
 *
 * Everything is plain data with fixed capacity: no allocation, the structs can be copied
 * and snapshotted as bytes. */
#ifndef DS41_ENGINE_ENGRAM_LAYOUT_H
#define DS41_ENGINE_ENGRAM_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "config/error.h"

/* Capacities (the release uses 2 layers, 4-grams, 8 heads = 24 columns). */
#define DS41_ENGRAM_MAX_LAYERS 8
#define DS41_ENGRAM_MAX_NGRAM 8
#define DS41_ENGRAM_MAX_HEADS 32
#define DS41_ENGRAM_MAX_COLS ((DS41_ENGRAM_MAX_NGRAM - 1) * DS41_ENGRAM_MAX_HEADS)
/* Largest accepted engram_vocab_size / layer id: keeps every prime, row count and seed
 * far inside int64 (the release uses 16,000,000 and layer ids 1, 14). */
#define DS41_ENGRAM_MAX_VOCAB ((int64_t)1 << 40)
#define DS41_ENGRAM_MAX_LAYER_ID 1000000
/* numpy seed of layer L is DS41_ENGRAM_SEED_PRIME * L. */
#define DS41_ENGRAM_SEED_PRIME 10007

/* Compressed id of a position whose token must not take part in n-grams (image spans). */
#define DS41_ENGRAM_DEAD (-1)

typedef struct ds41_engram_layer_layout {
    int layer_id;
    int64_t primes[DS41_ENGRAM_MAX_COLS];       /* table size of each hash column */
    int64_t offsets[DS41_ENGRAM_MAX_COLS];      /* first row of each column in the table */
    int64_t rows;                               /* sum of primes = rows of the layer's table */
    int64_t multipliers[DS41_ENGRAM_MAX_NGRAM]; /* index k = look-back distance (0 = current) */
} ds41_engram_layer_layout;

typedef struct ds41_engram_layout {
    int n_layers;              /* engram layers, in engram_layer_ids order ("slots") */
    int max_ngram;             /* engram_max_ngram_size */
    int n_heads;               /* engram_n_heads (heads per n-gram order) */
    int n_cols;                /* (max_ngram - 1) * n_heads */
    int64_t engram_vocab_size; /* prime search starts above engram_vocab_size - 1 */
    int64_t compressed_vocab;  /* valid compressed ids are 0 .. compressed_vocab-1 */
    int64_t multiplier_bound;  /* max(1, floor(floor((2^63-1)/compressed_vocab)/2)) */
    ds41_engram_layer_layout layers[DS41_ENGRAM_MAX_LAYERS];
} ds41_engram_layout;

/* Derives the layout.  layer_ids[n_layers] are the engram layer ids in config order (distinct,
 * 0..DS41_ENGRAM_MAX_LAYER_ID); n_layers == 0 gives an empty layout (Engram off; the other
 * values are then not checked).  Otherwise max_ngram must be 2..DS41_ENGRAM_MAX_NGRAM, n_heads
 * 1..DS41_ENGRAM_MAX_HEADS, engram_vocab_size 1..DS41_ENGRAM_MAX_VOCAB and compressed_vocab
 * 1..INT32_MAX.  Primes: one seen-set across all layers; for each layer and n = 2..max_ngram the
 * search restarts at engram_vocab_size - 1 and takes, per head, the smallest prime strictly
 * greater than the previous one that is not yet seen.  On error *out is left zeroed and err
 * names the offending engram_* field. */
int ds41_engram_layout_compute(const int *layer_ids, int n_layers, int max_ngram, int n_heads,
                               int64_t engram_vocab_size, int64_t compressed_vocab, ds41_engram_layout *out,
                               ds41_error *err);

/* Checks the config's engram_num_embeddings[n] against the derived row counts: n must equal
 * layout->n_layers and each value the sum of that layer's primes.  The error names
 * 'engram_num_embeddings', the index and both numbers. */
int ds41_engram_layout_check(const ds41_engram_layout *layout, const int64_t *num_embeddings, int n,
                             ds41_error *err);

/* Slot (index into layout->layers) of an absolute layer id, or -1 if it has no Engram. */
int ds41_engram_layout_slot(const ds41_engram_layout *layout, int layer_id);

/* Per-sequence n-gram history: the compressed ids of the most recent positions.  It persists
 * across prefill and decode (and can be snapshotted as plain bytes); one per sequence, shared
 * by all Engram layers.  Positions are absolute: the first token pushed is position 0. */
typedef struct ds41_engram_history {
    int32_t recent[DS41_ENGRAM_MAX_NGRAM]; /* recent[k] = compressed id at position n_pushed-1-k */
    int64_t n_pushed;                      /* tokens pushed = position of the next token */
} ds41_engram_history;

/* Empty history (next position 0). */
void ds41_engram_history_init(ds41_engram_history *h);

/* Appends the compressed id of the next position (>= 0, or DS41_ENGRAM_DEAD for a token that
 * must block n-grams, e.g. inside an image span).  Errors on other negative values; the upper
 * bound is checked against the layout when hashing. */
int ds41_engram_history_push(ds41_engram_history *h, int32_t compressed_id_or_dead, ds41_error *err);

/* Row ids of one Engram layer for the latest pushed position p (REFERENCE §6.3), written to
 * ids_out[layout->n_cols] in column order, offsets included (each id < layers[slot].rows).
 * tok_k = compressed id at p-k; k is blocked if p < k, the token at p-k is DEAD, or a smaller k
 * is blocked (so a DEAD current token blocks everything); blocked slots use pad_id (the
 * compressed id of engram_pad_id).  h = tok_0*mult_0; for k = 1..max_ngram-1: h ^= tok_k*mult_k,
 * then for each head j: ids[(k-1)*n_heads + j] = h mod prime + offset.
 * Errors: bad slot, empty history, pad_id or a used compressed id outside [0, compressed_vocab). */
int ds41_engram_hash_position(const ds41_engram_layout *layout, int slot, const ds41_engram_history *h,
                              int32_t pad_id, int64_t *ids_out, ds41_error *err);

/* Prefill / decode helper: pushes compressed[0..n) one by one and after each push writes the row
 * ids of every layer, ids_out[(t * n_layers + slot) * n_cols + col].  On error the history holds
 * the tokens pushed before the failing one and err names its index. */
int ds41_engram_hash_tokens(const ds41_engram_layout *layout, ds41_engram_history *h, int32_t pad_id,
                            const int32_t *compressed, size_t n, int64_t *ids_out, ds41_error *err);

#endif
