/* Strict HTTP/1.1 request parser: see http_parser.h for what it accepts.
 *
 * The head parser is re-run on the whole buffer each time more bytes
 * arrive; it works line by line and reports the first bad line even before
 * the head is complete.  Every check that can fire on an incomplete head (the
 * early request-line checks, the size limits, a complete bad line) gives the
 * same answer as the complete head would: feeding a request in pieces never
 * changes the result (the fuzz target checks exactly that). */
#include "ipc/http_parser.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#define MAX_LEADING_EMPTY 1024u

static ds41_http_parse_result fail(ds41_http_parse_error *err, int status, const char *code, const char *fmt,
                                   ...) __attribute__((format(printf, 4, 5)));
static ds41_http_parse_result fail(ds41_http_parse_error *err, int status, const char *code, const char *fmt,
                                   ...) {
    err->status = status;
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    return DS41_HTTP_PARSE_ERROR;
}

/* RFC 9110 5.6.2 token characters. */
static bool is_tchar(unsigned char c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/* A field value byte: HTAB, SP, VCHAR, obs-text. */
static bool is_value_char(unsigned char c) {
    return c == '\t' || (c >= 0x20 && c != 0x7f);
}

static bool is_ows(char c) {
    return c == ' ' || c == '\t';
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static bool eq_nocase(const char *p, size_t n, const char *word) {
    return strlen(word) == n && strncasecmp(p, word, n) == 0;
}

/* Left-to-right checks on a request line of which `have` bytes are known
 * (the whole line without its line end, or the start of one): method bytes,
 * target bytes and length, version length.  Each error is found at the first
 * bad byte, so a prefix of a line gives the same error as the whole line or
 * none.  Returns ERROR or INCOMPLETE (nothing wrong so far). */
static ds41_http_parse_result scan_request_line(const char *line, size_t have, ds41_http_parse_error *err) {
    size_t i = 0, part_start = 0;
    int part = 0; /* 0 method, 1 target, 2 version */
    for (; i < have; i++) {
        unsigned char c = (unsigned char)line[i];
        size_t n = i - part_start; /* bytes of this part before c */
        if (c == ' ' && part < 2) {
            if (n == 0)
                return fail(err, 400, "malformed_request",
                            "the request line is not 'METHOD target HTTP/1.1'");
            part++;
            part_start = i + 1;
            continue;
        }
        if (part == 0) {
            if (!is_tchar(c))
                return fail(err, 400, "malformed_request", "the request line does not start with a method");
            if (n == 15)
                return fail(err, 501, "method_not_implemented", "the method is longer than 15 bytes");
        } else if (part == 1) {
            if (c <= 0x20 || c >= 0x7f || c == '#')
                return fail(err, 400, "malformed_request",
                            "the request target has a byte 0x%02x it may not have", c);
            if (n == DS41_HTTP_MAX_TARGET)
                return fail(err, 414, "uri_too_long", "the request target is longer than %u bytes",
                            DS41_HTTP_MAX_TARGET);
        } else if (n == 8 || c < 0x21 || c >= 0x7f) {
            return fail(err, 400, "malformed_request", "the request line does not end in an HTTP version");
        }
    }
    return DS41_HTTP_PARSE_INCOMPLETE;
}

/* The path of a request target, %-decoded, without the query. */
static ds41_http_parse_result decode_target(const char *t, size_t n, ds41_http_head *h,
                                            ds41_http_parse_error *err) {
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)t[i];
        if (c <= 0x20 || c >= 0x7f || c == '#')
            return fail(err, 400, "malformed_request", "the request target has a byte 0x%02x it may not have",
                        c);
    }
    size_t i = 0;
    if (n >= 7 && (strncasecmp(t, "http://", 7) == 0 || (n >= 8 && strncasecmp(t, "https://", 8) == 0))) {
        i = t[4] == ':' ? 7 : 8; /* absolute form: skip scheme and authority */
        while (i < n && t[i] != '/' && t[i] != '?') i++;
        if (i == n || t[i] == '?') {
            snprintf(h->path, sizeof h->path, "/");
            return DS41_HTTP_PARSE_OK;
        }
    } else if (t[0] != '/') {
        return fail(err, 400, "malformed_request", "the request target must be a path starting with '/'");
    }
    size_t o = 0;
    for (; i < n && t[i] != '?'; i++) {
        char c = t[i];
        if (c == '%') {
            int hi = i + 2 < n ? hex_value(t[i + 1]) : -1, lo = i + 2 < n ? hex_value(t[i + 2]) : -1;
            if (hi < 0 || lo < 0)
                return fail(err, 400, "malformed_request", "a bad %%-escape in the request target");
            c = (char)(hi * 16 + lo);
            if (c == 0) return fail(err, 400, "malformed_request", "%%00 in the request target");
            i += 2;
        }
        h->path[o++] = c;
    }
    h->path[o] = 0;
    return DS41_HTTP_PARSE_OK;
}

