/* ipc/http_parser on bytes alone: what it accepts and what it refuses (with
 * the status and code the server answers), limits on complete and on
 * incomplete input, pieces vs whole, and chunked bodies. */
#include "ipc/http_parser.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/http_bad_requests.h"
#include "tests/http_chunk_feed.h"
#include "tests/tap.h"

static ds41_http_head head;
static ds41_http_parse_error perr;

static ds41_http_parse_result parse(const char *req, size_t len, size_t *used) {
    memset(&perr, 0, sizeof perr);
    return ds41_http_parse_head(req, len, &head, used, &perr);
}

/* Parse req whole; it must be refused with status/code, and every prefix
 * of it must be INCOMPLETE or refused the same way. */
static void refuse(const char *name, const char *req, size_t len, int status, const char *code) {
    size_t used;
    ds41_http_parse_result r = parse(req, len, &used);
    bool whole = r == DS41_HTTP_PARSE_ERROR && perr.status == status && strcmp(perr.code, code) == 0 &&
                 perr.message[0];
    char got[200];
    snprintf(got, sizeof got, "%d %s: %s", r == DS41_HTTP_PARSE_ERROR ? perr.status : 0,
             r == DS41_HTTP_PARSE_ERROR ? perr.code : (r == DS41_HTTP_PARSE_OK ? "accepted" : "incomplete"),
             perr.message);
    size_t bad_prefix = 0;
    for (size_t n = 0; n < len && !bad_prefix; n++) {
        r = parse(req, n, &used);
        if (r == DS41_HTTP_PARSE_OK ||
            (r == DS41_HTTP_PARSE_ERROR && (perr.status != status || strcmp(perr.code, code) != 0)))
            bad_prefix = n ? n : SIZE_MAX;
    }
    TAP_CHECK(whole && !bad_prefix, "%s -> %d %s, every prefix incomplete or the same (%s; prefix %zu)", name,
              status, code, got, bad_prefix);
}

#define REFUSE(name, req, status, code) refuse(name, req, sizeof req - 1, status, code)

