/* ipc over real sockets: an in-process ds41_http_server with the async mock
 * service on a Unix socket (and a loopback TCP socket), driven by a raw
 * socket client, curl, and forked unprivileged clients.  Covers every route,
 * exact SSE framing, limits (413, 408 for slow-drip clients), broken framing,
 * client disconnects cancelling generations, peer-credential classes,
 * 10,000 fuzzed requests, and graceful stop. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include "daemon/listen.h"
#include "ipc/api.h"
#include "ipc/http_server.h"
#include "tests/http_bad_requests.h"
#include "tests/ipc_mock_service.h"
#include "tests/ipc_test_util.h"
#include "tests/tap.h"

#define SOCK_GID 45671
#define ADMIN_GID 45672
#define NOBODY 65534
#define REQUEST_TIMEOUT_MS 1500
#define MAX_BODY 65536

static char dir[32];
static char sock_path[64];
static int tcp_port;
static mock_service *mock;
static ds41_api *api;
static ds41_http_metrics *metrics;
static ds41_http_server *server;

/* The server's diagnostics are counted, not printed. */
static unsigned log_lines;
static void count_log(void *ctx, const char *msg) {
    (void)ctx;
    (void)msg;
    __atomic_add_fetch(&log_lines, 1, __ATOMIC_RELAXED);
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------- client */

typedef struct raw {
    char *p;
    size_t len, cap;
} raw;

static void raw_add(raw *r, const char *s, size_t n) {
    if (r->len + n + 1 > r->cap) {
        size_t cap = r->cap ? r->cap : 4096;
        while (cap < r->len + n + 1) cap *= 2;
        r->p = realloc(r->p, cap);
        r->cap = cap;
    }
    memcpy(r->p + r->len, s, n);
    r->len += n;
    r->p[r->len] = 0;
}

static int connect_unix(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static int connect_tcp(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    return fd;
}

static int send_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Read into r until `needle` appears (NULL: until any bytes arrived), the
 * peer closes, or the timeout passes. */
typedef enum { RD_FOUND, RD_CLOSED, RD_TIMEOUT } rd_result;

static rd_result read_until(int fd, raw *r, const char *needle, int timeout_ms) {
    int64_t deadline = now_ms() + timeout_ms;
    size_t start = r->len;
    for (;;) {
        if (needle && r->len && strstr(r->p, needle)) return RD_FOUND;
        if (!needle && r->len > start) return RD_FOUND;
        int64_t left = deadline - now_ms();
        if (left <= 0) return RD_TIMEOUT;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int rc = poll(&p, 1, (int)left);
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) return RD_TIMEOUT;
        char buf[16384];
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return RD_CLOSED;
        raw_add(r, buf, (size_t)n);
    }
}

/* Decode a chunked body: 1 complete, 0 incomplete, -1 malformed. */
static int dechunk(const char *p, size_t len, raw *out) {
    size_t i = 0;
    out->len = 0;
    for (;;) {
        const char *crlf = NULL;
        for (size_t k = i; k + 1 < len; k++)
            if (p[k] == '\r' && p[k + 1] == '\n') {
                crlf = p + k;
                break;
            }
        if (!crlf) return 0;
        char *end;
        unsigned long n = strtoul(p + i, &end, 16);
        if (end == p + i) return -1;
        size_t data = (size_t)(crlf - p) + 2;
        if (n == 0) return len >= data + 2 ? 1 : 0;
        if (len < data + n + 2) return 0;
        raw_add(out, p + data, n);
        i = data + n + 2;
    }
}

typedef struct resp {
    int status; /* 0 = none */
    char head[8192];
    raw body;
    bool closed;
    bool timed_out;
    json_t *json;
} resp;

static void resp_free(resp *r) {
    free(r->body.p);
    json_decref(r->json);
    memset(r, 0, sizeof *r);
}

static const char *header_value(const resp *r, const char *name, char *out, size_t n) {
    char key[96];
    snprintf(key, sizeof key, "\r\n%s:", name);
    const char *h = strcasestr(r->head, key);
    if (!h) return NULL;
    h += strlen(key);
    while (*h == ' ') h++;
    size_t l = strcspn(h, "\r\n");
    if (l >= n) l = n - 1;
    memcpy(out, h, l);
    out[l] = 0;
    return out;
}

/* Read one response (skipping 1xx) from fd. */
static void read_response(int fd, resp *r, int timeout_ms) {
    raw in = {0};
    int64_t deadline = now_ms() + timeout_ms;
    memset(r, 0, sizeof *r);
    for (;;) {
        char *hend = in.len ? strstr(in.p, "\r\n\r\n") : NULL;
        if (hend) {
            size_t hl = (size_t)(hend - in.p) + 4;
            int status = 0;
            if (sscanf(in.p, "HTTP/1.%*d %d", &status) != 1) break;
            if (status >= 100 && status < 200) { /* interim */
                memmove(in.p, in.p + hl, in.len - hl + 1);
                in.len -= hl;
                continue;
            }
            r->status = status;
            snprintf(r->head, sizeof r->head, "%.*s", (int)hl, in.p);
            char v[64];
            const char *te = header_value(r, "Transfer-Encoding", v, sizeof v);
            if (te && strcasecmp(te, "chunked") == 0) {
                for (;;) {
                    int d = dechunk(in.p + hl, in.len - hl, &r->body);
                    if (d != 0) break;
                    rd_result rr = read_until(fd, &in, NULL, (int)(deadline - now_ms()));
                    if (rr == RD_CLOSED) r->closed = true;
                    if (rr == RD_TIMEOUT) r->timed_out = true;
                    if (rr != RD_FOUND) {
                        dechunk(in.p + hl, in.len - hl, &r->body);
                        break;
                    }
                }
            } else {
                const char *cl = header_value(r, "Content-Length", v, sizeof v);
                size_t want = cl ? strtoul(cl, NULL, 10) : SIZE_MAX;
                while (in.len - hl < want) {
                    rd_result rr = read_until(fd, &in, NULL, (int)(deadline - now_ms()));
                    if (rr == RD_CLOSED) {
                        r->closed = true;
                        break;
                    }
                    if (rr == RD_TIMEOUT) {
                        r->timed_out = true;
                        break;
                    }
                }
                size_t have = in.len - hl < want ? in.len - hl : want;
                raw_add(&r->body, in.p + hl, have);
                if (!r->body.p) raw_add(&r->body, "", 0);
            }
            break;
        }
        rd_result rr = read_until(fd, &in, "\r\n\r\n", (int)(deadline - now_ms()));
        if (rr == RD_CLOSED) {
            r->closed = true;
            if (!strstr(in.p ? in.p : "", "\r\n\r\n")) break;
        } else if (rr == RD_TIMEOUT) {
            r->timed_out = true;
            break;
        }
    }
    if (!r->body.p) raw_add(&r->body, "", 0);
    if (r->status) r->json = json_loadb(r->body.p, r->body.len, 0, NULL);
    free(in.p);
}

static void build_request(raw *out, const char *method, const char *path, const char *body,
                          const char *extra_headers, bool close_conn) {
    char head[1024];
    int n = snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: ds41\r\n%s%s", method, path,
                     close_conn ? "Connection: close\r\n" : "", extra_headers ? extra_headers : "");
    raw_add(out, head, (size_t)n);
    if (body) {
        n = snprintf(head, sizeof head, "Content-Type: application/json\r\nContent-Length: %zu\r\n",
                     strlen(body));
        raw_add(out, head, (size_t)n);
    }
    raw_add(out, "\r\n", 2);
    if (body) raw_add(out, body, strlen(body));
}

static resp request_fd(int fd, const char *method, const char *path, const char *body, const char *extra) {
    resp r = {0};
    raw req = {0};
    build_request(&req, method, path, body, extra, true);
    if (fd < 0 || send_all(fd, req.p, req.len) != 0)
        memset(&r, 0, sizeof r);
    else
        read_response(fd, &r, 10000);
    free(req.p);
    return r;
}