static ds41_http_parse_result parse_request_line(const char *line, size_t ll, ds41_http_head *h,
                                                 ds41_http_parse_error *err) {
    if (scan_request_line(line, ll, err) == DS41_HTTP_PARSE_ERROR) return DS41_HTTP_PARSE_ERROR;
    const char *sp1 = memchr(line, ' ', ll);
    if (!sp1) return fail(err, 400, "malformed_request", "the request line is not 'METHOD target HTTP/1.1'");
    const char *target = sp1 + 1;
    const char *sp2 = memchr(target, ' ', ll - (size_t)(target - line));
    if (!sp2 || sp2 == target)
        return fail(err, 400, "malformed_request", "the request line is not 'METHOD target HTTP/1.1'");
    const char *ver = sp2 + 1;
    size_t vl = ll - (size_t)(ver - line);
    if (vl != 8 || memcmp(ver, "HTTP/", 5) != 0 || ver[5] < '0' || ver[5] > '9' || ver[6] != '.' ||
        ver[7] < '0' || ver[7] > '9')
        return fail(err, 400, "malformed_request", "the request line does not end in an HTTP version");
    if (ver[5] != '1' || (ver[7] != '0' && ver[7] != '1'))
        return fail(err, 505, "http_version_not_supported",
                    "HTTP/%c.%c is not supported (HTTP/1.1 and 1.0 are)", ver[5], ver[7]);
    h->minor = ver[7] - '0';
    memcpy(h->method, line, (size_t)(sp1 - line));
    h->method[sp1 - line] = 0;
    return decode_target(target, (size_t)(sp2 - target), h, err);
}

/* What the header fields said, folded in line by line. */
typedef struct fields {
    unsigned n;
    unsigned hosts;
    bool te_seen, te_bad;
    unsigned te_codings;
    bool conn_close, conn_keep;
} fields;

static ds41_http_parse_result parse_length(const char *v, size_t n, ds41_http_head *h,
                                           ds41_http_parse_error *err) {
    uint64_t x = 0;
    if (n == 0) return fail(err, 400, "invalid_content_length", "Content-Length is empty");
    for (size_t i = 0; i < n; i++) {
        if (v[i] < '0' || v[i] > '9')
            return fail(err, 400, "invalid_content_length", "Content-Length '%.*s' is not a decimal number",
                        (int)(n > 40 ? 40 : n), v);
        if (x > (UINT64_C(0x7fffffffffffffff) - (uint64_t)(v[i] - '0')) / 10)
            return fail(err, 400, "invalid_content_length", "Content-Length is too large");
        x = x * 10 + (uint64_t)(v[i] - '0');
    }
    if (h->has_length && h->content_length != x)
        return fail(err, 400, "invalid_content_length", "two different Content-Length values");
    h->has_length = true;
    h->content_length = x;
    return DS41_HTTP_PARSE_OK;
}