static void test_refusals(void) {
    /* the cases of issue 13 (test_ipc_http sends the same bytes over a socket) */
    for (size_t i = 0; i < sizeof http_bad_requests / sizeof http_bad_requests[0]; i++) {
        const http_bad_request *b = &http_bad_requests[i];
        if (!b->in_body) {
            refuse(b->name, b->bytes, b->len, b->status, b->code);
            continue;
        }
        size_t used, ol, consumed;
        bool sane;
        char out[256];
        ds41_http_parse_result r = parse(b->bytes, b->len, &used);
        bool head_ok = r == DS41_HTTP_PARSE_OK && head.chunked && b->len - used <= sizeof out;
        r = head_ok ? http_chunk_feed(b->bytes + used, b->len - used, 1, out, &ol, &consumed, &sane, &perr)
                    : DS41_HTTP_PARSE_OK;
        TAP_CHECK(head_ok && r == DS41_HTTP_PARSE_ERROR && perr.status == b->status &&
                      strcmp(perr.code, b->code) == 0,
                  "%s: the head is accepted, the chunked body refused with %d %s", b->name, b->status,
                  b->code);
    }
    /* more refusals, on the parser alone */
    REFUSE("Content-Length empty", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length:\r\n\r\n", 400,
           "invalid_content_length");
    REFUSE("Content-Length list", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 5\r\n\r\n", 400,
           "invalid_content_length");
    REFUSE("Content-Length 2^63", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9223372036854775808\r\n\r\n",
           400, "invalid_content_length");
    REFUSE("Content-Length with chunked",
           "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 6\r\n\r\n", 400,
           "invalid_content_length");
    REFUSE("Transfer-Encoding chunked twice",
           "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
           501, "unsupported_transfer_encoding");
    REFUSE("Transfer-Encoding in HTTP/1.0", "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
           "invalid_header");
    REFUSE("HTTP/0.9", "GET / HTTP/0.9\r\n\r\n", 505, "http_version_not_supported");
    REFUSE("HTTP/1.10", "GET / HTTP/1.10\r\nHost: x\r\n\r\n", 400, "malformed_request");
    REFUSE("http/1.1 lower case", "GET / http/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request");
    REFUSE("no version", "GET /\r\n\r\n", 400, "malformed_request");
    REFUSE("two spaces", "GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request");
    REFUSE("NUL in the method", "GE\0T / HTTP/1.1\r\n\r\n", 400, "malformed_request");
    REFUSE("bare CR in the request line", "GET /a\rb HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request");
    REFUSE("long method", "ABCDEFGHIJKLMNOPQ / HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method_not_implemented");
    REFUSE("relative target", "GET health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request");
    REFUSE("fragment", "GET /a#b HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request");
    REFUSE("%00 in the path", "GET /a%00b HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request");
    REFUSE("bad %-escape", "GET /a%zz HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request");
    REFUSE("truncated %-escape", "GET /a%4 HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request");
    REFUSE("empty header name", "GET / HTTP/1.1\r\n: x\r\nHost: x\r\n\r\n", 400, "invalid_header");
    REFUSE("control byte in a value", "GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x01\r\n\r\n", 400,
           "invalid_header");
    REFUSE("DEL in a value", "GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x7f\r\n\r\n", 400, "invalid_header");
    REFUSE("bare CR in a header", "GET / HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n", 400, "invalid_header");

    /* limits */
    char *big = malloc(DS41_HTTP_MAX_HEAD + 4096);
    int n = snprintf(big, 64, "GET /");
    memset(big + n, 'a', DS41_HTTP_MAX_TARGET);
    n += (int)DS41_HTTP_MAX_TARGET;
    n += snprintf(big + n, 64, " HTTP/1.1\r\nHost: x\r\n\r\n");
    refuse("a target one byte over the limit", big, (size_t)n, 414, "uri_too_long");
    size_t used;
    n = snprintf(big, 64, "GET /");
    memset(big + n, 'a', DS41_HTTP_MAX_TARGET - 1);
    n += (int)DS41_HTTP_MAX_TARGET - 1;
    n += snprintf(big + n, 64, " HTTP/1.1\r\nHost: x\r\n\r\n");
    TAP_CHECK(parse(big, (size_t)n, &used) == DS41_HTTP_PARSE_OK && strlen(head.path) == DS41_HTTP_MAX_TARGET,
              "a target of exactly %u bytes is accepted", DS41_HTTP_MAX_TARGET);
    n = snprintf(big, 64, "GET / HTTP/1.1\r\nHost: x\r\nX-Big: ");
    memset(big + n, 'v', DS41_HTTP_MAX_HEAD);
    n += (int)DS41_HTTP_MAX_HEAD;
    n += snprintf(big + n, 64, "\r\n\r\n");
    refuse("a header section over the limit", big, (size_t)n, 431, "header_too_large");
    /* a head of exactly the limit is accepted */
    n = snprintf(big, 64, "GET / HTTP/1.1\r\nHost: x\r\nX-Big: ");
    int fill = (int)DS41_HTTP_MAX_HEAD - n - 4;
    memset(big + n, 'v', (size_t)fill);
    n += fill;
    n += snprintf(big + n, 64, "\r\n\r\n");
    TAP_CHECK(n == (int)DS41_HTTP_MAX_HEAD && parse(big, (size_t)n, &used) == DS41_HTTP_PARSE_OK &&
                  used == (size_t)n,
              "a head of exactly %u bytes is accepted", DS41_HTTP_MAX_HEAD);
    n = snprintf(big, 64, "GET / HTTP/1.1\r\nHost: x\r\n");
    for (unsigned i = 0; i < DS41_HTTP_MAX_FIELDS; i++) n += snprintf(big + n, 32, "X-%u: v\r\n", i);
    n += snprintf(big + n, 8, "\r\n");
    refuse("too many header fields", big, (size_t)n, 431, "header_too_large");
    /* incomplete input is refused as soon as it passes a limit */
    memset(big, 'a', DS41_HTTP_MAX_HEAD + 10);
    memcpy(big, "GET / HTTP/1.1\r\nHost: x\r\nX: ", 28);
    TAP_CHECK(parse(big, DS41_HTTP_MAX_HEAD + 1, &used) == DS41_HTTP_PARSE_ERROR && perr.status == 431,
              "an unfinished head one byte over the limit is refused at once (%d)", perr.status);
    memset(big, 'a', DS41_HTTP_MAX_TARGET + 10);
    memcpy(big, "GET /", 5);
    TAP_CHECK(parse(big, DS41_HTTP_MAX_TARGET + 6, &used) == DS41_HTTP_PARSE_ERROR && perr.status == 414,
              "an unfinished target over the limit is refused at once (%d)", perr.status);
    free(big);
}