static resp request(const char *method, const char *path, const char *body) {
    int fd = connect_unix(sock_path);
    resp r = request_fd(fd, method, path, body, NULL);
    if (fd >= 0) close(fd);
    return r;
}

static const char *chat(const char *extra) {
    static char body[1024];
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]%s%s}",
             extra ? "," : "", extra ? extra : "");
    return body;
}

static unsigned wait_cancels(unsigned want, int timeout_ms) {
    int64_t deadline = now_ms() + timeout_ms;
    unsigned c;
    while ((c = mock_service_cancels(mock)) < want && now_ms() < deadline) sleep_ms(10);
    return c;
}

/* ------------------------------------------------------------- sockets */

/* The socket comes from daemon/listen.h (its own tests are in test_systemd); here only the file
 * the server serves on: mode 0660 and the group the auth tests' peers use. */
static void test_listen_helpers(void) {
    struct stat st;
    TAP_CHECK(stat(sock_path, &st) == 0 && S_ISSOCK(st.st_mode) && (st.st_mode & 07777) == 0660 &&
                  st.st_gid == SOCK_GID,
              "the served socket file: mode 0660, group %d", SOCK_GID);
}

/* ----------------------------------------------------------- happy paths */

static void test_routes(void) {
    resp r = request("GET", "/health", NULL);
    TAP_CHECK(r.status == 200 && r.json && strcmp(jstr(r.json, "status"), "ok") == 0,
              "unix socket: GET /health -> 200 {\"status\":\"ok\"}");
    resp_free(&r);
    r = request("GET", "/v1/models?limit=5", NULL);
    TAP_CHECK(r.status == 200 && r.json && strcmp(jstr(r.json, "data[0].id"), "mock-model") == 0,
              "GET /v1/models (query string ignored)");
    resp_free(&r);
    r = request("POST", "/v1/chat/completions", chat("\"model\":\"mock-model\""));
    char v[128];
    TAP_CHECK(r.status == 200 && r.json &&
                  strcmp(jstr(r.json, "choices[0].message.content"), "Hello from the mock \xe2\x9c\x93") ==
                      0 &&
                  header_value(&r, "Content-Type", v, sizeof v) && strcmp(v, "application/json") == 0,
              "POST /v1/chat/completions non-stream over the socket");
    resp_free(&r);

    r = request("POST", "/v1/chat/completions",
                chat("\"stream\":true,\"stream_options\":{\"include_usage\":true}"));
    char why[128] = "";
    json_t *ev = r.status == 200 ? sse_split(r.body.p, r.body.len, NULL, why, sizeof why) : NULL;
    size_t n = json_array_size(ev);
    if (n != 9) TAP_NOTE("stream body (%zu bytes, %zu events): %s", r.body.len, n, r.body.p);
    TAP_CHECK(r.status == 200 && header_value(&r, "Content-Type", v, sizeof v) &&
                  strcmp(v, "text/event-stream") == 0 && header_value(&r, "Transfer-Encoding", v, sizeof v) &&
                  strcmp(v, "chunked") == 0 && header_value(&r, "Cache-Control", v, sizeof v) &&
                  strcmp(v, "no-cache") == 0,
              "chat stream: text/event-stream, chunked, no-cache");
    TAP_CHECK(ev && n == 9 &&
                  strcmp(jstr(json_array_get(ev, 0), "choices[0].delta.role"), "assistant") == 0 &&
                  strcmp(jstr(json_array_get(ev, 6), "choices[0].finish_reason"), "stop") == 0 &&
                  jint(json_array_get(ev, 7), "usage.total_tokens") > 5 &&
                  strcmp(json_string_value(json_array_get(ev, 8)), "[DONE]") == 0 &&
                  strcmp(r.body.p + r.body.len - 14, "data: [DONE]\n\n") == 0,
              "chat stream: exact SSE framing, role chunk, 5 deltas, finish, usage chunk, [DONE] (%s)", why);
    json_decref(ev);
    resp_free(&r);

    r = request("POST", "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2}");
    TAP_CHECK(r.status == 200 && r.json && strcmp(jstr(r.json, "choices[0].text"), "Hello from") == 0,
              "POST /v1/completions non-stream");
    resp_free(&r);
    r = request("POST", "/v1/completions", "{\"prompt\":\"x\",\"stream\":true}");
    ev = r.status == 200 ? sse_split(r.body.p, r.body.len, NULL, why, sizeof why) : NULL;
    TAP_CHECK(ev && json_array_size(ev) == 7 &&
                  strcmp(json_string_value(json_array_get(ev, 6)), "[DONE]") == 0,
              "POST /v1/completions stream");
    json_decref(ev);
    resp_free(&r);
    r = request("POST", "/tokenize", "{\"prompt\":\"ab\"}");
    TAP_CHECK(r.status == 200 && r.json && jint(r.json, "count") == 2, "POST /tokenize");
    resp_free(&r);
    r = request("POST", "/detokenize", "{\"tokens\":[111,107]}");
    TAP_CHECK(r.status == 200 && r.json && strcmp(jstr(r.json, "content"), "ok") == 0, "POST /detokenize");
    resp_free(&r);
    r = request("GET", "/admin/cache", NULL);
    TAP_CHECK(r.status == 200 && r.json && jint(r.json, "pages_total") == 20,
              "root is admin: GET /admin/cache");
    resp_free(&r);
    r = request("DELETE", "/admin/sessions/sess-cached", NULL);
    TAP_CHECK(r.status == 200, "root: DELETE /admin/sessions/{id}");
    resp_free(&r);
    r = request("POST", "/v1/chat/completions", chat("\"model\":\"queue-full\""));
    TAP_CHECK(r.status == 429 && header_value(&r, "Retry-After", v, sizeof v) && strcmp(v, "3") == 0 &&
                  is_error_shape(r.json, "rate_limit_error", "queue_full", NULL),
              "queue full over the socket: 429 + Retry-After: 3");
    resp_free(&r);

    /* two requests on one kept-alive connection */
    int fd = connect_unix(sock_path);
    raw req = {0};
    build_request(&req, "GET", "/health", NULL, NULL, false);
    resp a = {0}, b = {0};
    if (fd >= 0 && send_all(fd, req.p, req.len) == 0) read_response(fd, &a, 5000);
    if (fd >= 0 && send_all(fd, req.p, req.len) == 0) read_response(fd, &b, 5000);
    TAP_CHECK(a.status == 200 && b.status == 200, "keep-alive: two requests on one connection");
    resp_free(&a);
    resp_free(&b);
    free(req.p);
    if (fd >= 0) close(fd);
}

static void test_curl(void) {
    if (access("/usr/bin/curl", X_OK) != 0) {
        TAP_SKIP("curl is not installed");
        TAP_SKIP("curl is not installed");
        return;
    }
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "curl -sS -N --max-time 20 --unix-socket %s http://ds41/v1/chat/completions "
             "-d '{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream\":true}'",
             sock_path);
    FILE *p = popen(cmd, "r");
    raw out = {0};
    char buf[4096];
    size_t n;
    while (p && (n = fread(buf, 1, sizeof buf, p)) > 0) raw_add(&out, buf, n);
    int rc = p ? pclose(p) : -1;
    char why[128] = "";
    json_t *ev = out.len ? sse_split(out.p, out.len, NULL, why, sizeof why) : NULL;
    TAP_CHECK(rc == 0 && ev && json_array_size(ev) == 8 &&
                  strcmp(json_string_value(json_array_get(ev, 7)), "[DONE]") == 0,
              "curl --unix-socket -d (form content type) gets the SSE stream (%s)", why);
    json_decref(ev);
    free(out.p);
    out = (raw){0};
    snprintf(cmd, sizeof cmd,
             "curl -sS --max-time 20 --unix-socket %s -H 'Content-Type: application/json' "
             "http://ds41/v1/chat/completions -d '{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
             "\"bogus\":1}' -w ' HTTP=%%{http_code}'",
             sock_path);
    p = popen(cmd, "r");
    while (p && (n = fread(buf, 1, sizeof buf, p)) > 0) raw_add(&out, buf, n);
    rc = p ? pclose(p) : -1;
    TAP_CHECK(rc == 0 && out.p && strstr(out.p, "HTTP=400") && strstr(out.p, "\"param\":\"bogus\""),
              "curl: unknown field -> 400 naming it");
    free(out.p);
}

