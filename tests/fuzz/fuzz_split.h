/* Fuzz inputs made of a JSON document, a 0xFF byte, then bytes to feed (the schema targets). */
#ifndef DS41_TESTS_FUZZ_SPLIT_H
#define DS41_TESTS_FUZZ_SPLIT_H

#include <stdint.h>
#include <string.h>

#include <jansson.h>

/* The JSON before the first 0xFF (NULL when it does not parse); *feed / *feed_len: the rest. */
static inline json_t *fuzz_split_json(const uint8_t *data, size_t size, const uint8_t **feed,
                                      size_t *feed_len) {
    const uint8_t *sep = memchr(data, 0xFF, size);
    size_t sl = sep ? (size_t)(sep - data) : size;
    *feed = sep ? sep + 1 : data + size;
    *feed_len = size - (size_t)(*feed - data);
    return json_loadb((const char *)data, sl, JSON_DECODE_ANY, NULL);
}

#endif