static void test_accepts(void) {
    size_t used;
    const char r1[] =
        "\r\nPOST /v1/chat%2Fcompletions?x=%zz&y HTTP/1.1\r\nhost: a\r\ncontent-length:  12 \r\n"
        "Content-Type: application/json; charset=utf-8\r\nExpect: 100-Continue\r\n"
        "Connection: keep-alive, Upgrade\r\nX-Obs: caf\xc3\xa9\r\n\r\nbody";
    ds41_http_parse_result r = parse(r1, sizeof r1 - 1, &used);
    TAP_CHECK(
        r == DS41_HTTP_PARSE_OK && used == sizeof r1 - 1 - 4 && strcmp(head.method, "POST") == 0 &&
            strcmp(head.path, "/v1/chat/completions") == 0 && head.minor == 1 && head.keep_alive &&
            head.has_length && head.content_length == 12 && !head.chunked && head.expect_continue &&
            strcmp(head.content_type, "application/json; charset=utf-8") == 0,
        "a full head: leading CRLF skipped, %%-decoded path without query, case-insensitive names, OWS, "
        "obs-text, used stops at the body (%s)",
        r == DS41_HTTP_PARSE_ERROR ? perr.message : "ok");
    const char r2[] = "GET /health HTTP/1.0\n\n";
    r = parse(r2, sizeof r2 - 1, &used);
    TAP_CHECK(r == DS41_HTTP_PARSE_OK && used == sizeof r2 - 1 && head.minor == 0 && !head.keep_alive &&
                  !head.has_length,
              "HTTP/1.0 without Host, bare LF line ends: accepted, not kept alive");
    const char r3[] = "GET /health HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n";
    TAP_CHECK(parse(r3, sizeof r3 - 1, &used) == DS41_HTTP_PARSE_OK && head.keep_alive,
              "HTTP/1.0 with Connection: keep-alive is kept alive");
    const char r4[] = "GET /h HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    TAP_CHECK(parse(r4, sizeof r4 - 1, &used) == DS41_HTTP_PARSE_OK && !head.keep_alive,
              "HTTP/1.1 with Connection: close is not kept alive");
    const char r5[] = "POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n";
    TAP_CHECK(parse(r5, sizeof r5 - 1, &used) == DS41_HTTP_PARSE_OK && head.chunked && !head.has_length,
              "Transfer-Encoding: chunked (any case)");
    const char r6[] = "POST /t HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n";
    TAP_CHECK(parse(r6, sizeof r6 - 1, &used) == DS41_HTTP_PARSE_OK && head.content_length == 5,
              "two equal Content-Length values are one");
    const char r7[] = "GET http://ds41/v1/models?limit=1 HTTP/1.1\r\nHost: ds41\r\n\r\n";
    TAP_CHECK(parse(r7, sizeof r7 - 1, &used) == DS41_HTTP_PARSE_OK && strcmp(head.path, "/v1/models") == 0,
              "absolute-form target: the path is used");
    const char r8[] = "GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\n";
    TAP_CHECK(parse(r8, sizeof r8 - 1, &used) == DS41_HTTP_PARSE_OK && used == 28 &&
                  strcmp(head.path, "/a") == 0,
              "pipelined: the first head ends where the next request starts");
    /* fed in pieces: INCOMPLETE until the last byte */
    size_t bad = 0;
    for (size_t k = 0; k + 4 < sizeof r1 - 1 && !bad; k++)
        if (parse(r1, k, &used) != DS41_HTTP_PARSE_INCOMPLETE) bad = k;
    TAP_CHECK(!bad, "every prefix of a valid head is incomplete (%zu)", bad);
}