/* ---------------------------------------------------------------- errors */

static void test_bad_input(void) {
    resp r = request("POST", "/v1/chat/completions", "{\"messages\":[");
    TAP_CHECK(r.status == 400 && is_error_shape(r.json, "invalid_request_error", "invalid_json", NULL),
              "socket: invalid JSON -> 400 invalid_json");
    resp_free(&r);
    r = request("POST", "/v1/chat/completions", chat("\"frobnicate\":true"));
    TAP_CHECK(r.status == 400 &&
                  is_error_shape(r.json, "invalid_request_error", "unknown_field", "frobnicate"),
              "socket: unknown field -> 400 naming it");
    resp_free(&r);
    r = request("POST", "/v1/chat/completions", chat("\"temperature\":\"warm\""));
    TAP_CHECK(r.status == 400 &&
                  is_error_shape(r.json, "invalid_request_error", "invalid_type", "temperature"),
              "socket: wrong type -> 400 naming the field");
    resp_free(&r);
    r = request("PUT", "/v1/models", "{}");
    char v[128];
    TAP_CHECK(r.status == 405 && header_value(&r, "Allow", v, sizeof v) && strcmp(v, "GET, HEAD") == 0,
              "socket: PUT /v1/models -> 405 Allow: GET, HEAD");
    resp_free(&r);

    /* 413 from Content-Length alone, before any body byte is sent */
    int fd = connect_unix(sock_path);
    char head[256];
    snprintf(head, sizeof head,
             "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             "Content-Length: %d\r\n\r\n",
             MAX_BODY * 16);
    if (fd >= 0) send_all(fd, head, strlen(head));
    if (fd >= 0) read_response(fd, &r, 5000);
    raw rest = {0};
    rd_result after = fd >= 0 ? read_until(fd, &rest, "\x01", 3000) : RD_TIMEOUT;
    TAP_CHECK(r.status == 413 && is_error_shape(r.json, "invalid_request_error", "request_too_large", NULL) &&
                  after == RD_CLOSED,
              "Content-Length over the limit -> 413 without reading the body, then close");
    free(rest.p);
    resp_free(&r);
    if (fd >= 0) close(fd);

    /* 413 instead of 100 Continue */
    fd = connect_unix(sock_path);
    snprintf(head, sizeof head,
             "POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n",
             MAX_BODY + 1);
    raw got = {0};
    if (fd >= 0) send_all(fd, head, strlen(head));
    if (fd >= 0) read_until(fd, &got, "\r\n\r\n", 5000);
    TAP_CHECK(got.p && strncmp(got.p, "HTTP/1.1 413", 12) == 0,
              "Expect: 100-continue with a too large body -> 413 at once");
    free(got.p);
    if (fd >= 0) close(fd);

    /* 413 for a chunked body crossing the limit */
    fd = connect_unix(sock_path);
    const char *ch = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    if (fd >= 0) send_all(fd, ch, strlen(ch));
    char *chunk = malloc(8192 + 16);
    int cl = sprintf(chunk, "2000\r\n");
    memset(chunk + cl, ' ', 8192);
    memcpy(chunk + cl + 8192, "\r\n", 2);
    for (int i = 0; fd >= 0 && i < MAX_BODY / 8192 + 2; i++)
        if (send_all(fd, chunk, (size_t)cl + 8194) != 0) break;
    free(chunk);
    if (fd >= 0) read_response(fd, &r, 5000);
    TAP_CHECK(r.status == 413 && is_error_shape(r.json, "invalid_request_error", "request_too_large", NULL),
              "chunked body crossing the limit -> 413 and close (got %d)", r.status);
    resp_free(&r);
    if (fd >= 0) close(fd);

    /* broken chunked framing */
    static const char *const broken[] = {
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n",
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n",
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\n",
        "GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        "GET /health HTTP/1.1\r\nHost x\r\n\r\n",
        "GARBAGE\r\n\r\n",
    };
    size_t nb = sizeof broken / sizeof broken[0], bad_at = nb;
    int bad_status = 0;
    for (size_t i = 0; i < nb; i++) {
        fd = connect_unix(sock_path);
        if (fd >= 0) send_all(fd, broken[i], strlen(broken[i]));
        resp b = {0};
        if (fd >= 0) read_response(fd, &b, 5000);
        bool ok = (b.status >= 400 && b.status < 500) || (b.status == 0 && b.closed);
        if (!ok && bad_at == nb) {
            bad_at = i;
            bad_status = b.status;
        }
        resp_free(&b);
        if (fd >= 0) close(fd);
    }
    TAP_CHECK(bad_at == nb,
              "broken framing (bad chunk sizes, bad headers) -> 4xx or closed (case %zu got %d)", bad_at,
              bad_status);
    r = request("GET", "/health", NULL);
    TAP_CHECK(r.status == 200, "the server keeps serving after broken framing");
    resp_free(&r);
}

/* ------------------------------------------------- protocol errors, strictly */

/* Parse one response at p[0..len) strictly: exactly "HTTP/1.1 NNN reason",
 * header lines "Name: value" (no bare CR/LF), exactly one Content-Length of
 * digits, no Transfer-Encoding, and the whole body present.  Returns the
 * bytes it took (0 = malformed, *why says how). */
typedef struct strict_resp {
    int status;
    bool conn_close;
    json_t *json;
    size_t body_len;
} strict_resp;

static size_t strict_parse(const char *p, size_t len, strict_resp *out, char *why, size_t wn) {
    memset(out, 0, sizeof *out);
    const char *end = p + len, *line = p;
    const char *eol = memchr(line, '\n', len);
    if (len < 13 || memcmp(p, "HTTP/1.1 ", 9) != 0 || !eol || eol == p || eol[-1] != '\r') {
        snprintf(why, wn, "no HTTP/1.1 status line: %.40s", p);
        return 0;
    }
    for (int i = 9; i < 12; i++)
        if (p[i] < '0' || p[i] > '9') {
            snprintf(why, wn, "status is not 3 digits");
            return 0;
        }
    out->status = atoi(p + 9);
    if (p[12] != ' ') {
        snprintf(why, wn, "no space after the status");
        return 0;
    }
    int n_cl = 0;
    size_t cl = 0;
    line = eol + 1;
    for (;;) {
        eol = memchr(line, '\n', (size_t)(end - line));
        if (!eol || eol == line || eol[-1] != '\r') {
            snprintf(why, wn, "header line without CRLF");
            return 0;
        }
        size_t ll = (size_t)(eol - 1 - line);
        if (ll == 0) break;
        const char *colon = memchr(line, ':', ll);
        if (!colon || colon == line || memchr(line, '\r', ll) || memchr(line, ' ', (size_t)(colon - line))) {
            snprintf(why, wn, "malformed header line: %.*s", (int)(ll > 60 ? 60 : ll), line);
            return 0;
        }
        size_t nl = (size_t)(colon - line);
        const char *v = colon + 1;
        while (v < line + ll && *v == ' ') v++;
        size_t vl = (size_t)(line + ll - v);
        if (nl == 14 && strncasecmp(line, "Content-Length", 14) == 0) {
            n_cl++;
            cl = 0;
            if (vl == 0 || vl > 9) {
                snprintf(why, wn, "bad Content-Length");
                return 0;
            }
            for (size_t i = 0; i < vl; i++) {
                if (v[i] < '0' || v[i] > '9') {
                    snprintf(why, wn, "bad Content-Length");
                    return 0;
                }
                cl = cl * 10 + (size_t)(v[i] - '0');
            }
        }
        if (nl == 17 && strncasecmp(line, "Transfer-Encoding", 17) == 0) {
            snprintf(why, wn, "Transfer-Encoding in an error reply");
            return 0;
        }
        if (nl == 10 && strncasecmp(line, "Connection", 10) == 0 && vl == 5 &&
            strncasecmp(v, "close", 5) == 0)
            out->conn_close = true;
        line = eol + 1;
    }
    if (n_cl != 1) {
        snprintf(why, wn, "%d Content-Length headers", n_cl);
        return 0;
    }
    const char *body = eol + 1;
    if ((size_t)(end - body) < cl) {
        snprintf(why, wn, "body shorter than Content-Length %zu", cl);
        return 0;
    }
    out->body_len = cl;
    out->json = json_loadb(body, cl, 0, NULL);
    return (size_t)(body + cl - p);
}

