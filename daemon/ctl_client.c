/* ds41ctl's HTTP client over a Unix socket (see ctl_client.h). */
#include "daemon/ctl_client.h"
#include "ds41_version.h"

#include "engine/text/pyjson.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

void ds41_ctl_response_free(ds41_ctl_response *r) {
    if (!r) return;
    free(r->body);
    memset(r, 0, sizeof *r);
}

static int connect_unix(const char *path, ds41_error *err) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) return ds41_fail(err, "socket path too long: %s", path);
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ds41_fail(err, "socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        int e = errno;
        close(fd);
        if (e == EACCES || e == EPERM)
            return ds41_fail(err, "permission denied on %s: members of the socket's group may connect", path);
        return ds41_fail(err, "cannot reach ds41d at %s: %s (is it running? systemctl status ds41d)", path, strerror(e));
    }
    return fd;
}

static int send_all(int fd, const char *p, size_t n, ds41_error *err) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return ds41_fail(err, "sending the request: %s", strerror(errno));
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int send_request(int fd, const char *method, const char *path, const char *body, size_t body_len,
                        ds41_error *err) {
    char head[1024];
    int n = snprintf(head, sizeof head,
                     "%s %s HTTP/1.1\r\nHost: ds41\r\nUser-Agent: ds41ctl/" DS41_VERSION
                     "\r\nConnection: close\r\n"
                     "Accept: application/json, text/event-stream\r\n",
                     method, path);
    if (n < 0 || (size_t)n >= sizeof head) return ds41_fail(err, "request path too long");
    if (body) {
        int m = snprintf(head + n, sizeof head - (size_t)n, "Content-Type: application/json\r\nContent-Length: %zu\r\n",
                         body_len);
        if (m < 0 || (size_t)(n + m) >= sizeof head) return ds41_fail(err, "request too long");
        n += m;
    }
    if ((size_t)n + 2 >= sizeof head) return ds41_fail(err, "request too long");
    memcpy(head + n, "\r\n", 2);
    n += 2;
    if (send_all(fd, head, (size_t)n, err) != 0) return -1;
    return body && body_len ? send_all(fd, body, body_len, err) : 0;
}

/* Response reader: raw bytes in, decoded body out. */
typedef struct reader {
    int fd;
    int timeout_ms;
    ds41_buf raw;       /* bytes received and not yet consumed */
    bool headers_done;
    bool chunked;
    long long content_length; /* -1 = until EOF */
    bool eof;
    bool body_done;
    /* chunked decoding */
    size_t chunk_left; /* data bytes left in the current chunk */
    int chunk_state;   /* 0 size line, 1 data, 2 CRLF after data, 3 trailers */
    ds41_buf body;     /* decoded */
    int status;
    char retry_after[16];
} reader;

static int fill(reader *r, ds41_error *err) {
    if (r->eof) return 0;
    struct pollfd p = {.fd = r->fd, .events = POLLIN};
    int pr;
    do pr = poll(&p, 1, r->timeout_ms > 0 ? r->timeout_ms : -1);
    while (pr < 0 && errno == EINTR);
    if (pr == 0) return ds41_fail(err, "no answer from ds41d within %d ms", r->timeout_ms);
    if (pr < 0) return ds41_fail(err, "poll: %s", strerror(errno));
    char buf[16384];
    ssize_t got;
    do got = recv(r->fd, buf, sizeof buf, 0);
    while (got < 0 && errno == EINTR);
    if (got < 0) return ds41_fail(err, "reading the answer: %s", strerror(errno));
    if (got == 0) {
        r->eof = true;
        return 0;
    }
    ds41_buf_put(&r->raw, buf, (size_t)got);
    if (r->raw.oom) return ds41_fail(err, "out of memory");
    return 0;
}

static void consume(ds41_buf *b, size_t n) {
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
    if (b->data) b->data[b->len] = 0;
}

static int parse_headers(reader *r, ds41_error *err) {
    while (!r->headers_done) {
        char *end = r->raw.data ? strstr(r->raw.data, "\r\n\r\n") : NULL;
        if (!end) {
            if (r->eof) return ds41_fail(err, "ds41d closed the connection without an answer");
            if (r->raw.len > 65536) return ds41_fail(err, "answer headers too long");
            if (fill(r, err) != 0) return -1;
            continue;
        }
        *end = 0;
        if (sscanf(r->raw.data, "HTTP/1.%*d %d", &r->status) != 1) return ds41_fail(err, "not an HTTP answer");
        r->content_length = -1;
        for (char *line = strstr(r->raw.data, "\r\n"); line; line = strstr(line, "\r\n")) {
            line += 2;
            if (strncasecmp(line, "Content-Length:", 15) == 0) r->content_length = atoll(line + 15);
            if (strncasecmp(line, "Transfer-Encoding:", 18) == 0 && strstr(line + 18, "chunked")) r->chunked = true;
            if (strncasecmp(line, "Retry-After:", 12) == 0) {
                const char *v = line + 12;
                while (*v == ' ') v++;
                size_t k = strcspn(v, "\r\n");
                snprintf(r->retry_after, sizeof r->retry_after, "%.*s", (int)(k < 15 ? k : 15), v);
            }
        }
        consume(&r->raw, (size_t)(end - r->raw.data) + 4);
        r->headers_done = true;
    }
    return 0;
}

