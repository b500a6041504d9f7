/* The Engram compressed token map of a loaded tokenizer (REFERENCE §6.1):
 * glue between the vocabulary (engine/text/vocab.h) and the map builder
 * (engine/model/engram_token_map.h), used at model load, by the generator and by
 * the inspector. */
#ifndef DS41_ENGINE_ENGRAM_TOKENS_H
#define DS41_ENGINE_ENGRAM_TOKENS_H

#include "config/error.h"
#include "engine/text/vocab.h"

#include <stdint.h>

/* Build the map for every id 0 .. ds41_vocab_size(v)-1.  On success *map is a
 * malloc'd array of *n_ids compressed ids (free()), *n_compressed the number
 * of distinct keys.  An id that is a hole in the vocabulary decodes to the
 * empty string.  Errors name the tokenizer and the token id. */
int ds41_engram_token_map_from_vocab(const ds41_vocab *v, int32_t **map, uint32_t *n_ids,
                                     uint32_t *n_compressed, ds41_error *err);

#endif