/* Send `req` on a new connection, read until the server closes (or 5 s). */
static bool send_and_drain(const char *req, size_t len, raw *got) {
    int fd = connect_unix(sock_path);
    if (fd < 0) return false;
    send_all(fd, req, len);
    rd_result rr = read_until(fd, got, "\x01\x02\x03", 5000);
    close(fd);
    if (!got->p) raw_add(got, "", 0);
    return rr == RD_CLOSED;
}

/* One malformed request: exactly one well-formed reply with the error
 * shape, Connection: close, nothing after it, the connection closed. */
static void check_protocol_error(const char *name, const char *req, size_t len, int want, const char *code) {
    raw got = {0};
    bool closed = send_and_drain(req, len, &got);
    strict_resp s;
    char why[160] = "ok";
    size_t used = strict_parse(got.p, got.len, &s, why, sizeof why);
    if (used && s.status != want)
        snprintf(why, sizeof why, "status %d, want %d", s.status, want);
    else if (used && !is_error_shape(s.json,
                                     want >= 500 && want != 501 && want != 505 ? "server_error"
                                                                               : "invalid_request_error",
                                     code, NULL))
        snprintf(why, sizeof why, "body is not the error shape with code %s", code);
    else if (used && !s.conn_close)
        snprintf(why, sizeof why, "no Connection: close");
    else if (used && used != got.len)
        snprintf(why, sizeof why, "%zu bytes after the reply", got.len - used);
    else if (used && !closed)
        snprintf(why, sizeof why, "connection left open");
    TAP_CHECK(used && strcmp(why, "ok") == 0, "%s -> exactly one %d %s reply, then close (%s)", name, want,
              code, why);
    json_decref(s.json);
    free(got.p);
}