/* Decode what is available of the body into r->body. */
static int decode(reader *r, ds41_error *err) {
    if (!r->chunked) {
        size_t take = r->raw.len;
        if (r->content_length >= 0) {
            long long left = r->content_length - (long long)r->body.len;
            if ((long long)take > left) take = (size_t)left;
        }
        ds41_buf_put(&r->body, r->raw.data ? r->raw.data : "", take);
        consume(&r->raw, r->raw.len);
        if ((r->content_length >= 0 && (long long)r->body.len >= r->content_length) || r->eof) r->body_done = true;
        return r->body.oom ? ds41_fail(err, "out of memory") : 0;
    }
    for (;;) {
        if (r->chunk_state == 0 || r->chunk_state == 2 || r->chunk_state == 3) {
            char *nl = r->raw.data ? memmem(r->raw.data, r->raw.len, "\r\n", 2) : NULL;
            if (!nl) break;
            size_t line_len = (size_t)(nl - r->raw.data);
            if (r->chunk_state == 0) {
                char *e;
                unsigned long long sz = strtoull(r->raw.data, &e, 16);
                if (e == r->raw.data) return ds41_fail(err, "bad chunked encoding in the answer");
                r->chunk_left = (size_t)sz;
                r->chunk_state = sz ? 1 : 3;
            } else if (r->chunk_state == 2) {
                if (line_len != 0) return ds41_fail(err, "bad chunked encoding in the answer");
                r->chunk_state = 0;
            } else if (line_len == 0) {
                consume(&r->raw, 2);
                r->body_done = true;
                return 0;
            }
            consume(&r->raw, line_len + 2);
        } else {
            size_t take = r->raw.len < r->chunk_left ? r->raw.len : r->chunk_left;
            if (!take) break;
            ds41_buf_put(&r->body, r->raw.data, take);
            consume(&r->raw, take);
            r->chunk_left -= take;
            if (!r->chunk_left) r->chunk_state = 2;
        }
    }
    if (r->eof) r->body_done = true; /* cut short: keep what came */
    return r->body.oom ? ds41_fail(err, "out of memory") : 0;
}

static int finish_response(reader *r, ds41_ctl_response *out, ds41_error *err) {
    out->status = r->status;
    snprintf(out->retry_after, sizeof out->retry_after, "%s", r->retry_after);
    if (!r->body.data) ds41_buf_put(&r->body, "", 0);
    out->body = ds41_buf_take(&r->body, &out->body_len);
    if (!out->body) {
        out->body = calloc(1, 1);
        out->body_len = 0;
        if (!out->body) return ds41_fail(err, "out of memory");
    }
    return 0;
}

int ds41_ctl_request(const char *socket_path, const char *method, const char *path, const char *body,
                     size_t body_len, int timeout_ms, ds41_ctl_response *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    int fd = connect_unix(socket_path, err);
    if (fd < 0) return -1;
    reader r = {.fd = fd, .timeout_ms = timeout_ms};
    int rc = -1;
    if (send_request(fd, method, path, body, body_len, err) != 0 || parse_headers(&r, err) != 0) goto out;
    if (strcmp(method, "HEAD") == 0 || r.status == 204 || r.status == 304) r.body_done = true;
    while (!r.body_done) {
        if (decode(&r, err) != 0) goto out;
        if (r.body_done) break;
        if (fill(&r, err) != 0) goto out;
    }
    rc = finish_response(&r, out, err);
out:
    close(fd);
    ds41_buf_free(&r.raw);
    ds41_buf_free(&r.body);
    return rc;
}

/* Hand every complete SSE event in r->body to the callback; false when it asked to stop. */
static bool deliver_events(reader *r, bool (*on_event)(void *, const char *, size_t), void *ctx) {
    for (;;) {
        char *end = r->body.data ? memmem(r->body.data, r->body.len, "\n\n", 2) : NULL;
        if (!end) return true;
        size_t ev_len = (size_t)(end - r->body.data);
        ds41_buf data = {0};
        for (size_t i = 0; i < ev_len;) {
            const char *line = r->body.data + i;
            const char *nl = memchr(line, '\n', ev_len - i);
            size_t ll = nl ? (size_t)(nl - line) : ev_len - i;
            if (ll >= 5 && memcmp(line, "data:", 5) == 0) {
                size_t skip = ll > 5 && line[5] == ' ' ? 6 : 5;
                if (data.len) ds41_buf_putc(&data, '\n');
                ds41_buf_put(&data, line + skip, ll - skip);
            }
            i += ll + 1;
        }
        consume(&r->body, ev_len + 2);
        bool go = true;
        if (data.len && !data.oom) go = on_event(ctx, data.data, data.len);
        ds41_buf_free(&data);
        if (!go) return false;
    }
}

int ds41_ctl_stream(const char *socket_path, const char *path, const char *body, size_t body_len,
                    bool (*on_event)(void *ctx, const char *data, size_t len), void *ctx, ds41_ctl_response *out,
                    ds41_error *err) {
    memset(out, 0, sizeof *out);
    int fd = connect_unix(socket_path, err);
    if (fd < 0) return -1;
    reader r = {.fd = fd, .timeout_ms = 0};
    int rc = -1;
    if (send_request(fd, "POST", path, body, body_len, err) != 0 || parse_headers(&r, err) != 0) goto out;
    bool streaming = r.status / 100 == 2;
    while (!r.body_done) {
        if (decode(&r, err) != 0) goto out;
        if (streaming && !deliver_events(&r, on_event, ctx)) break;
        if (r.body_done) break;
        if (fill(&r, err) != 0) goto out;
    }
    if (streaming) {
        deliver_events(&r, on_event, ctx);
        r.body.len = 0;
        if (r.body.data) r.body.data[0] = 0;
    }
    rc = finish_response(&r, out, err);
out:
    close(fd);
    ds41_buf_free(&r.raw);
    ds41_buf_free(&r.body);
    return rc;
}
