/* HTTP request parser (ipc/http_parser) on arbitrary bytes.  Input: byte 0 picks the piece size
 * (1 + b % 16) for incremental feeding; the rest is a request head, and what follows the head
 * (or the whole rest, when the head is refused) is also decoded as a chunked body.  Checks,
 * trapping on violation:
 *   - a refusal has one of the documented statuses, a code and a message;
 *   - an accepted head: used within the input, a method of token bytes, a path starting with '/'
 *     within DS41_HTTP_MAX_TARGET, minor 0 or 1, never Content-Length and chunked together, a
 *     length below 2^63;
 *   - every prefix of the input is INCOMPLETE or gets the whole input's result (pieces never
 *     change the answer);
 *   - the chunked decoder gives the same result, payload and consumed count fed at once and in
 *     pieces, and never more payload than it consumed. */
#include "ipc/http_parser.h"
#include "tests/http_chunk_feed.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                          \
    do {                                                                                                     \
        if (!(cond)) __builtin_trap();                                                                       \
    } while (0)

static ds41_http_head whole, part;

static bool same_result(ds41_http_parse_result a, const ds41_http_parse_error *ea, size_t ua,
                        ds41_http_parse_result b, const ds41_http_parse_error *eb, size_t ub) {
    if (a != b) return false;
    if (a == DS41_HTTP_PARSE_ERROR) return ea->status == eb->status && strcmp(ea->code, eb->code) == 0;
    if (a == DS41_HTTP_PARSE_OK) return ua == ub;
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    size_t step = 1 + data[0] % 16;
    const char *req = (const char *)data + 1;
    size_t len = size - 1;
    ds41_http_parse_error err, perr;
    size_t used = 0, pused = 0;
    ds41_http_parse_result r = ds41_http_parse_head(req, len, &whole, &used, &err);
    if (r == DS41_HTTP_PARSE_ERROR) {
        CHECK(err.status == 400 || err.status == 414 || err.status == 431 || err.status == 501 ||
              err.status == 505);
        CHECK(err.code && err.code[0] && err.message[0]);
    } else if (r == DS41_HTTP_PARSE_OK) {
        CHECK(used > 0 && used <= len);
        CHECK(whole.method[0] && strlen(whole.method) < sizeof whole.method);
        CHECK(whole.path[0] == '/' && strlen(whole.path) <= DS41_HTTP_MAX_TARGET);
        CHECK(whole.minor == 0 || whole.minor == 1);
        CHECK(!(whole.chunked && whole.has_length));
        CHECK(whole.content_length < (UINT64_C(1) << 63));
    }
    /* prefixes: every one for short inputs, a spread of them for long ones */
    size_t stride = len <= 2048 ? 1 : len / 512;
    for (size_t n = 0; n < len; n += stride) {
        ds41_http_parse_result pr = ds41_http_parse_head(req, n, &part, &pused, &perr);
        if (pr == DS41_HTTP_PARSE_INCOMPLETE) continue;
        CHECK(same_result(r, &err, used, pr, &perr, pused));
    }
    /* a chunked body after the head */
    const uint8_t *body = data + 1 + (r == DS41_HTTP_PARSE_OK ? used : 0);
    size_t blen = len - (r == DS41_HTTP_PARSE_OK ? used : 0);
    char *out1 = malloc(blen + 1), *out2 = malloc(blen + 1);
    CHECK(out1 && out2);
    size_t o1, o2, c1, c2;
    bool sane1, sane2;
    ds41_http_parse_error e1, e2;
    ds41_http_parse_result r1 =
        http_chunk_feed((const char *)body, blen, blen ? blen : 1, out1, &o1, &c1, &sane1, &e1);
    ds41_http_parse_result r2 = http_chunk_feed((const char *)body, blen, step, out2, &o2, &c2, &sane2, &e2);
    CHECK(sane1 && sane2 && r1 == r2);
    if (r1 == DS41_HTTP_PARSE_ERROR)
        CHECK(e1.status == 400 && strcmp(e1.code, "invalid_chunked_encoding") == 0 && e2.status == 400);
    else
        CHECK(o1 == o2 && c1 == c2 && memcmp(out1, out2, o1) == 0 && o1 <= c1);
    free(out1);
    free(out2);
    return 0;
}