static void test_chunked(void) {
    static const struct {
        const char *in, *payload;
        int result; /* 0 ok, 1 incomplete, 2 error */
        const char *name;
    } cases[] = {
        {"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", "hello world", 0, "two chunks"},
        {"5;a=b;c=\"d\"\r\nhello\r\n0;x\r\nTrailer: t\r\nMore: u\r\n\r\n", "hello", 0,
         "extensions and trailers"},
        {"A\r\n0123456789\r\n0\r\n\r\n", "0123456789", 0, "upper-case hex"},
        {"5\nhello\n0\n\n", "hello", 0, "bare LF line ends"},
        {"0005 \r\nhello\r\n0\r\n\r\n", "hello", 0, "leading zeros, space after the size"},
        {"5\r\nhel", "hel", 1, "a cut chunk is incomplete"},
        {"ZZ\r\nabc\r\n0\r\n\r\n", "", 2, "non-hex size"},
        {"-1\r\nabc\r\n0\r\n\r\n", "", 2, "negative size"},
        {"\r\nabc\r\n0\r\n\r\n", "", 2, "empty size"},
        {"ffffffffffffffffff\r\n", "", 2, "size over 16 hex digits"},
        {"0000000000000005\r\nhello\r\n0\r\n\r\n", "hello", 0, "a size of exactly 16 hex digits"},
        {"00000000000000005\r\nhello\r\n0\r\n\r\n", "", 2, "a size of 17 hex digits (leading zeros count)"},
        {"3\r\nabcdef\r\n0\r\n\r\n", "", 2, "data longer than its size"},
        {"3\r\nabc\rx0\r\n\r\n", "", 2, "CR not followed by LF after data"},
        {"3x\r\nabc\r\n0\r\n\r\n", "", 2, "junk after the size"},
        {"3\rabc\r\n0\r\n\r\n", "", 2, "size line CR without LF"},
        {"0\r\nX\x01: y\r\n\r\n", "", 2, "control byte in a trailer"},
        {"0\r\n\rX", "", 2, "final CR without LF"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len = strlen(cases[i].in);
        bool same = true;
        char first[64] = "";
        for (size_t step = 1; step <= len; step++) {
            char out[64];
            size_t ol, used;
            bool sane;
            ds41_http_parse_result r = http_chunk_feed(cases[i].in, len, step, out, &ol, &used, &sane, &perr);
            int got = r == DS41_HTTP_PARSE_OK ? 0 : r == DS41_HTTP_PARSE_INCOMPLETE ? 1 : 2;
            bool ok =
                sane && got == cases[i].result &&
                (got == 2 || (ol == strlen(cases[i].payload) && memcmp(out, cases[i].payload, ol) == 0)) &&
                (got != 0 || used == len) &&
                (got != 2 || (perr.status == 400 && strcmp(perr.code, "invalid_chunked_encoding") == 0));
            if (!ok && same) {
                same = false;
                snprintf(first, sizeof first, "step %zu: result %d, %zu payload bytes", step, got, ol);
            }
        }
        TAP_CHECK(same, "chunked: %s, fed in pieces of every size %s", cases[i].name, first);
    }
    /* the decoder stops after the body: a pipelined request stays */
    char buf[] = "3\r\nabc\r\n0\r\n\r\nGET / HTTP/1.1\r\n";
    ds41_http_chunked c;
    ds41_http_chunked_init(&c);
    size_t used, ol;
    ds41_http_parse_result r = ds41_http_chunked_decode(&c, buf, sizeof buf - 1, &used, &ol, &perr);
    TAP_CHECK(r == DS41_HTTP_PARSE_OK && ol == 3 && memcmp(buf, "abc", 3) == 0 && used == 13 &&
                  memcmp(buf + used, "GET /", 5) == 0,
              "chunked: decoding stops at the end of the body, the next request is untouched");
}

/* Each limit and rule exactly at its edge, both sides (issue 19: mutants that moved a limit by one
 * or dropped half of a condition survived the tests above). */
static void test_edges(void) {
    size_t used;
    const char m15[] = "ABCDEFGHIJKLMNO / HTTP/1.1\r\nHost: x\r\n\r\n";
    TAP_CHECK(parse(m15, sizeof m15 - 1, &used) == DS41_HTTP_PARSE_OK &&
                  strcmp(head.method, "ABCDEFGHIJKLMNO") == 0,
              "a method of exactly 15 bytes is parsed (the server answers it 501 by name)");
    REFUSE("a method of 16 bytes", "ABCDEFGHIJKLMNOP / HTTP/1.1\r\nHost: x\r\n\r\n", 501,
           "method_not_implemented");

    char *big = malloc(DS41_HTTP_MAX_HEAD);
    int n = snprintf(big, 64, "GET / HTTP/1.1\r\nHost: x\r\n");
    for (unsigned i = 1; i < DS41_HTTP_MAX_FIELDS; i++) n += snprintf(big + n, 32, "X-%u: v\r\n", i);
    n += snprintf(big + n, 8, "\r\n");
    TAP_CHECK(parse(big, (size_t)n, &used) == DS41_HTTP_PARSE_OK && used == (size_t)n,
              "exactly %u header fields (Host and %u more) are accepted", DS41_HTTP_MAX_FIELDS,
              DS41_HTTP_MAX_FIELDS - 1);

    /* obsolete line folding, with a space and with a tab: refused as folding, not as a bad name */
    static const char *const folds[] = {"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n",
                                        "GET / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n\tb: c\r\n\r\n"};
    for (int k = 0; k < 2; k++) {
        ds41_http_parse_result r = parse(folds[k], strlen(folds[k]), &used);
        TAP_CHECK(r == DS41_HTTP_PARSE_ERROR && perr.status == 400 &&
                      strcmp(perr.code, "invalid_header") == 0 &&
                      strstr(perr.message, "obsolete line folding"),
                  "a header line starting with a %s is refused as obsolete line folding (%s)",
                  k ? "tab" : "space", perr.message);
    }

    REFUSE("Content-Length 0 with chunked (two framings)",
           "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
           "invalid_content_length");

    const char both[] = "GET / HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n";
    TAP_CHECK(parse(both, sizeof both - 1, &used) == DS41_HTTP_PARSE_OK && !head.keep_alive,
              "HTTP/1.0 with Connection: keep-alive, close is not kept alive (close wins)");

    /* a chunk extension of exactly 4096 bytes, and one of 4097 */
    for (size_t ext = 4096; ext <= 4097; ext++) {
        n = snprintf(big, 8, "3;");
        memset(big + n, 'e', ext);
        n += (int)ext;
        n += snprintf(big + n, 32, "\r\nabc\r\n0\r\n\r\n");
        ds41_http_chunked c;
        ds41_http_chunked_init(&c);
        size_t out;
        memset(&perr, 0, sizeof perr);
        ds41_http_parse_result r = ds41_http_chunked_decode(&c, big, (size_t)n, &used, &out, &perr);
        if (ext == 4096)
            TAP_CHECK(r == DS41_HTTP_PARSE_OK && out == 3 && memcmp(big, "abc", 3) == 0,
                      "chunked: an extension of exactly 4096 bytes is skipped");
        else
            TAP_CHECK(r == DS41_HTTP_PARSE_ERROR && strcmp(perr.code, "invalid_chunked_encoding") == 0,
                      "chunked: an extension of 4097 bytes is refused (%s)", perr.message);
    }
    free(big);
}

int main(void) {
    test_refusals();
    test_edges();
    test_accepts();
    test_chunked();
    return tap_done();
}