static void test_protocol_errors(void) {
    for (size_t i = 0; i < sizeof http_bad_requests / sizeof http_bad_requests[0]; i++) {
        const http_bad_request *b = &http_bad_requests[i];
        check_protocol_error(b->name, b->bytes, b->len, b->status, b->code);
    }

    /* oversized header block and URI */
    raw big = {0};
    raw_add(&big, "GET /health HTTP/1.1\r\nHost: x\r\n", 31);
    char hl[1100];
    memset(hl, 'v', sizeof hl);
    for (int i = 0; i < 80; i++) {
        char name[32];
        int n = snprintf(name, sizeof name, "X-Filler-%d: ", i);
        raw_add(&big, name, (size_t)n);
        raw_add(&big, hl, 1000);
        raw_add(&big, "\r\n", 2);
    }
    raw_add(&big, "\r\n", 2);
    check_protocol_error("80 KB header block", big.p, big.len, 431, "header_too_large");
    free(big.p);
    big = (raw){0};
    raw_add(&big, "GET /", 5);
    for (int i = 0; i < 20; i++) raw_add(&big, hl, 1000);
    raw_add(&big, " HTTP/1.1\r\nHost: x\r\n\r\n", 22);
    check_protocol_error("20 KB URI", big.p, big.len, 414, "uri_too_long");
    free(big.p);

    /* what stays allowed, parsed as strictly */
    raw got = {0};
    const char http10[] = "GET /health HTTP/1.0\r\n\r\n";
    bool closed = send_and_drain(http10, sizeof http10 - 1, &got);
    strict_resp s;
    char why[160] = "ok";
    size_t used = strict_parse(got.p, got.len, &s, why, sizeof why);
    TAP_CHECK(used == got.len && s.status == 200 && s.json && closed,
              "HTTP/1.0 without Host -> one 200 reply, closed (%s)", why);
    json_decref(s.json);
    free(got.p);

    /* pipelined: three requests in one write, answered in order, the last closes */
    got = (raw){0};
    const char pipe3[] =
        "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\n\r\n{\"prompt\":\"ab\"}"
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n"
        "\r\n5\r\n{\"pro\r\n9;ext=1\r\nmpt\":\"abc\r\n2\r\n\"}\r\n0\r\nX-Trailer: t\r\n\r\n";
    closed = send_and_drain(pipe3, sizeof pipe3 - 1, &got);
    strict_resp r3[3] = {{0}};
    size_t at = 0;
    int n_ok = 0;
    snprintf(why, sizeof why, "ok");
    for (int i = 0; i < 3; i++) {
        size_t u = strict_parse(got.p + at, got.len - at, &r3[i], why, sizeof why);
        if (!u) break;
        at += u;
        n_ok++;
    }
    TAP_CHECK(n_ok == 3 && at == got.len && closed && r3[0].status == 200 && r3[1].status == 200 &&
                  jint(r3[1].json, "count") == 2 && r3[2].status == 200 && jint(r3[2].json, "count") == 3 &&
                  !r3[0].conn_close && r3[2].conn_close,
              "pipelined GET, Content-Length POST and chunked POST (extension, trailer): three replies in "
              "order, then close (%d parsed, %s)",
              n_ok, why);
    for (int i = 0; i < 3; i++) json_decref(r3[i].json);
    free(got.p);

    /* a valid request, then a malformed one on the same connection: the first is answered normally */
    got = (raw){0};
    const char then_bad[] =
        "GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nContent-Length: z\r\n\r\n";
    closed = send_and_drain(then_bad, sizeof then_bad - 1, &got);
    strict_resp a, b;
    size_t ua = strict_parse(got.p, got.len, &a, why, sizeof why);
    size_t ub = ua ? strict_parse(got.p + ua, got.len - ua, &b, why, sizeof why) : 0;
    TAP_CHECK(ua && ub && ua + ub == got.len && a.status == 200 && b.status == 400 && b.conn_close &&
                  is_error_shape(b.json, "invalid_request_error", NULL, NULL) && closed,
              "a valid request then a malformed one: 200, then one 400 error reply and close (%s)", why);
    json_decref(a.json);
    if (ub) json_decref(b.json);
    free(got.p);

    /* keep-alive: the connection stays open between strictly parsed replies */
    int fd = connect_unix(sock_path);
    int n_alive = 0;
    for (int i = 0; fd >= 0 && i < 3; i++) {
        const char ka[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
        send_all(fd, ka, sizeof ka - 1);
        raw one = {0};
        strict_resp k = {0};
        int64_t until = now_ms() + 5000;
        size_t u = 0;
        while (now_ms() < until && read_until(fd, &one, NULL, 5000) == RD_FOUND)
            if ((u = strict_parse(one.p, one.len, &k, why, sizeof why)) != 0) break;
        if (u == one.len && k.status == 200 && !k.conn_close) n_alive++;
        json_decref(k.json);
        free(one.p);
    }
    if (fd >= 0) close(fd);
    TAP_CHECK(n_alive == 3, "keep-alive: three strictly parsed replies on one connection (%d)", n_alive);
}

/* Slow clients: the request deadline cuts them with 408. */
static void test_slow_clients(void) {
    /* body dribbled one byte at a time */
    int fd = connect_unix(sock_path);
    const char *head =
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 60\r\n\r\n";
    int64_t t0 = now_ms();
    if (fd >= 0) send_all(fd, head, strlen(head));
    raw got = {0};
    rd_result rr = RD_TIMEOUT;
    for (int i = 0; fd >= 0 && i < 60; i++) {
        if (send_all(fd, "{", 1) != 0) break;
        rr = read_until(fd, &got, "\r\n\r\n", 250);
        if (rr != RD_TIMEOUT) break;
    }
    int64_t took = now_ms() - t0;
    if (rr == RD_FOUND) rr = read_until(fd, &got, "\x01", 3000);
    TAP_CHECK(got.p && strncmp(got.p, "HTTP/1.1 408", 12) == 0 && strstr(got.p, "request_timeout") &&
                  rr == RD_CLOSED && took >= REQUEST_TIMEOUT_MS - 100 && took < REQUEST_TIMEOUT_MS + 8000,
              "slow-drip body: 408 request_timeout after ~%d ms (took %lld ms), then closed",
              REQUEST_TIMEOUT_MS, (long long)took);
    free(got.p);
    if (fd >= 0) close(fd);

    /* headers dribbled */
    fd = connect_unix(sock_path);
    got = (raw){0};
    t0 = now_ms();
    if (fd >= 0) send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\n", 31);
    rr = RD_TIMEOUT;
    for (int i = 0; fd >= 0 && i < 40; i++) {
        if (send_all(fd, "X-A: b\r\n", 8) != 0) break;
        rr = read_until(fd, &got, "\r\n\r\n", 200);
        if (rr != RD_TIMEOUT) break;
    }
    took = now_ms() - t0;
    TAP_CHECK(got.p && strncmp(got.p, "HTTP/1.1 408", 12) == 0 && took < REQUEST_TIMEOUT_MS + 8000,
              "slow-drip headers: 408 after %lld ms", (long long)took);
    free(got.p);
    if (fd >= 0) close(fd);

    /* connected and silent */
    fd = connect_unix(sock_path);
    got = (raw){0};
    t0 = now_ms();
    rr = fd >= 0 ? read_until(fd, &got, "\x01", REQUEST_TIMEOUT_MS + 3000) : RD_TIMEOUT;
    took = now_ms() - t0;
    TAP_CHECK(rr == RD_CLOSED && got.p && strncmp(got.p, "HTTP/1.1 408", 12) == 0,
              "a silent connection is answered 408 and closed after %lld ms", (long long)took);
    free(got.p);
    if (fd >= 0) close(fd);
}

/* ---------------------------------------------------------- streaming */

static void test_streaming(void) {
    /* flush per event: the gated mock emits the next token only when told */
    int fd = connect_unix(sock_path);
    raw req = {0}, got = {0};
    build_request(&req, "POST", "/v1/chat/completions", chat("\"model\":\"gated\",\"stream\":true"), NULL,
                  true);
    if (fd >= 0) send_all(fd, req.p, req.len);
    free(req.p);
    rd_result r1 = fd >= 0 ? read_until(fd, &got, "\"content\":\"Hello\"", 5000) : RD_TIMEOUT;
    bool role_first = got.p && strstr(got.p, "\"role\":\"assistant\"") &&
                      strstr(got.p, "\"role\":\"assistant\"") < strstr(got.p, "\"content\":\"Hello\"");
    bool no_second = got.p && !strstr(got.p, " from");
    rd_result ka = fd >= 0 ? read_until(fd, &got, ": keep-alive\n\n", 3000) : RD_TIMEOUT;
    mock_service_gate(mock);
    rd_result r2 = fd >= 0 ? read_until(fd, &got, "\"content\":\" from\"", 5000) : RD_TIMEOUT;
    TAP_CHECK(r1 == RD_FOUND && role_first && no_second && r2 == RD_FOUND,
              "stream: each event reaches the client as soon as it is produced");
    TAP_CHECK(ka == RD_FOUND, "stream: an idle stream sends ': keep-alive' comments");
    for (int i = 0; i < 8; i++) mock_service_gate(mock);
    rd_result r3 = fd >= 0 ? read_until(fd, &got, "data: [DONE]\n\n", 5000) : RD_TIMEOUT;
    TAP_CHECK(r3 == RD_FOUND, "stream: the gated stream completes with [DONE]");
    free(got.p);
    if (fd >= 0) close(fd);

    /* disconnect mid-stream cancels the generation */
    unsigned before = mock_service_cancels(mock);
    fd = connect_unix(sock_path);
    req = (raw){0};
    got = (raw){0};
    build_request(&req, "POST", "/v1/chat/completions", chat("\"model\":\"hang\",\"stream\":true"), NULL,
                  true);
    if (fd >= 0) send_all(fd, req.p, req.len);
    free(req.p);
    rd_result h = fd >= 0 ? read_until(fd, &got, "\"content\":\"Hello\"", 5000) : RD_TIMEOUT;
    free(got.p);
    int64_t t0 = now_ms();
    if (fd >= 0) close(fd);
    unsigned after = wait_cancels(before + 1, 5000);
    int64_t took = now_ms() - t0;
    /* well under the 1 s keep-alive period: noticed by polling the socket,
     * not by a failing write */
    TAP_CHECK(h == RD_FOUND && after == before + 1 && took < 5000,
              "client disconnect mid-stream -> the service's cancel within %lld ms", (long long)took);
    TAP_CHECK(mock_service_wait_idle(mock, 5000), "the cancelled stream's generation ends (terminal event)");

    /* disconnect while a non-streaming request waits */
    before = mock_service_cancels(mock);
    fd = connect_unix(sock_path);
    req = (raw){0};
    build_request(&req, "POST", "/v1/chat/completions", chat("\"model\":\"hang\""), NULL, true);
    if (fd >= 0) send_all(fd, req.p, req.len);
    free(req.p);
    int64_t until = now_ms() + 3000;
    while (mock_service_live(mock) == 0 && now_ms() < until) sleep_ms(5);
    t0 = now_ms();
    if (fd >= 0) close(fd);
    after = wait_cancels(before + 1, 5000);
    took = now_ms() - t0;
    TAP_CHECK(after == before + 1 && took < 8000,
              "client disconnect during a non-streaming request -> cancel within %lld ms", (long long)took);
    TAP_CHECK(mock_service_wait_idle(mock, 5000), "the cancelled request's generation ends");

    /* a client that stops reading a stream is cut off and its generation cancelled */
    before = mock_service_cancels(mock);
    fd = connect_unix(sock_path);
    req = (raw){0};
    build_request(&req, "POST", "/v1/chat/completions",
                  chat("\"model\":\"flood\",\"stream\":true,\"max_tokens\":1000000"), NULL, true);
    if (fd >= 0) send_all(fd, req.p, req.len);
    free(req.p);
    t0 = now_ms();
    after = wait_cancels(before + 1, 10000);
    took = now_ms() - t0;
    TAP_CHECK(after == before + 1 && took < 5000,
              "a client that stops reading a stream is cut off and the generation cancelled (%lld ms)",
              (long long)took);
    TAP_CHECK(mock_service_wait_idle(mock, 5000), "the stalled stream's generation ends");
    if (fd >= 0) close(fd);

    /* an admin deleting a live request's session ends its stream with an error */
    fd = connect_unix(sock_path);
    req = (raw){0};
    got = (raw){0};
    build_request(&req, "POST", "/v1/chat/completions", chat("\"model\":\"hang\",\"stream\":true"), NULL,
                  true);
    if (fd >= 0) send_all(fd, req.p, req.len);
    free(req.p);
    read_until(fd, &got, "\"content\":\"Hello\"", 5000);
    resp s = request("GET", "/admin/sessions", NULL);
    const char *live_id = NULL;
    for (size_t i = 0; s.json && i < json_array_size(jpath(s.json, "data")); i++)
        if (strncmp(jstr(json_array_get(jpath(s.json, "data"), i), "id"), "req-", 4) == 0)
            live_id = jstr(json_array_get(jpath(s.json, "data"), i), "id");
    char path[96];
    snprintf(path, sizeof path, "/admin/sessions/%s", live_id ? live_id : "none");
    resp d = request("DELETE", path, NULL);
    rd_result e = fd >= 0 ? read_until(fd, &got, "0\r\n\r\n", 5000) : RD_TIMEOUT;
    TAP_CHECK(live_id && d.status == 200 && e == RD_FOUND && strstr(got.p, "\"code\":\"cancelled\"") &&
                  !strstr(got.p, "[DONE]"),
              "DELETE of a live session ends its stream with an error event, no [DONE]");
    resp_free(&s);
    resp_free(&d);
    free(got.p);
    if (fd >= 0) close(fd);
}

/* ----------------------------------------------------------------- auth */

/* In a forked child: become `nobody` with the given supplementary groups,
 * make requests, report "health chat admin" statuses (or "connect=errno")
 * through the pipe. */
static void child_probe(int wfd, const gid_t *groups, size_t n_groups) {
    char out[128];
    if (setgroups(n_groups, groups) != 0 || setgid(NOBODY) != 0 || setuid(NOBODY) != 0) {
        snprintf(out, sizeof out, "drop=%d", errno);
    } else {
        int st[3] = {0, 0, 0};
        const char *paths[3] = {"/health", "/v1/chat/completions", "/admin/models"};
        int connect_errno = 0;
        for (int i = 0; i < 3; i++) {
            int fd = connect_unix(sock_path);
            if (fd < 0) {
                connect_errno = errno;
                break;
            }
            resp r = request_fd(fd, i == 1 ? "POST" : "GET", paths[i], i == 1 ? chat(NULL) : NULL, NULL);
            st[i] = r.status;
            resp_free(&r);
            close(fd);
        }
        if (connect_errno)
            snprintf(out, sizeof out, "connect=%d", connect_errno);
        else
            snprintf(out, sizeof out, "%d %d %d", st[0], st[1], st[2]);
    }
    (void)!write(wfd, out, strlen(out));
    close(wfd);
    _exit(0);
}

static void probe(const gid_t *groups, size_t n, char *out, size_t out_len) {
    int p[2];
    out[0] = 0;
    if (pipe(p) != 0) return;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        child_probe(p[1], groups, n);
    }
    close(p[1]);
    ssize_t got = pid > 0 ? read(p[0], out, out_len - 1) : -1;
    out[got > 0 ? got : 0] = 0;
    close(p[0]);
    if (pid > 0) waitpid(pid, NULL, 0);
}