/* Call fn on each non-empty element of a comma-separated list. */
static void each_element(const char *v, size_t n, void (*fn)(const char *e, size_t n, void *ctx), void *ctx) {
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        while (j < n && v[j] != ',') j++;
        size_t a = i, b = j;
        while (a < b && is_ows(v[a])) a++;
        while (b > a && is_ows(v[b - 1])) b--;
        if (b > a) fn(v + a, b - a, ctx);
        i = j + 1;
    }
}

static void te_element(const char *e, size_t n, void *ctx) {
    fields *f = ctx;
    f->te_codings++;
    if (!eq_nocase(e, n, "chunked")) f->te_bad = true;
}

static void conn_element(const char *e, size_t n, void *ctx) {
    fields *f = ctx;
    if (eq_nocase(e, n, "close")) f->conn_close = true;
    if (eq_nocase(e, n, "keep-alive")) f->conn_keep = true;
}

static ds41_http_parse_result parse_field(const char *line, size_t ll, ds41_http_head *h, fields *f,
                                          ds41_http_parse_error *err) {
    if (++f->n > DS41_HTTP_MAX_FIELDS)
        return fail(err, 431, "header_too_large", "more than %u header fields", DS41_HTTP_MAX_FIELDS);
    if (is_ows(line[0]))
        return fail(err, 400, "invalid_header", "obsolete line folding in the header section");
    const char *colon = memchr(line, ':', ll);
    if (!colon || colon == line) return fail(err, 400, "invalid_header", "a header line without 'name:'");
    size_t nl = (size_t)(colon - line);
    for (size_t i = 0; i < nl; i++)
        if (!is_tchar((unsigned char)line[i]))
            return fail(err, 400, "invalid_header", "a header name with a byte 0x%02x it may not have",
                        (unsigned char)line[i]);
    const char *v = colon + 1, *end = line + ll;
    while (v < end && is_ows(*v)) v++;
    while (end > v && is_ows(end[-1])) end--;
    size_t vl = (size_t)(end - v);
    for (size_t i = 0; i < vl; i++)
        if (!is_value_char((unsigned char)v[i]))
            return fail(err, 400, "invalid_header", "header %.*s has a control byte 0x%02x in its value",
                        (int)(nl > 40 ? 40 : nl), line, (unsigned char)v[i]);
    if (eq_nocase(line, nl, "Host")) {
        if (++f->hosts > 1) return fail(err, 400, "invalid_header", "more than one Host header");
    } else if (eq_nocase(line, nl, "Content-Length")) {
        return parse_length(v, vl, h, err);
    } else if (eq_nocase(line, nl, "Transfer-Encoding")) {
        f->te_seen = true;
        each_element(v, vl, te_element, f);
    } else if (eq_nocase(line, nl, "Connection")) {
        each_element(v, vl, conn_element, f);
    } else if (eq_nocase(line, nl, "Expect")) {
        if (eq_nocase(v, vl, "100-continue")) h->expect_continue = true;
    } else if (eq_nocase(line, nl, "Content-Type") && !h->has_content_type) {
        size_t n = vl > DS41_HTTP_MAX_CONTENT_TYPE ? DS41_HTTP_MAX_CONTENT_TYPE : vl;
        memcpy(h->content_type, v, n);
        h->content_type[n] = 0;
        h->has_content_type = true;
    }
    return DS41_HTTP_PARSE_OK;
}

/* The checks that need the whole header section. */
static ds41_http_parse_result finish_head(ds41_http_head *h, const fields *f, ds41_http_parse_error *err) {
    if (h->minor == 1 && f->hosts == 0)
        return fail(err, 400, "missing_host", "an HTTP/1.1 request needs a Host header");
    if (f->te_seen) {
        if (h->minor == 0)
            return fail(err, 400, "invalid_header", "Transfer-Encoding in an HTTP/1.0 request");
        if (f->te_bad || f->te_codings != 1)
            return fail(err, 501, "unsupported_transfer_encoding",
                        "Transfer-Encoding other than 'chunked' is not supported");
        if (h->has_length)
            return fail(err, 400, "invalid_content_length", "both Content-Length and Transfer-Encoding");
        h->chunked = true;
    }
    if (h->minor == 0) h->expect_continue = false;
    h->keep_alive = h->minor == 1 ? !f->conn_close : f->conn_keep && !f->conn_close;
    return DS41_HTTP_PARSE_OK;
}

