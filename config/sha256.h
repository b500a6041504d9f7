/* SHA-256 (FIPS 180-4), streaming and one-shot.  Used where ds41 names
 * content by digest: the Engram compressed-token-map digest and the model
 * identity / ids of session snapshots.  Not for secrets (no constant-time
 * claims, no key handling). */
#ifndef DS41_CONFIG_SHA256_H
#define DS41_CONFIG_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct ds41_sha256_ctx {
    uint32_t h[8];
    uint8_t block[64];
    size_t used; /* bytes in block */
    uint64_t total;
} ds41_sha256_ctx;

void ds41_sha256_init(ds41_sha256_ctx *c);
/* Feed len bytes (data may be NULL when len is 0). */
void ds41_sha256_update(ds41_sha256_ctx *c, const void *data, size_t len);
/* The digest of everything fed; c must be initialised again before reuse. */
void ds41_sha256_final(ds41_sha256_ctx *c, uint8_t out[32]);
/* SHA-256 of data[len]. */
void ds41_sha256(const void *data, size_t len, uint8_t out[32]);

#endif