static void test_auth(void) {
    if (geteuid() != 0) {
        TAP_SKIP("peer-credential classes need root to switch uid (run the tests as root)");
        TAP_SKIP("peer-credential classes need root to switch uid (run the tests as root)");
        TAP_SKIP("peer-credential classes need root to switch uid (run the tests as root)");
        return;
    }
    char out[128];
    gid_t g1[] = {SOCK_GID};
    probe(g1, 1, out, sizeof out);
    TAP_CHECK(strcmp(out, "200 200 403") == 0,
              "uid nobody in the socket group: /health 200, chat 200, /admin/models 403 (got '%s')", out);
    gid_t g2[] = {SOCK_GID, ADMIN_GID};
    probe(g2, 2, out, sizeof out);
    TAP_CHECK(strcmp(out, "200 200 200") == 0,
              "uid nobody with the admin group as a supplementary group: admin routes 200 (got '%s')", out);
    gid_t g3[] = {12345};
    probe(g3, 1, out, sizeof out);
    char want[32];
    snprintf(want, sizeof want, "connect=%d", EACCES);
    TAP_CHECK(strcmp(out, want) == 0,
              "a uid outside the socket group cannot connect (socket mode 0660) (got '%s')", out);
}

static void test_tcp_and_odd_peers(void) {
    int fd = connect_tcp(tcp_port);
    resp r = request_fd(fd, "GET", "/health", NULL, NULL);
    if (fd >= 0) close(fd);
    TAP_CHECK(r.status == 200, "loopback TCP listener: GET /health 200");
    resp_free(&r);
    fd = connect_tcp(tcp_port);
    r = request_fd(fd, "GET", "/admin/models", NULL, NULL);
    if (fd >= 0) close(fd);
    TAP_CHECK(r.status == 403 && is_error_shape(r.json, "permission_error", NULL, NULL),
              "loopback TCP peers have no credentials: inference class, admin 403");
    resp_free(&r);

    /* a client bound to a long socket name is served like any other (libmicrohttpd 0.9.75, used
     * before, read past its address buffer for such a client and had to refuse it) */
    char cpath[108];
    snprintf(cpath, sizeof cpath, "%s/client-bound-to-a-rather-long-socket-name.sock", dir);
    int c = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un ca = {.sun_family = AF_UNIX};
    snprintf(ca.sun_path, sizeof ca.sun_path, "%s", cpath);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock_path);
    bool bound =
        bind(c, (struct sockaddr *)&ca, sizeof ca) == 0 && connect(c, (struct sockaddr *)&sa, sizeof sa) == 0;
    r = request_fd(bound ? c : -1, "GET", "/health", NULL, NULL);
    close(c);
    unlink(cpath);
    TAP_CHECK(bound && r.status == 200, "a client bound to a long socket name is served");
    resp_free(&r);
    r = request("GET", "/health", NULL);
    TAP_CHECK(r.status == 200, "the server keeps serving after that peer");
    resp_free(&r);
}

/* ------------------------------------------------------------------ fuzz */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

typedef struct seed {
    const char *method, *path, *body;
} seed;

static const seed seeds[] = {
    {"GET", "/health", NULL},
    {"GET", "/v1/models", NULL},
    {"POST", "/v1/chat/completions",
     "{\"model\":\"mock-model\",\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\","
     "\"content\":"
     "[{\"type\":\"text\",\"text\":\"hi\"}]}],\"temperature\":0.5,\"max_tokens\":4,\"stop\":[\"x\"],\"seed\":"
     "1}"},
    {"POST", "/v1/chat/completions",
     "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream\":true,\"stream_options\":{\"include_"
     "usage\":true},"
     "\"logprobs\":true,\"top_logprobs\":2,\"reasoning_effort\":\"low\"}"},
    {"POST", "/v1/chat/completions",
     "{\"messages\":[{\"role\":\"user\",\"content\":\"w\"},{\"role\":\"assistant\",\"content\":null,\"tool_"
     "calls\":[{\"id\":"
     "\"c\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},{\"role\":\"tool\","
     "\"tool_call_id\":"
     "\"c\",\"content\":\"r\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\","
     "\"parameters\":{}}}],"
     "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}},\"response_format\":{\"type\":"
     "\"json_object\"}}"},
    {"POST", "/v1/completions", "{\"prompt\":\"abc\",\"max_tokens\":3,\"logprobs\":2,\"stream\":true}"},
    {"POST", "/v1/completions", "{\"prompt\":[[1,2,3]],\"echo\":false,\"logit_bias\":{\"12\":-5}}"},
    {"POST", "/tokenize", "{\"content\":\"hello\",\"add_special\":true}"},
    {"POST", "/detokenize", "{\"tokens\":[104,105]}"},
    {"GET", "/metrics", NULL},
    {"GET", "/admin/cache", NULL},
    {"POST", "/admin/models/load", "{\"path\":\"/models/x\"}"},
    {"DELETE", "/admin/sessions/abc", NULL},
};

static const char *const json_bits[] = {"null",
                                        "1e999",
                                        "\"\\ud800\"",
                                        "[]",
                                        "{}",
                                        "-0",
                                        "99999999999999999999",
                                        "true",
                                        "\"\\u0000\"",
                                        "[[[[[[[[",
                                        "\"x\":",
                                        ",",
                                        "}",
                                        "\xff\xfe",
                                        "1.5",
                                        "\"stream\":true",
                                        "\"n\":2",
                                        "{\"role\":\"tool\"}"};

