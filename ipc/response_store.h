/* ds41_response_store: the stored responses of POST /v1/responses ("store": true), read back by
 * GET /v1/responses/{id}, removed by DELETE and continued with "previous_response_id".
 *
 * Each entry is an opaque byte string (the api keeps the response object and the conversation
 * that led to it, as JSON) under an id and the peer uid that created it.  The store is
 * partitioned by that uid: get / remove with another uid find nothing, exactly as if the id did
 * not exist, so a peer learns nothing about another peer's responses.
 *
 * Limits: max_bytes caps the total size of the entries (0 = no cap; the oldest go first, and an
 * entry larger than the cap is refused); max_age_s the age of an entry (0 = no limit: an older
 * entry is deleted when next seen, by get, put or open).
 *
 * With a directory the entries are files "<owner>-<id>.json" in it (owner: the decimal uid or
 * "anon" for a peer without credentials), written atomically (temporary file, fsync, rename)
 * with their mtime set to the creation time, so a restarted daemon finds them again; files of
 * another shape in the directory are left alone.  Without a directory (NULL) the entries live
 * in memory only (tests, a daemon without a state directory).
 *
 * Ids are [A-Za-z0-9_-]{1,64}; anything else is refused (they become file names).
 * Thread-safe: every call takes the store's lock. */
#ifndef DS41_IPC_RESPONSE_STORE_H
#define DS41_IPC_RESPONSE_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config/error.h"

typedef struct ds41_response_store ds41_response_store;

/* Open (creating dir, mode 0700, when missing) and index what dir holds, dropping entries
 * older than max_age_s at `now` (unix seconds). */
int ds41_response_store_open(const char *dir, uint64_t max_bytes, uint64_t max_age_s, int64_t now,
                             ds41_response_store **out, ds41_error *err);
void ds41_response_store_close(ds41_response_store *s);

/* Whether id is a valid store id. */
bool ds41_response_store_id_ok(const char *id);

/* Store data[0..len) under (owner_uid, id), created at `now`, replacing an entry with that id;
 * evict expired then oldest entries until the total fits max_bytes. owner_uid -1 = no
 * credentials.  -1: invalid id, larger than max_bytes, or an I/O error (err says which). */
int ds41_response_store_put(ds41_response_store *s, int64_t owner_uid, const char *id, const char *data,
                            size_t len, int64_t now, ds41_error *err);

/* Copy the entry of (owner_uid, id) into *data (malloc()ed, NUL-terminated, len excludes the
 * NUL).  Returns 1 when found, 0 when not (or expired at `now`, or another owner's), -1 on an
 * I/O error. */
int ds41_response_store_get(ds41_response_store *s, int64_t owner_uid, const char *id, int64_t now,
                            char **data, size_t *len, ds41_error *err);

/* Remove the entry of (owner_uid, id).  1 removed, 0 not found (or another owner's). */
int ds41_response_store_remove(ds41_response_store *s, int64_t owner_uid, const char *id);

/* Number of entries and their total bytes (tests, metrics). */
void ds41_response_store_stats(ds41_response_store *s, size_t *entries, uint64_t *bytes);

#endif
