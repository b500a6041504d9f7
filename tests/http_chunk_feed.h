/* Test helper for ipc/http_parser's chunked decoder: feed a body in pieces
 * the way a connection receives it.  Shared by test_http_parser and
 * fuzz_http_parser. */
#ifndef DS41_TESTS_HTTP_CHUNK_FEED_H
#define DS41_TESTS_HTTP_CHUNK_FEED_H

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/http_parser.h"

/* Decode in[0..len) given to the decoder `step` bytes at a time, keeping
 * unconsumed bytes for the next call; the payload goes to out (room for len
 * bytes), *consumed counts the bytes the decoder took.  *sane is cleared if
 * the decoder broke its contract (consumed more than it had, produced more
 * payload than it consumed, or said INCOMPLETE without consuming all).
 * Returns the last result; *err is set on ERROR. */
__attribute__((unused)) static ds41_http_parse_result http_chunk_feed(const char *in, size_t len, size_t step,
                                                                      char *out, size_t *out_len,
                                                                      size_t *consumed, bool *sane,
                                                                      ds41_http_parse_error *err) {
    ds41_http_chunked c;
    ds41_http_chunked_init(&c);
    char *buf = malloc(len + 1);
    size_t have = 0, at = 0;
    *out_len = *consumed = 0;
    *sane = buf != NULL;
    ds41_http_parse_result r = DS41_HTTP_PARSE_INCOMPLETE;
    while (buf && r == DS41_HTTP_PARSE_INCOMPLETE && at < len) {
        size_t n = len - at < step ? len - at : step;
        memcpy(buf + have, in + at, n);
        have += n;
        at += n;
        size_t used, o;
        r = ds41_http_chunked_decode(&c, buf, have, &used, &o, err);
        if (r == DS41_HTTP_PARSE_ERROR) break;
        if (used > have || o > used || (r == DS41_HTTP_PARSE_INCOMPLETE && used != have)) {
            *sane = false;
            break;
        }
        memcpy(out + *out_len, buf, o);
        *out_len += o;
        memmove(buf, buf + used, have - used);
        have -= used;
        *consumed += used;
    }
    free(buf);
    return r;
}

#endif