static void mutate_body(raw *b) {
    int rounds = 1 + (int)(rnd() % 4);
    for (int k = 0; k < rounds; k++) {
        size_t pos = b->len ? rnd() % (b->len + 1) : 0;
        switch (rnd() % 6) {
        case 0: /* flip */
            if (b->len) b->p[rnd() % b->len] = (char)(rnd() & 0xff);
            break;
        case 1: { /* insert a JSON fragment */
            const char *bit = json_bits[rnd() % (sizeof json_bits / sizeof json_bits[0])];
            raw n = {0};
            raw_add(&n, b->p ? b->p : "", pos);
            raw_add(&n, bit, strlen(bit));
            raw_add(&n, b->p ? b->p + pos : "", b->len - pos);
            free(b->p);
            *b = n;
            break;
        }
        case 2: /* delete a range */
            if (b->len) {
                size_t len = rnd() % (b->len - pos + 1);
                memmove(b->p + pos, b->p + pos + len, b->len - pos - len + 1);
                b->len -= len;
            }
            break;
        case 3: /* truncate */
            b->len = pos;
            if (b->p) b->p[pos] = 0;
            break;
        case 4: { /* duplicate a range */
            if (!b->len) break;
            size_t len = rnd() % (b->len - pos + 1);
            if (len > 2000) len = 2000;
            raw n = {0};
            raw_add(&n, b->p, pos + len);
            raw_add(&n, b->p + pos, b->len - pos);
            free(b->p);
            *b = n;
            break;
        }
        default: { /* random bytes */
            size_t len = 1 + rnd() % 16;
            char junk[16];
            for (size_t i = 0; i < len; i++) junk[i] = (char)(rnd() & 0xff);
            raw n = {0};
            raw_add(&n, b->p ? b->p : "", pos);
            raw_add(&n, junk, len);
            raw_add(&n, b->p ? b->p + pos : "", b->len - pos);
            free(b->p);
            *b = n;
        }
        }
    }
}

/* One fuzzed request; returns its HTTP request bytes; *complete tells whether
 * the framing is intact (else the client half-closes to end it quickly). */
static void fuzz_request(raw *req, bool *complete) {
    const seed *s = &seeds[rnd() % (sizeof seeds / sizeof seeds[0])];
    raw body = {0};
    if (s->body) raw_add(&body, s->body, strlen(s->body));
    if (rnd() % 10 < 8) mutate_body(&body);
    *complete = true;
    char line[512];
    const char *method = s->method;
    char path[128];
    snprintf(path, sizeof path, "%s", s->path);
    unsigned hm = (unsigned)(rnd() % 100);
    if (hm < 5) method = (const char *[]){"PUT", "PATCH", "OPTIONS", "GET", "POST", "DELETE"}[rnd() % 6];
    if (hm >= 5 && hm < 10) {
        size_t l = strlen(path);
        path[rnd() % l] = (char)(33 + rnd() % 94);
    }
    int n = snprintf(line, sizeof line, "%s %s HTTP/1.%d\r\nHost: ds41\r\nConnection: close\r\n", method,
                     path, hm == 10 ? 0 : 1);
    raw_add(req, line, (size_t)n);
    if (hm >= 11 && hm < 15) {
        raw_add(req, "Transfer-Encoding: chunked\r\n\r\n", 31);
        n = snprintf(line, sizeof line, "%zx\r\n", body.len + (hm == 12 ? 3 : 0));
        raw_add(req, line, (size_t)n);
        raw_add(req, body.p ? body.p : "", body.len);
        raw_add(req, hm == 13 ? "\r\nzz\r\n" : "\r\n0\r\n\r\n", hm == 13 ? 6 : 7);
        *complete = hm == 11 || hm == 14;
    } else {
        if (hm == 15) {
            n = snprintf(line, sizeof line, "Content-Length: %zu\r\n", body.len + 1 + rnd() % 100);
            *complete = false;
        } else if (hm == 16) {
            n = snprintf(line, sizeof line, "Content-Length: -%zu\r\n", body.len);
        } else if (hm == 17) {
            n = snprintf(line, sizeof line, "Content-Type: text/html\r\nContent-Length: %zu\r\n", body.len);
        } else if (hm == 18) {
            n = snprintf(line, sizeof line, "X-Junk: \x01\x7f\xff\r\nContent-Length: %zu\r\n", body.len);
        } else if (hm == 19) {
            n = snprintf(line, sizeof line, "Content-Length: %zu\r\nBroken header line\r\n", body.len);
        } else {
            n = snprintf(line, sizeof line, "Content-Type: application/json\r\nContent-Length: %zu\r\n",
                         body.len);
        }
        raw_add(req, line, (size_t)n);
        if (hm == 20) {
            char big[9000];
            memset(big, 'a', sizeof big);
            raw_add(req, "X-Big: ", 7);
            raw_add(req, big, sizeof big);
            raw_add(req, "\r\n", 2);
        }
        raw_add(req, "\r\n", 2);
        raw_add(req, body.p ? body.p : "", body.len);
    }
    free(body.p);
}

static void test_fuzz_clients(void) {
    const int N = 10000;
    int answered = 0, closed = 0, timeouts = 0, server_errors = 0, ok2xx = 0;
    char first_bad[256] = "";
    int64_t t0 = now_ms();
    for (int i = 0; i < N; i++) {
        raw req = {0};
        bool complete;
        fuzz_request(&req, &complete);
        int fd = connect_unix(sock_path);
        if (fd < 0) {
            timeouts++;
            free(req.p);
            continue;
        }
        (void)send_all(fd, req.p, req.len);
        if (!complete) shutdown(fd, SHUT_WR);
        resp r;
        read_response(fd, &r, 5000);
        close(fd);
        if (r.status) {
            answered++;
            if (r.status < 300) ok2xx++;
            if (r.status >= 500 || r.status < 200) {
                server_errors++;
                if (!first_bad[0]) {
                    snprintf(first_bad, sizeof first_bad, "status %d for: %.150s", r.status, req.p);
                    for (char *c = first_bad; *c; c++)
                        if (*c == '\r' || *c == '\n') *c = ' ';
                }
            }
        } else if (r.timed_out) {
            timeouts++;
            if (!first_bad[0]) snprintf(first_bad, sizeof first_bad, "timeout for: %.150s", req.p);
        } else {
            closed++;
        }
        resp_free(&r);
        free(req.p);
    }
    TAP_NOTE("fuzz: %d answered (%d with 2xx), %d closed without answer, %d timeouts, %lld ms", answered,
             ok2xx, closed, timeouts, (long long)(now_ms() - t0));
    TAP_CHECK(server_errors == 0 && timeouts == 0 && answered > N / 2,
              "10,000 fuzzed requests: each answered 2xx/4xx or closed, none 5xx or hanging (%s)",
              first_bad[0] ? first_bad : "ok");
    resp r = request("GET", "/health", NULL);
    TAP_CHECK(r.status == 200, "the server keeps serving after the fuzzing client");
    resp_free(&r);
    TAP_CHECK(mock_service_wait_idle(mock, 10000), "every accepted fuzzed generation finished");
}

static void test_metrics_after(void) {
    resp r = request("GET", "/metrics", NULL);
    const char *b = r.body.p ? r.body.p : "";
    bool nonzero_timeout = strstr(b, "ds41_http_events_total{event=\"request_timeout\"} 0\n") == NULL;
    bool nonzero_large = strstr(b, "ds41_http_events_total{event=\"body_too_large\"} 0\n") == NULL;
    bool nonzero_gone = strstr(b, "ds41_http_events_total{event=\"client_gone\"} 0\n") == NULL;
    bool nonzero_stalled = strstr(b, "ds41_http_events_total{event=\"stream_stalled\"} 0\n") == NULL;
    TAP_CHECK(r.status == 200 && strstr(b, "ds41_http_events_total{event=\"request_timeout\"}") &&
                  nonzero_timeout && nonzero_large && nonzero_gone && nonzero_stalled &&
                  strstr(b, "ds41_http_connections "),
              "GET /metrics counts timeouts, oversized bodies, client disconnects and stalled streams");
    resp_free(&r);
}

/* ------------------------------------------------------------- stopping */

typedef struct stop_arg {
    ds41_http_server *srv;
    unsigned drain_ms;
    unsigned aborted;
} stop_arg;

static void *stop_thread(void *p) {
    stop_arg *a = p;
    a->aborted = ds41_http_server_stop(a->srv, a->drain_ms);
    return NULL;
}