ds41_http_parse_result ds41_http_parse_head(const char *buf, size_t len, ds41_http_head *h, size_t *used,
                                            ds41_http_parse_error *err) {
    memset(h, 0, sizeof *h);
    *used = 0;
    /* Empty lines before the request line are skipped (a client may send a
     * CRLF after a body), a bounded number of them. */
    size_t i = 0;
    while (i < len && (buf[i] == '\n' || (buf[i] == '\r' && i + 1 < len && buf[i + 1] == '\n'))) {
        i += buf[i] == '\r' ? 2 : 1;
        if (i > MAX_LEADING_EMPTY)
            return fail(err, 400, "malformed_request", "too many empty lines before the request line");
    }
    const char *line = buf + i;
    const char *nl = memchr(line, '\n', len - i);
    if (!nl) {
        size_t have = len - i;
        if (have && line[have - 1] == '\r') have--; /* its LF may come next */
        /* The scan bounds the request line far below DS41_HTTP_MAX_HEAD. */
        return scan_request_line(line, have, err);
    }
    size_t ll = (size_t)(nl - line);
    if (ll && line[ll - 1] == '\r') ll--;
    ds41_http_parse_result r = parse_request_line(line, ll, h, err);
    if (r != DS41_HTTP_PARSE_OK) return r;
    fields f = {0};
    const char *end = buf + len;
    line = nl + 1;
    for (;;) {
        nl = memchr(line, '\n', (size_t)(end - line));
        if (!nl || (size_t)(nl + 1 - buf) > DS41_HTTP_MAX_HEAD) {
            if (len > DS41_HTTP_MAX_HEAD)
                return fail(err, 431, "header_too_large", "the request head is larger than %u bytes",
                            DS41_HTTP_MAX_HEAD);
            return DS41_HTTP_PARSE_INCOMPLETE;
        }
        ll = (size_t)(nl - line);
        if (ll && line[ll - 1] == '\r') ll--;
        if (memchr(line, '\r', ll))
            return fail(err, 400, "invalid_header", "a bare CR in the header section");
        if (ll == 0) break;
        r = parse_field(line, ll, h, &f, err);
        if (r != DS41_HTTP_PARSE_OK) return r;
        line = nl + 1;
    }
    r = finish_head(h, &f, err);
    if (r != DS41_HTTP_PARSE_OK) return r;
    *used = (size_t)(nl + 1 - buf);
    return DS41_HTTP_PARSE_OK;
}

/* ============================================================== chunked */

enum {
    CH_SIZE = 0,   /* first hex digit of a chunk size */
    CH_SIZE_MORE,  /* more hex digits, or what ends the size */
    CH_SIZE_WS,    /* whitespace after the size (before ';' or the line end) */
    CH_EXT,        /* a chunk extension, skipped */
    CH_SIZE_LF,    /* LF after the size line's CR */
    CH_DATA,       /* chunk data */
    CH_DATA_CR,    /* the CR (or bare LF) after the data */
    CH_DATA_LF,    /* the LF after that CR */
    CH_TRAILER,    /* start of a trailer line or the final empty line */
    CH_TRAILER_IN, /* inside a trailer field line, skipped */
    CH_TRAILER_LF, /* LF after a trailer line's CR */
    CH_END_LF,     /* LF of the final empty line */
    CH_DONE,
};

#define CH_MAX_EXT 4096u      /* bytes of one chunk-size line's extension */
#define CH_MAX_TRAILER 16384u /* bytes of the whole trailer section */

void ds41_http_chunked_init(ds41_http_chunked *c) {
    memset(c, 0, sizeof *c);
}

static ds41_http_parse_result chunk_fail(ds41_http_parse_error *err, const char *what) {
    return fail(err, 400, "invalid_chunked_encoding", "malformed chunked body: %s", what);
}

