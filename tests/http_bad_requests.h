/* The malformed requests of issue 13 (item 3) with the answer each must
 * get, shared by test_http_parser (the parser alone) and test_ipc_http (the
 * same bytes over a real socket, the reply parsed strictly). */
#ifndef DS41_TESTS_HTTP_BAD_REQUESTS_H
#define DS41_TESTS_HTTP_BAD_REQUESTS_H

#include <stdbool.h>
#include <stddef.h>

typedef struct http_bad_request {
    const char *name;
    const char *bytes;
    size_t len;
    int status;
    const char *code;
    bool in_body; /* the head is fine; the chunked body after it is not */
} http_bad_request;

#define HBR(name, req, status, code, in_body)                                                                \
    { name, req, sizeof req - 1, status, code, in_body }

__attribute__((unused)) static const http_bad_request http_bad_requests[] = {
    HBR("Content-Length: -5", "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400,
        "invalid_content_length", false),
    HBR("Content-Length: abc", "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400,
        "invalid_content_length", false),
    HBR("Content-Length: 5x", "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 5x\r\n\r\nhello", 400,
        "invalid_content_length", false),
    HBR("Content-Length: 2^64+1",
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 18446744073709551617\r\n\r\n", 400,
        "invalid_content_length", false),
    HBR("two conflicting Content-Length",
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 400,
        "invalid_content_length", false),
    HBR("Content-Length and Transfer-Encoding",
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: "
        "chunked\r\n\r\n0\r\n\r\n",
        400, "invalid_content_length", false),
    HBR("Transfer-Encoding: gzip", "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
        501, "unsupported_transfer_encoding", false),
    HBR("Transfer-Encoding: gzip, chunked",
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501,
        "unsupported_transfer_encoding", false),
    HBR("HTTP/1.1 without Host", "GET /health HTTP/1.1\r\nAccept: */*\r\n\r\n", 400, "missing_host", false),
    HBR("two Host headers", "GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "invalid_header",
        false),
    HBR("HTTP/2.0 request line", "GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505, "http_version_not_supported",
        false),
    HBR("HTTP/1.2 request line", "GET /health HTTP/1.2\r\nHost: x\r\n\r\n", 505, "http_version_not_supported",
        false),
    HBR("garbage request line", "GARBAGE\r\n\r\n", 400, "malformed_request", false),
    HBR("header line without a colon", "GET /health HTTP/1.1\r\nHost x\r\n\r\n", 400, "invalid_header",
        false),
    HBR("space before the colon", "GET /health HTTP/1.1\r\nHost : x\r\n\r\n", 400, "invalid_header", false),
    HBR("obsolete line folding", "GET /health HTTP/1.1\r\nHost: x\r\nX-A: b\r\n c\r\n\r\n", 400,
        "invalid_header", false),
    HBR("chunk size ZZ",
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n", 400,
        "invalid_chunked_encoding", true),
    HBR("chunk size overflowing 64 bits",
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\n",
        400, "invalid_chunked_encoding", true),
    HBR("chunk size -1",
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nabc\r\n0\r\n\r\n", 400,
        "invalid_chunked_encoding", true),
    HBR("chunk data without CRLF",
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n",
        400, "invalid_chunked_encoding", true),
};

#endif