static void test_stop(void) {
    char path[128];
    snprintf(path, sizeof path, "%s/stop.sock", dir);
    ds41_error err;
    ds41_listener stop_l = {.fd = -1};
    ds41_listen_unix(path, 0600, NULL, 16, &stop_l, &err);
    int lfd = stop_l.fd;
    ds41_http_listener l = {.fd = lfd};
    ds41_http_config cfg = {.listeners = &l,
                            .n_listeners = 1,
                            .request_timeout_ms = 5000,
                            .sse_keepalive_ms = 200,
                            .log = count_log};
    ds41_http_server *srv = NULL;
    if (lfd < 0 || ds41_http_server_start(&cfg, ds41_api_router(api), &srv, &err) != 0) {
        TAP_CHECK(0, "stop: second server starts (%s)", err.msg);
        return;
    }
    /* a running stream finishes inside the drain window */
    int fd = connect_unix(path);
    raw req = {0}, got = {0};
    build_request(&req, "POST", "/v1/chat/completions", chat("\"model\":\"slow\",\"stream\":true"), NULL,
                  true);
    if (fd >= 0) send_all(fd, req.p, req.len);
    free(req.p);
    read_until(fd, &got, "\"role\"", 5000);
    stop_arg a = {.srv = srv, .drain_ms = 5000};
    pthread_t t;
    pthread_create(&t, NULL, stop_thread, &a);
    rd_result done = read_until(fd, &got, "data: [DONE]\n\n", 8000);
    pthread_join(t, NULL);
    TAP_CHECK(done == RD_FOUND && a.aborted == 0, "graceful stop lets a running stream finish (aborted %u)",
              a.aborted);
    int probe_fd = connect_unix(path);
    TAP_CHECK(fcntl(lfd, F_GETFD) != -1 && probe_fd >= 0,
              "after stop the caller's listening fd is still open (clients queue for the next server)");
    if (probe_fd >= 0) close(probe_fd);
    free(got.p);
    if (fd >= 0) close(fd);

    /* a stream still running at the drain deadline is ended with an error event */
    srv = NULL;
    if (ds41_http_server_start(&cfg, ds41_api_router(api), &srv, &err) != 0) {
        TAP_CHECK(0, "stop: server restarts on the same fd (%s)", err.msg);
        ds41_listener_close(&stop_l);
        return;
    }
    unsigned before = mock_service_cancels(mock);
    fd = connect_unix(path);
    req = (raw){0};
    got = (raw){0};
    build_request(&req, "POST", "/v1/chat/completions", chat("\"model\":\"hang\",\"stream\":true"), NULL,
                  true);
    if (fd >= 0) send_all(fd, req.p, req.len);
    free(req.p);
    read_until(fd, &got, "\"content\":\"Hello\"", 5000);
    int fd2 = connect_unix(path);
    req = (raw){0};
    build_request(&req, "POST", "/v1/chat/completions", chat("\"model\":\"hang\""), NULL, true);
    if (fd2 >= 0) send_all(fd2, req.p, req.len);
    free(req.p);
    int64_t until = now_ms() + 3000;
    while (mock_service_live(mock) < 2 && now_ms() < until) sleep_ms(5);
    a = (stop_arg){.srv = srv, .drain_ms = 300};
    int64_t t0 = now_ms();
    pthread_create(&t, NULL, stop_thread, &a);
    rd_result end = read_until(fd, &got, "0\r\n\r\n", 8000);
    resp r2;
    read_response(fd2, &r2, 8000);
    pthread_join(t, NULL);
    int64_t took = now_ms() - t0;
    TAP_CHECK(
        a.aborted == 2 && end == RD_FOUND && strstr(got.p, "\"code\":\"shutting_down\"") &&
            !strstr(got.p, "[DONE]") && took < 4000,
        "stop at the drain deadline: the stream gets a shutting_down error event and a clean end (%lld ms)",
        (long long)took);
    TAP_CHECK(r2.status == 503 && is_error_shape(r2.json, "server_error", "shutting_down", NULL),
              "stop at the drain deadline: a waiting non-stream request gets 503 shutting_down");
    TAP_CHECK(wait_cancels(before + 2, 5000) == before + 2 && mock_service_wait_idle(mock, 5000),
              "stop at the drain deadline cancels both generations");
    resp_free(&r2);
    free(got.p);
    if (fd >= 0) close(fd);
    if (fd2 >= 0) close(fd2);
    ds41_listener_close(&stop_l);
}

static void test_start_errors(void) {
    ds41_error err;
    int not_listening = socket(AF_UNIX, SOCK_STREAM, 0);
    ds41_http_listener l = {.fd = not_listening};
    ds41_http_config cfg = {.listeners = &l, .n_listeners = 1};
    ds41_http_server *srv = NULL;
    TAP_CHECK(ds41_http_server_start(&cfg, ds41_api_router(api), &srv, &err) == -1 &&
                  strstr(err.msg, "listening"),
              "start refuses a socket that is not listening: %s", err.msg);
    close(not_listening);
    cfg.n_listeners = 0;
    TAP_CHECK(ds41_http_server_start(&cfg, ds41_api_router(api), &srv, &err) == -1,
              "start refuses no listeners");
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    snprintf(dir, sizeof dir, "/tmp/ds41-ipc-XXXXXX");
    if (!mkdtemp(dir) || chmod(dir, 0711) != 0) {
        TAP_CHECK(0, "temporary directory");
        return tap_done();
    }
    snprintf(sock_path, sizeof sock_path, "%s/ds41d.sock", dir);
    ds41_error err;
    ds41_listener unix_l = {.fd = -1}, tcp_l = {.fd = -1};
    if (ds41_listen_unix(sock_path, 0660, NULL, 128, &unix_l, &err) == 0 && geteuid() == 0 &&
        chown(sock_path, (uid_t)-1, SOCK_GID) != 0)
        ds41_listener_close(&unix_l);
    if (unix_l.fd >= 0) ds41_listen_tcp("127.0.0.1:0", 128, true, &tcp_l, &err);
    int unix_fd = unix_l.fd, tcp_fd = tcp_l.fd;
    struct sockaddr_in sin;
    socklen_t sl = sizeof sin;
    if (tcp_fd >= 0 && getsockname(tcp_fd, (struct sockaddr *)&sin, &sl) == 0) tcp_port = ntohs(sin.sin_port);
    mock = mock_service_new(true);
    metrics = ds41_http_metrics_new();
    ds41_api_options opts = {.max_body_bytes = MAX_BODY};
    if (unix_fd < 0 || tcp_fd < 0 || !mock || !metrics ||
        ds41_api_new(mock_service_iface(mock), metrics, &opts, &api, &err) != 0) {
        TAP_CHECK(0, "setup: %s", err.msg);
        return tap_done();
    }
    ds41_http_listener ls[2] = {{.fd = unix_fd}, {.fd = tcp_fd, .credless_class = DS41_AUTH_INFERENCE}};
    ds41_http_config cfg = {.listeners = ls,
                            .n_listeners = 2,
                            .has_admin_gid = true,
                            .admin_gid = ADMIN_GID,
                            .max_connections = 512,
                            .request_timeout_ms = REQUEST_TIMEOUT_MS,
                            .idle_timeout_s = 10,
                            .sse_keepalive_ms = 1000,
                            .max_stream_buffer = 256 << 10,
                            .log = count_log};
    if (ds41_http_server_start(&cfg, ds41_api_router(api), &server, &err) != 0) {
        TAP_CHECK(0, "server start: %s", err.msg);
        return tap_done();
    }
    if (geteuid() == 0)
        test_listen_helpers();
    else
        TAP_SKIP("socket group test needs root");
    test_start_errors();
    test_routes();
    test_curl();
    test_bad_input();
    test_protocol_errors();
    test_slow_clients();
    test_streaming();
    test_auth();
    test_tcp_and_odd_peers();
    test_fuzz_clients();
    test_metrics_after();
    unsigned aborted = ds41_http_server_stop(server, 5000);
    TAP_CHECK(aborted == 0, "the main server stops with nothing left to abort");
    TAP_NOTE("%u diagnostics from the server were logged", log_lines);
    test_stop();

    ds41_listener_close(&unix_l);
    ds41_listener_close(&tcp_l);
    rmdir(dir);
    ds41_api_free(api);
    mock_service_free(mock);
    ds41_http_metrics_free(metrics);
    return tap_done();
}
