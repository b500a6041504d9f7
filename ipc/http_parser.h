/* ds41_http_parser: a strict HTTP/1.1 request parser with hard limits
 * (RFC 9112), separate from the server so that it can be fuzzed and tested
 * on bytes alone.  It never allocates.
 *
 * What it accepts:
 *   - request line `METHOD SP request-target SP HTTP/1.x` with single spaces;
 *     the method a token of at most 15 bytes; the target in origin form
 *     ("/path?query") or absolute form ("http://host/path"), visible ASCII
 *     only; versions HTTP/1.0 and HTTP/1.1.  Empty lines before the request
 *     line are skipped (RFC 9112 2.2), up to 1 KiB of them.
 *   - lines ending in CRLF or a bare LF (RFC 9112 2.2 lets a recipient accept
 *     LF); a CR anywhere else is an error.
 *   - header fields `token ":" OWS value OWS`, values of SP, HTAB, visible
 *     ASCII and obs-text (0x80-0xff).
 * What it refuses, each with the status the server answers:
 *   400 malformed_request      request line not of that shape, a bad target
 *                              (a '#', %00, a bad %-escape, a relative path),
 *                              a bare CR
 *   400 invalid_header         header line without colon, whitespace before
 *                              the colon, obsolete line folding, a control
 *                              byte in a value, two Host fields,
 *                              Transfer-Encoding in an HTTP/1.0 request
 *   400 missing_host           HTTP/1.1 without Host
 *   400 invalid_content_length Content-Length not 1*DIGIT, above 2^63-1,
 *                              two different values, or together with
 *                              Transfer-Encoding (request smuggling)
 *   414 uri_too_long           request-target over DS41_HTTP_MAX_TARGET
 *   431 header_too_large       request line + header section over
 *                              DS41_HTTP_MAX_HEAD, or over
 *                              DS41_HTTP_MAX_FIELDS header fields
 *   501 unsupported_transfer_encoding  any Transfer-Encoding but "chunked"
 *   501 method_not_implemented a method longer than 15 bytes
 *   505 http_version_not_supported  HTTP/d.d other than 1.0 and 1.1
 * Limits are checked on incomplete input too, so a client cannot make the
 * server buffer more than DS41_HTTP_MAX_HEAD before it is refused.
 *
 * Chunked bodies are decoded by ds41_http_chunked_* (RFC 9112 7.1): hex
 * chunk sizes (at most 16 digits), chunk extensions (at most 4096 bytes
 * after the ';' of one size line) and trailer fields (16384 bytes in all)
 * skipped, the CRLF after each chunk's data required. */
#ifndef DS41_IPC_HTTP_PARSER_H
#define DS41_IPC_HTTP_PARSER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define DS41_HTTP_MAX_TARGET 8192u      /* request-target bytes (414 above) */
#define DS41_HTTP_MAX_HEAD (64u << 10)  /* request line + headers (431 above) */
#define DS41_HTTP_MAX_FIELDS 128u       /* header fields (431 above) */
#define DS41_HTTP_MAX_CONTENT_TYPE 255u /* longer values are cut (then refused by type) */

typedef enum ds41_http_parse_result {
    DS41_HTTP_PARSE_OK = 0,
    DS41_HTTP_PARSE_INCOMPLETE, /* need more bytes; nothing is wrong so far */
    DS41_HTTP_PARSE_ERROR,      /* refuse: see ds41_http_parse_error */
} ds41_http_parse_result;

typedef struct ds41_http_parse_error {
    int status;       /* 400, 414, 431, 501, 505 */
    const char *code; /* the error body's "code", e.g. "invalid_content_length" */
    char message[160];
} ds41_http_parse_error;

typedef struct ds41_http_head {
    char method[16];
    char path[DS41_HTTP_MAX_TARGET + 1]; /* %-decoded, query string removed, starts with '/' */
    int minor;                           /* HTTP/1.<minor>: 0 or 1 */
    bool keep_alive;                     /* by version and Connection */
    bool has_length;
    uint64_t content_length;
    bool chunked;
    bool expect_continue; /* HTTP/1.1 "Expect: 100-continue" */
    bool has_content_type;
    char content_type[DS41_HTTP_MAX_CONTENT_TYPE + 1];
} ds41_http_head;

/* Parse the request head at buf[0..len).  OK: *head filled and *used = the
 * bytes of the head including its empty line (the body or the next request
 * follows).  INCOMPLETE: call again with more bytes.  ERROR: *err says why. */
ds41_http_parse_result ds41_http_parse_head(const char *buf, size_t len, ds41_http_head *head, size_t *used,
                                            ds41_http_parse_error *err);

/* Incremental chunked-body decoder; zero-initialize (or _init) per body. */
typedef struct ds41_http_chunked {
    int state;
    uint64_t remaining; /* data bytes left in the current chunk */
    unsigned digits;
    size_t line_len; /* bytes of the current extension or trailer line */
    size_t trailer_len;
} ds41_http_chunked;

void ds41_http_chunked_init(ds41_http_chunked *c);

/* Decode buf[0..len) in place: the payload bytes found are moved to
 * buf[0..*out_len) (never past what was consumed, so the bytes from *used on
 * -- a pipelined next request -- stay untouched).  Returns OK when the body
 * ended (last chunk and trailer consumed), INCOMPLETE when all of buf was
 * consumed and more is needed, ERROR (400 invalid_chunked_encoding) on bad
 * framing. */
ds41_http_parse_result ds41_http_chunked_decode(ds41_http_chunked *c, char *buf, size_t len, size_t *used,
                                                size_t *out_len, ds41_http_parse_error *err);

#endif