ds41_http_parse_result ds41_http_chunked_decode(ds41_http_chunked *c, char *buf, size_t len, size_t *used,
                                                size_t *out_len, ds41_http_parse_error *err) {
    size_t i = 0, o = 0;
    *used = 0;
    *out_len = 0;
    while (i < len && c->state != CH_DONE) {
        char ch = buf[i];
        switch (c->state) {
        case CH_SIZE:
        case CH_SIZE_MORE: {
            int d = hex_value(ch);
            if (d >= 0) {
                if (++c->digits > 16) return chunk_fail(err, "a chunk size of more than 16 hex digits");
                c->remaining = c->remaining * 16 + (uint64_t)d;
                c->state = CH_SIZE_MORE;
                i++;
                break;
            }
            if (c->state == CH_SIZE) return chunk_fail(err, "a chunk size that is not hexadecimal");
            c->state = CH_SIZE_WS;
            break; /* look at ch again */
        }
        case CH_SIZE_WS:
            if (is_ows(ch)) {
                i++;
            } else if (ch == ';') {
                c->state = CH_EXT;
                c->line_len = 0;
                i++;
            } else if (ch == '\r') {
                c->state = CH_SIZE_LF;
                i++;
            } else if (ch == '\n') {
                c->state = CH_SIZE_LF;
            } else {
                return chunk_fail(err, "junk after a chunk size");
            }
            break;
        case CH_EXT:
            if (ch == '\r' || ch == '\n') {
                c->state = CH_SIZE_WS;
                break;
            }
            if (!is_value_char((unsigned char)ch) || ++c->line_len > CH_MAX_EXT)
                return chunk_fail(err, "a bad or too long chunk extension");
            i++;
            break;
        case CH_SIZE_LF:
            if (ch != '\n') return chunk_fail(err, "a chunk size line without CRLF");
            i++;
            c->digits = 0;
            c->state = c->remaining ? CH_DATA : CH_TRAILER;
            c->trailer_len = 0;
            break;
        case CH_DATA: {
            size_t n = len - i;
            if ((uint64_t)n > c->remaining) n = (size_t)c->remaining;
            memmove(buf + o, buf + i, n);
            o += n;
            i += n;
            c->remaining -= n;
            if (c->remaining == 0) c->state = CH_DATA_CR;
            break;
        }
        case CH_DATA_CR:
            if (ch == '\r') {
                c->state = CH_DATA_LF;
                i++;
            } else if (ch == '\n') {
                c->state = CH_DATA_LF;
            } else {
                return chunk_fail(err, "chunk data longer than its size (no CRLF after it)");
            }
            break;
        case CH_DATA_LF:
            if (ch != '\n') return chunk_fail(err, "chunk data not followed by CRLF");
            i++;
            c->state = CH_SIZE;
            break;
        case CH_TRAILER:
            if (ch == '\r') {
                c->state = CH_END_LF;
                i++;
            } else if (ch == '\n') {
                c->state = CH_END_LF;
            } else {
                c->state = CH_TRAILER_IN;
            }
            break;
        case CH_TRAILER_IN:
            if (ch == '\r' || ch == '\n') {
                c->state = CH_TRAILER_LF;
                if (ch == '\r') i++;
                break;
            }
            if (!is_value_char((unsigned char)ch) || ++c->trailer_len > CH_MAX_TRAILER)
                return chunk_fail(err, "a bad or too long trailer section");
            i++;
            break;
        case CH_TRAILER_LF:
            if (ch != '\n') return chunk_fail(err, "a trailer line without CRLF");
            i++;
            c->state = CH_TRAILER;
            break;
        case CH_END_LF:
            if (ch != '\n') return chunk_fail(err, "the chunked body does not end in CRLF");
            i++;
            c->state = CH_DONE;
            break;
        default:
            return chunk_fail(err, "decoder state");
        }
    }
    *used = i;
    *out_len = o;
    return c->state == CH_DONE ? DS41_HTTP_PARSE_OK : DS41_HTTP_PARSE_INCOMPLETE;
}
