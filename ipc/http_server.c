/* HTTP/1.1 server over the listening sockets it is given: see http_server.h
 * for the model and ipc/http_parser.h for the request syntax it accepts.
 *
 * Layout of this file (the metrics object is http_metrics.c): exchanges and answers, streams, signals and
 * waits, routing, writing answers, one connection's thread (read a request,
 * run its handler, write its answer, keep alive), the accept threads,
 * start/stop, in-memory dispatch. */
#include "ipc/http_server.h"

#include "config/buf.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "ipc/http_internal.h"
#include "ipc/http_parser.h"
#include "config/json_util.h"

#define DEFAULT_MAX_BODY (32u << 20)
#define DEFAULT_MAX_CONNECTIONS 256u
#define DEFAULT_REQUEST_TIMEOUT_MS 30000u
#define DEFAULT_IDLE_TIMEOUT_S 60u
#define DEFAULT_KEEPALIVE_MS 15000u
#define DEFAULT_STREAM_BUFFER (8u << 20)
#define MAX_LISTENERS 8
#define MAX_EXTRA_HEADERS 8
#define STREAM_BLOCK 16384
#define MAX_PATH_PARAM 128
/* A connection's receive buffer: a whole request head fits (the parser
 * refuses a head over DS41_HTTP_MAX_HEAD before the buffer is full). */
#define CONN_BUF (DS41_HTTP_MAX_HEAD + 16384u)
/* Before a close, what the client still sends is drained for up to this
 * long / this many bytes (conn_linger). */
#define LINGER_MS 1000
#define LINGER_BYTES (8u << 20)

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ================================================================ server */

struct listener_state {
    struct ds41_http_server *srv;
    int fd; /* our duplicate of the caller's listening fd */
    ds41_auth_class credless_class;
    bool is_unix;
    unsigned n_conns; /* srv->mu */
    pthread_t thread;
    bool thread_started;
};

/* One client connection, served by its own (detached) thread. */
struct conn {
    struct conn *prev, *next; /* srv->conns, under srv->mu */
    struct ds41_http_server *srv;
    struct listener_state *ls;
    int fd;
    ds41_http_peer peer;
    ds41_auth_class auth;
    char *buf; /* received bytes not consumed yet: buf[0..len) */
    size_t len;
    int64_t accepted_ms;
    int64_t last_rx_ms; /* last progress, for the idle timeout */
};

struct ds41_http_server {
    ds41_http_config cfg;
    const ds41_http_router *router;
    struct listener_state ls[MAX_LISTENERS];
    size_t n_ls;
    pthread_mutex_t mu;
    pthread_cond_t cond; /* CLOCK_MONOTONIC: active / connections changed */
    struct conn *conns;
    unsigned n_conns;
    unsigned active;
    bool draining;
    int stop_fd;  /* eventfd: the accept threads end */
    int abort_fd; /* eventfd made readable at the drain deadline */
};

static void srv_log(const ds41_http_server *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void srv_log(const ds41_http_server *s, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    size_t n = strlen(msg);
    while (n && msg[n - 1] == '\n') msg[--n] = 0;
    if (s && s->cfg.log)
        s->cfg.log(s->cfg.log_ctx, msg);
    else
        fprintf(stderr, "ds41 http: %s\n", msg);
}

/* ============================================================== exchanges */

enum ex_kind { EX_SOCKET, EX_MEMORY };

struct ds41_http_exchange {
    enum ex_kind kind;
    const ds41_http_router *router;
    const ds41_http_route *route;
    ds41_http_server *srv; /* EX_SOCKET */
    int sock_fd;  /* -1 in memory */
    int abort_fd; /* -1 in memory */
    char method[16];
    char *path;
    const char *param;
    char *body;
    size_t body_len, body_cap;
    ds41_auth_class auth;
    ds41_http_peer peer;
    bool answered;
    bool abandoned;
    bool counted_active;
    int status;
    struct {
        char name[48];
        char value[256];
    } hdr[MAX_EXTRA_HEADERS];
    int n_hdr;
    ds41_http_memory_response *mem;
    ds41_http_stream *mem_stream;
    /* EX_SOCKET: the answer, written by the connection's thread */
    char *resp_type;
    char *resp_body;
    size_t resp_len;
    ds41_http_stream *resp_stream;
    char *stop_event;
};

const char *ds41_http_method(const ds41_http_exchange *ex) {
    return ex->method;
}
const char *ds41_http_path(const ds41_http_exchange *ex) {
    return ex->path ? ex->path : "";
}
const char *ds41_http_path_param(const ds41_http_exchange *ex) {
    return ex->param;
}
ds41_auth_class ds41_http_auth(const ds41_http_exchange *ex) {
    return ex->auth;
}
const ds41_http_peer *ds41_http_peer_info(const ds41_http_exchange *ex) {
    return &ex->peer;
}

const char *ds41_http_body(const ds41_http_exchange *ex, size_t *len) {
    if (len) *len = ex->body_len;
    return ex->body ? ex->body : "";
}

int ds41_http_add_header(ds41_http_exchange *ex, const char *name, const char *value) {
    if (ex->n_hdr == MAX_EXTRA_HEADERS) return -1;
    if (strlen(name) >= sizeof ex->hdr[0].name || strlen(value) >= sizeof ex->hdr[0].value) return -1;
    if (strpbrk(name, "\r\n:") || strpbrk(value, "\r\n")) return -1;
    snprintf(ex->hdr[ex->n_hdr].name, sizeof ex->hdr[0].name, "%s", name);
    snprintf(ex->hdr[ex->n_hdr].value, sizeof ex->hdr[0].value, "%s", value);
    ex->n_hdr++;
    return 0;
}

static const char *default_error_type(int status) {
    switch (status) {
    case 401:
        return "authentication_error";
    case 403:
        return "permission_error";
    case 404:
        return "not_found_error";
    case 429:
        return "rate_limit_error";
    default:
        return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

char *ds41_http_error_json(int status, const char *type, const char *code, const char *param,
                           const char *message, size_t *len) {
    json_t *err = json_object();
    json_t *root = json_object();
    char *text = NULL;
    if (!err || !root) goto out;
    if (ds41_json_set_str(err, "message", message ? message : "") ||
        ds41_json_set_str(err, "type", type ? type : default_error_type(status)) ||
        ds41_json_set_str(err, "param", param && *param ? param : NULL) ||
        ds41_json_set_str(err, "code", code && *code ? code : NULL))
        goto out;
    if (json_object_set(root, "error", err)) goto out;
    text = ds41_json_dump(root, len);
out:
    json_decref(err);
    json_decref(root);
    return text;
}

static void mem_capture_headers(ds41_http_exchange *ex, const char *content_type) {
    ds41_http_memory_response *m = ex->mem;
    m->content_type = strdup(content_type);
    ds41_buf b = {0};
    for (int i = 0; i < ex->n_hdr; i++) {
        ds41_buf_put(&b, ex->hdr[i].name, strlen(ex->hdr[i].name));
        ds41_buf_put(&b, ": ", 2);
        ds41_buf_put(&b, ex->hdr[i].value, strlen(ex->hdr[i].value));
        ds41_buf_put(&b, "\n", 1);
    }
    if (b.oom) {
        free(b.data);
        b.data = NULL;
    }
    m->headers = b.data;
}

int ds41_http_respond(ds41_http_exchange *ex, int status, const char *content_type, const void *body,
                      size_t len) {
    if (ex->answered || ex->abandoned) return -1;
    if (!content_type) content_type = "application/json";
    ex->answered = true;
    ex->status = status;
    if (ex->kind == EX_MEMORY) {
        ds41_http_memory_response *m = ex->mem;
        m->status = status;
        mem_capture_headers(ex, content_type);
        m->body = malloc(len + 1);
        if (m->body) {
            if (len) memcpy(m->body, body, len);
            m->body[len] = 0;
            m->body_len = len;
        }
        return 0;
    }
    /* The connection's thread writes it once the handler returns. */
    ex->resp_type = strdup(content_type);
    ex->resp_body = malloc(len ? len : 1);
    if (!ex->resp_type || !ex->resp_body) {
        ex->abandoned = true;
        return -1;
    }
    if (len) memcpy(ex->resp_body, body, len);
    ex->resp_len = len;
    return 0;
}

static int respond_error_v(ds41_http_exchange *ex, int status, const char *type, const char *code,
                           const char *param, const char *fmt, va_list ap) {
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t len = 0;
    char *body = ds41_http_error_json(status, type, code, param, msg, &len);
    if (!body) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                                  "\"param\":null,\"code\":null}}";
        return ds41_http_respond(ex, 500, NULL, oom, sizeof oom - 1);
    }
    int rc = ds41_http_respond(ex, status, NULL, body, len);
    free(body);
    return rc;
}

int ds41_http_respond_error(ds41_http_exchange *ex, int status, const char *type, const char *code,
                            const char *param, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = respond_error_v(ex, status, type, code, param, fmt, ap);
    va_end(ap);
    return rc;
}

void ds41_http_abandon(ds41_http_exchange *ex) {
    if (!ex->answered) ex->abandoned = true;
}

/* ================================================================ signals */

int ds41_http_signal_init(ds41_http_signal *sig, ds41_error *err) {
    sig->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (sig->fd < 0) return ds41_fail(err, "eventfd: %s", strerror(errno));
    return 0;
}

void ds41_http_signal_raise(ds41_http_signal *sig) {
    uint64_t one = 1;
    ssize_t w;
    do {
        w = write(sig->fd, &one, sizeof one);
    } while (w < 0 && errno == EINTR);
    /* EAGAIN means the counter is already huge: it is raised either way. */
}

void ds41_http_signal_destroy(ds41_http_signal *sig) {
    if (sig->fd >= 0) close(sig->fd);
    sig->fd = -1;
}

static void drain_eventfd(int fd) {
    uint64_t v;
    while (read(fd, &v, sizeof v) > 0) {
    }
}

#define GONE_EVENTS (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)

ds41_http_wait_result ds41_http_wait(ds41_http_exchange *ex, ds41_http_signal *sig, int timeout_ms) {
    int64_t deadline = timeout_ms >= 0 ? now_ms() + timeout_ms : 0;
    for (;;) {
        struct pollfd p[3];
        nfds_t n = 0;
        p[n++] = (struct pollfd){.fd = sig->fd, .events = POLLIN};
        int sock_slot = -1, abort_slot = -1;
        if (ex->sock_fd >= 0) {
            sock_slot = (int)n;
            p[n++] = (struct pollfd){.fd = ex->sock_fd, .events = POLLRDHUP};
        }
        if (ex->abort_fd >= 0) {
            abort_slot = (int)n;
            p[n++] = (struct pollfd){.fd = ex->abort_fd, .events = POLLIN};
        }
        int wait_ms = -1;
        if (timeout_ms >= 0) {
            int64_t left = deadline - now_ms();
            if (left < 0) left = 0;
            wait_ms = left > INT32_MAX ? INT32_MAX : (int)left;
        }
        int r = poll(p, n, wait_ms);
        if (r < 0) {
            if (errno == EINTR) continue;
            return DS41_HTTP_WAIT_CLIENT_GONE;
        }
        if (p[0].revents & POLLIN) {
            drain_eventfd(sig->fd);
            return DS41_HTTP_WAIT_SIGNALLED;
        }
        if (sock_slot >= 0 && (p[sock_slot].revents & GONE_EVENTS)) {
            if (ex->router) ds41_http_metrics_event(ex->router->metrics, DS41_HTTP_EV_CLIENT_GONE);
            return DS41_HTTP_WAIT_CLIENT_GONE;
        }
        if (abort_slot >= 0 && (p[abort_slot].revents & POLLIN)) return DS41_HTTP_WAIT_STOPPING;
        if (r == 0 && timeout_ms >= 0 && now_ms() >= deadline) return DS41_HTTP_WAIT_TIMEOUT;
    }
}

/* ================================================================ streams */

struct ds41_http_stream {
    pthread_mutex_t mu;
    int efd;
    int sock_fd;                /* the client's socket once attached to a connection, else -1 */
    ds41_http_metrics *metrics; /* once attached */
    char *buf;
    size_t off, len, cap;
    size_t max_buffer;
    int refs;
    bool ended;
    bool consumer_gone;
    bool overflow;
    bool abandon_done;
    void (*on_abandon)(void *ctx);
    void *ctx;
    void (*ctx_free)(void *ctx);
};

ds41_http_stream *ds41_http_stream_new(void (*on_abandon)(void *ctx), void *ctx,
                                       void (*ctx_free)(void *ctx)) {
    ds41_http_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->efd < 0) {
        free(s);
        return NULL;
    }
    pthread_mutex_init(&s->mu, NULL);
    s->refs = 1;
    s->sock_fd = -1;
    s->max_buffer = DEFAULT_STREAM_BUFFER;
    s->on_abandon = on_abandon;
    s->ctx = ctx;
    s->ctx_free = ctx_free;
    return s;
}

static void stream_wake(ds41_http_stream *s) {
    uint64_t one = 1;
    ssize_t w;
    do {
        w = write(s->efd, &one, sizeof one);
    } while (w < 0 && errno == EINTR);
}

static void stream_unref(ds41_http_stream *s) {
    pthread_mutex_lock(&s->mu);
    int left = --s->refs;
    pthread_mutex_unlock(&s->mu);
    if (left) return;
    if (s->ctx_free) s->ctx_free(s->ctx);
    close(s->efd);
    free(s->buf);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int ds41_http_stream_write(ds41_http_stream *s, const void *data, size_t len) {
    pthread_mutex_lock(&s->mu);
    if (s->consumer_gone || s->overflow || s->ended) {
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    size_t pending = s->len - s->off;
    if (pending + len > s->max_buffer) {
        /* The client stopped reading.  Its connection thread is blocked
         * waiting to write, so it would only notice at the idle timeout:
         * shut the socket down now (the fd is open while the connection
         * holds the stream, i.e. while consumer_gone is false), which makes
         * it let go of the stream and so cancel the generation. */
        s->overflow = true;
        if (s->sock_fd >= 0) shutdown(s->sock_fd, SHUT_RDWR);
        ds41_http_metrics *m = s->metrics;
        pthread_mutex_unlock(&s->mu);
        ds41_http_metrics_event(m, DS41_HTTP_EV_STALLED);
        stream_wake(s);
        return -1;
    }
    if (s->off && s->off == s->len) s->off = s->len = 0;
    if (s->len + len > s->cap) {
        if (s->off) { /* compact before growing */
            memmove(s->buf, s->buf + s->off, pending);
            s->len = pending;
            s->off = 0;
        }
        if (s->len + len > s->cap) {
            size_t cap = s->cap ? s->cap : 4096;
            while (cap < s->len + len) cap *= 2;
            char *nb = realloc(s->buf, cap);
            if (!nb) {
                s->overflow = true;
                pthread_mutex_unlock(&s->mu);
                stream_wake(s);
                return -1;
            }
            s->buf = nb;
            s->cap = cap;
        }
    }
    memcpy(s->buf + s->len, data, len);
    s->len += len;
    pthread_mutex_unlock(&s->mu);
    stream_wake(s);
    return 0;
}

void ds41_http_stream_end(ds41_http_stream *s) {
    pthread_mutex_lock(&s->mu);
    s->ended = true;
    pthread_mutex_unlock(&s->mu);
    stream_wake(s);
    stream_unref(s);
}

/* The connection lets go of the stream: if the producer has not ended it,
 * tell the producer's side (cancel), then drop the connection's reference. */
static void stream_release_consumer(ds41_http_stream *s) {
    pthread_mutex_lock(&s->mu);
    s->consumer_gone = true;
    s->sock_fd = -1;
    bool abandon = !s->ended && !s->abandon_done;
    s->abandon_done = true;
    pthread_mutex_unlock(&s->mu);
    if (abandon && s->on_abandon) s->on_abandon(s->ctx);
    stream_unref(s);
}

/* Copy pending bytes (up to max) out of the stream.  Returns the count, 0
 * when nothing is pending; *ended / *overflow report the producer state. */
static size_t stream_take(ds41_http_stream *s, char *out, size_t max, bool *ended, bool *overflow) {
    pthread_mutex_lock(&s->mu);
    size_t n = s->len - s->off;
    if (n > max) n = max;
    if (n) {
        memcpy(out, s->buf + s->off, n);
        s->off += n;
        if (s->off == s->len) s->off = s->len = 0;
    }
    *ended = s->ended && s->off == s->len;
    *overflow = s->overflow;
    pthread_mutex_unlock(&s->mu);
    return n;
}

static const char keepalive_comment[] = ": keep-alive\n\n";

int ds41_http_respond_stream(ds41_http_exchange *ex, int status, const char *content_type,
                             ds41_http_stream *s, const char *stop_event) {
    if (ex->answered || ex->abandoned) return -1;
    if (!content_type) content_type = "text/event-stream";
    ex->answered = true;
    ex->status = status;
    pthread_mutex_lock(&s->mu);
    s->refs++;
    if (ex->srv) s->max_buffer = ex->srv->cfg.max_stream_buffer;
    pthread_mutex_unlock(&s->mu);
    if (ex->kind == EX_MEMORY) {
        ex->mem->status = status;
        ex->mem->streamed = true;
        mem_capture_headers(ex, content_type);
        ex->mem_stream = s;
        return 0;
    }
    /* The connection's thread writes it once the handler returns. */
    ex->resp_type = strdup(content_type);
    ex->stop_event = stop_event ? strdup(stop_event) : NULL;
    if (!ex->resp_type || (stop_event && !ex->stop_event)) {
        ex->abandoned = true;
        stream_release_consumer(s);
        return -1;
    }
    pthread_mutex_lock(&s->mu);
    s->sock_fd = ex->sock_fd;
    s->metrics = ex->router->metrics;
    pthread_mutex_unlock(&s->mu);
    ex->resp_stream = s;
    return 0;
}

/* ================================================================ routing */

ds41_auth_class ds41_http_classify(uid_t uid, gid_t gid, const gid_t *groups, size_t n_groups,
                                   bool has_admin_gid, gid_t admin_gid) {
    if (uid == 0) return DS41_AUTH_ADMIN;
    if (!has_admin_gid) return DS41_AUTH_INFERENCE;
    if (gid == admin_gid) return DS41_AUTH_ADMIN;
    for (size_t i = 0; i < n_groups; i++)
        if (groups[i] == admin_gid) return DS41_AUTH_ADMIN;
    return DS41_AUTH_INFERENCE;
}

static bool param_char_ok(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-' || c == ':';
}

/* Does the route's path pattern match path?  *param gets the "*" segment. */
static bool path_matches(const char *pattern, const char *path, const char **param) {
    size_t pl = strlen(pattern);
    *param = NULL;
    if (pl >= 2 && pattern[pl - 1] == '*' && pattern[pl - 2] == '/') {
        if (strncmp(path, pattern, pl - 1) != 0) return false;
        const char *seg = path + pl - 1;
        size_t n = strlen(seg);
        if (n == 0 || n > MAX_PATH_PARAM) return false;
        for (size_t i = 0; i < n; i++)
            if (!param_char_ok(seg[i])) return false;
        *param = seg;
        return true;
    }
    return strcmp(pattern, path) == 0;
}

static bool method_matches(const char *route_method, const char *method) {
    if (strcmp(route_method, method) == 0) return true;
    return strcmp(method, "HEAD") == 0 && strcmp(route_method, "GET") == 0;
}

static bool content_type_ok(const char *ct) {
    if (!ct) return true;
    while (*ct == ' ' || *ct == '\t') ct++;
    static const char *const ok[] = {"application/json", "text/plain", "application/x-www-form-urlencoded"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        size_t n = strlen(ok[i]);
        if (strncasecmp(ct, ok[i], n) == 0 && (ct[n] == 0 || ct[n] == ';' || ct[n] == ' ')) return true;
    }
    return false;
}

static size_t router_max_body(const ds41_http_router *r) {
    return r->max_body_bytes ? r->max_body_bytes : DEFAULT_MAX_BODY;
}

/* Pick the route and check everything that can be refused before the body
 * is read.  Returns true when the exchange was answered here. */
static bool route_request(ds41_http_exchange *ex, const char *method, const char *url, bool has_length,
                          uint64_t content_length, const char *content_type) {
    const ds41_http_router *r = ex->router;
    snprintf(ex->method, sizeof ex->method, "%s", method);
    ex->path = strdup(url);
    if (!ex->path) {
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return true;
    }
    const ds41_http_route *found = NULL;
    bool path_known = false;
    char allow[128] = "";
    for (size_t i = 0; i < r->n_routes; i++) {
        const char *param;
        if (!path_matches(r->routes[i].path, ex->path, &param)) continue;
        path_known = true;
        size_t al = strlen(allow);
        snprintf(allow + al, sizeof allow - al, "%s%s%s", al ? ", " : "", r->routes[i].method,
                 strcmp(r->routes[i].method, "GET") == 0 ? ", HEAD" : "");
        if (!found && method_matches(r->routes[i].method, method)) {
            found = &r->routes[i];
            ex->param = param;
        }
    }
    if (!found) {
        if (path_known) {
            ds41_http_add_header(ex, "Allow", allow);
            ds41_http_respond_error(ex, 405, NULL, "method_not_allowed", NULL,
                                    "method %s is not allowed on this path (allowed: %s)", ex->method, allow);
        } else {
            ds41_http_respond_error(ex, 404, NULL, "not_found", NULL, "no route for %s %s", ex->method,
                                    ex->path);
        }
        return true;
    }
    ex->route = found;
    if (ex->auth < found->required) {
        ds41_http_respond_error(ex, 403, NULL, "forbidden", NULL,
                                "this route needs the admin class (root or the admin group)");
        return true;
    }
    if (has_length && content_length > router_max_body(r)) {
        ds41_http_metrics_event(r->metrics, DS41_HTTP_EV_TOO_LARGE);
        ds41_http_add_header(ex, "Connection", "close");
        ds41_http_respond_error(ex, 413, NULL, "request_too_large", NULL,
                                "request body of %" PRIu64 " bytes exceeds the limit of %zu bytes",
                                content_length, router_max_body(r));
        return true;
    }
    if (found->has_body && !content_type_ok(content_type)) {
        ds41_http_respond_error(ex, 415, NULL, "unsupported_media_type", NULL,
                                "Content-Type must be application/json");
        return true;
    }
    return false;
}

static int body_append(ds41_http_exchange *ex, const char *data, size_t n) {
    if (ex->body_len + n + 1 > ex->body_cap) {
        size_t cap = ex->body_cap ? ex->body_cap : 4096;
        while (cap < ex->body_len + n + 1) cap *= 2;
        char *nb = realloc(ex->body, cap);
        if (!nb) return -1;
        ex->body = nb;
        ex->body_cap = cap;
    }
    memcpy(ex->body + ex->body_len, data, n);
    ex->body_len += n;
    ex->body[ex->body_len] = 0;
    return 0;
}

static void run_handler(ds41_http_exchange *ex) {
    if (!ex->body && body_append(ex, "", 0) != 0) {
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    ex->route->handler(ex, ex->router->ctx);
    if (!ex->answered && !ex->abandoned)
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "the handler produced no answer");
}

static void exchange_free(ds41_http_exchange *ex) {
    if (ex->resp_stream) stream_release_consumer(ex->resp_stream);
    free(ex->resp_type);
    free(ex->resp_body);
    free(ex->stop_event);
    free(ex->path);
    free(ex->body);
    free(ex);
}

/* ===================================================== connections */

/* Credentials of a Unix-socket peer and its class. */
static void read_peer(ds41_http_server *srv, struct conn *rec) {
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(rec->fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof cred) {
        rec->auth = DS41_AUTH_INFERENCE;
        return;
    }
    rec->peer = (ds41_http_peer){.has_creds = true, .pid = cred.pid, .uid = cred.uid, .gid = cred.gid};
    gid_t stack_groups[64];
    gid_t *groups = stack_groups;
    size_t n_groups = 0;
    bool heap = false;
    if (cred.uid != 0 && srv->cfg.has_admin_gid && cred.gid != srv->cfg.admin_gid) {
        socklen_t glen = sizeof stack_groups;
        if (getsockopt(rec->fd, SOL_SOCKET, SO_PEERGROUPS, groups, &glen) == 0) {
            n_groups = glen / sizeof(gid_t);
        } else if (errno == ERANGE && glen > 0 && glen <= 65536 * sizeof(gid_t)) {
            groups = malloc(glen);
            if (groups) {
                heap = true;
                if (getsockopt(rec->fd, SOL_SOCKET, SO_PEERGROUPS, groups, &glen) == 0)
                    n_groups = glen / sizeof(gid_t);
            } else {
                groups = stack_groups;
            }
        } else if (errno == ENOPROTOOPT) {
            /* Kernel without SO_PEERGROUPS: the group database instead. */
            struct passwd pw, *res = NULL;
            char pwbuf[4096];
            if (getpwuid_r(cred.uid, &pw, pwbuf, sizeof pwbuf, &res) == 0 && res) {
                int ng = 64;
                if (getgrouplist(pw.pw_name, cred.gid, groups, &ng) >= 0) n_groups = (size_t)ng;
            }
        }
    }
    rec->auth =
        ds41_http_classify(cred.uid, cred.gid, groups, n_groups, srv->cfg.has_admin_gid, srv->cfg.admin_gid);
    if (heap) free(groups);
}

/* ========================================================= writing answers */

static const char *reason_phrase(int status) {
    switch (status) {
    case 100:
        return "Continue";
    case 200:
        return "OK";
    case 201:
        return "Created";
    case 202:
        return "Accepted";
    case 204:
        return "No Content";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 409:
        return "Conflict";
    case 413:
        return "Content Too Large";
    case 414:
        return "URI Too Long";
    case 415:
        return "Unsupported Media Type";
    case 422:
        return "Unprocessable Content";
    case 429:
        return "Too Many Requests";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 502:
        return "Bad Gateway";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    case 505:
        return "HTTP Version Not Supported";
    case 507:
        return "Insufficient Storage";
    default:
        return "Status";
    }
}

/* Write all of iov to the client.  A client that accepts no byte for the
 * idle timeout is given up on.  0, or -1 when the connection is unusable. */
static int conn_writev(struct conn *c, struct iovec *iov, int n) {
    int64_t idle_ms = (int64_t)c->srv->cfg.idle_timeout_s * 1000;
    while (n > 0) {
        if (iov[0].iov_len == 0) {
            iov++;
            n--;
            continue;
        }
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
            struct pollfd p = {.fd = c->fd, .events = POLLOUT};
            int r = poll(&p, 1, idle_ms > INT32_MAX ? INT32_MAX : (int)idle_ms);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0 || (p.revents & (POLLERR | POLLHUP | POLLNVAL))) return -1;
            continue;
        }
        size_t done = (size_t)w;
        while (n > 0 && done >= iov[0].iov_len) {
            done -= iov[0].iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov[0].iov_base = (char *)iov[0].iov_base + done;
            iov[0].iov_len -= done;
        }
    }
    return 0;
}

static int conn_write(struct conn *c, const void *p, size_t len) {
    struct iovec iov = {(void *)(uintptr_t)p, len};
    return conn_writev(c, &iov, 1);
}

/* Framing of an answer's body. */
enum framing { FRAME_LENGTH, FRAME_CHUNKED, FRAME_UNTIL_CLOSE };

/* The status line and headers of an answer, malloc()ed (NULL if out of
 * memory).  ex may be NULL (a protocol error before any exchange). */
static char *answer_head(const ds41_http_exchange *ex, int status, const char *content_type, enum framing fr,
                         size_t length, bool keep_alive, int minor, size_t *len) {
    if (status < 100 || status > 599) status = 500;
    ds41_buf b = {0};
    char date[64];
    struct tm tm;
    time_t t = time(NULL);
    if (!gmtime_r(&t, &tm) || !strftime(date, sizeof date, "%a, %d %b %Y %H:%M:%S GMT", &tm)) date[0] = 0;
    ds41_buf_printf(&b, "HTTP/1.1 %d %s\r\n", status, reason_phrase(status));
    if (date[0]) ds41_buf_printf(&b, "Date: %s\r\n", date);
    if (content_type) ds41_buf_printf(&b, "Content-Type: %s\r\n", content_type);
    for (int i = 0; ex && i < ex->n_hdr; i++)
        if (strcasecmp(ex->hdr[i].name, "Connection") != 0)
            ds41_buf_printf(&b, "%s: %s\r\n", ex->hdr[i].name, ex->hdr[i].value);
    if (fr == FRAME_LENGTH) ds41_buf_printf(&b, "Content-Length: %zu\r\n", length);
    if (fr == FRAME_CHUNKED) ds41_buf_printf(&b, "Transfer-Encoding: chunked\r\n");
    if (!keep_alive)
        ds41_buf_printf(&b, "Connection: close\r\n");
    else if (minor == 0)
        ds41_buf_printf(&b, "Connection: keep-alive\r\n");
    ds41_buf_put(&b, "\r\n", 2);
    if (b.oom) {
        free(b.data);
        return NULL;
    }
    *len = b.len;
    return b.data;
}

/* Did the handler ask for the connection to be closed after its answer? */
static bool wants_close(const ds41_http_exchange *ex) {
    for (int i = 0; i < ex->n_hdr; i++)
        if (strcasecmp(ex->hdr[i].name, "Connection") == 0 && strcasecmp(ex->hdr[i].value, "close") == 0)
            return true;
    return false;
}

/* A complete answer (head, and the body unless head_only). */
static int send_buffered(struct conn *c, const ds41_http_exchange *ex, int status, const char *content_type,
                         const char *body, size_t len, bool head_only, bool keep_alive, int minor) {
    size_t hl = 0;
    char *head = answer_head(ex, status, content_type, FRAME_LENGTH, len, keep_alive, minor, &hl);
    if (!head) return -1;
    struct iovec iov[2] = {{head, hl}, {(void *)(uintptr_t)body, head_only ? 0 : len}};
    int rc = conn_writev(c, iov, 2);
    free(head);
    return rc;
}

/* An error answer in the API's error shape, outside any route: a request
 * the server refuses before (or while) reading it.  The connection closes
 * after it. */
static void send_protocol_error(struct conn *c, int status, const char *code, const char *message) {
    const char *type = status == 501 || status == 505 ? "invalid_request_error" : NULL;
    size_t blen = 0;
    char *body = ds41_http_error_json(status, type, code, NULL, message, &blen);
    if (body) (void)send_buffered(c, NULL, status, "application/json", body, blen, false, false, 1);
    free(body);
    ds41_http_metrics_request(c->srv->router->metrics, NULL, status);
}

/* ====================================================== reading requests */

typedef enum io_result {
    IO_OK = 0,  /* more bytes in c->buf */
    IO_CLOSED,  /* the client closed (or the socket failed, or stop shut it down) */
    IO_TIMEOUT, /* the request deadline passed */
    IO_IDLE,    /* no byte for the idle timeout */
} io_result;

static void conn_consume(struct conn *c, size_t n) {
    memmove(c->buf, c->buf + n, c->len - n);
    c->len -= n;
}

/* Wait for and append more received bytes to c->buf. */
static io_result conn_fill(struct conn *c, int64_t deadline) {
    for (;;) {
        if (c->len == CONN_BUF) return IO_CLOSED; /* cannot happen: the parser refuses first */
        int64_t now = now_ms();
        if (now >= deadline) return IO_TIMEOUT;
        int64_t idle_at = c->last_rx_ms + (int64_t)c->srv->cfg.idle_timeout_s * 1000;
        if (now >= idle_at) return IO_IDLE;
        int64_t wait = (deadline < idle_at ? deadline : idle_at) - now;
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        int r = poll(&p, 1, wait > INT32_MAX ? INT32_MAX : (int)wait);
        if (r < 0) {
            if (errno == EINTR) continue;
            return IO_CLOSED;
        }
        if (r == 0) continue;
        ssize_t n = recv(c->fd, c->buf + c->len, CONN_BUF - c->len, MSG_DONTWAIT);
        if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (n <= 0) return IO_CLOSED;
        c->len += (size_t)n;
        c->last_rx_ms = now_ms();
        return IO_OK;
    }
}

typedef enum body_result { BODY_OK = 0, BODY_TIMEOUT, BODY_TOO_LARGE, BODY_BAD, BODY_GONE } body_result;

/* Read the request body (Content-Length or chunked) into ex. */
static body_result read_body(struct conn *c, ds41_http_exchange *ex, const ds41_http_head *h,
                             int64_t deadline, ds41_http_parse_error *perr) {
    size_t max = router_max_body(ex->router);
    uint64_t left = h->has_length ? h->content_length : 0;
    ds41_http_chunked ch;
    ds41_http_chunked_init(&ch);
    for (;;) {
        if (c->len) {
            size_t used, out;
            ds41_http_parse_result r;
            if (h->chunked) {
                r = ds41_http_chunked_decode(&ch, c->buf, c->len, &used, &out, perr);
                if (r == DS41_HTTP_PARSE_ERROR) return BODY_BAD;
            } else {
                used = out = (uint64_t)c->len < left ? c->len : (size_t)left;
                left -= used;
                r = left ? DS41_HTTP_PARSE_INCOMPLETE : DS41_HTTP_PARSE_OK;
            }
            if (ex->body_len + out > max) return BODY_TOO_LARGE;
            if (out && body_append(ex, c->buf, out) != 0) return BODY_GONE;
            conn_consume(c, used);
            if (r == DS41_HTTP_PARSE_OK) return BODY_OK;
        } else if (!h->chunked && left == 0) {
            return BODY_OK;
        }
        io_result io = conn_fill(c, deadline);
        if (io == IO_TIMEOUT) return BODY_TIMEOUT;
        if (io != IO_OK) return BODY_GONE;
    }
}

/* ======================================================= streamed answers */

/* Write one chunk (or, for an HTTP/1.0 client, the raw bytes). */
static int send_piece(struct conn *c, bool chunked, const void *data, size_t len) {
    if (!len) return 0;
    if (!chunked) return conn_write(c, data, len);
    char size[24];
    int sl = snprintf(size, sizeof size, "%zx\r\n", len);
    struct iovec iov[3] = {{size, (size_t)sl}, {(void *)(uintptr_t)data, len}, {(void *)"\r\n", 2}};
    return conn_writev(c, iov, 3);
}

/* Pump a stream to the client until the producer ends it, the client goes,
 * it stalls, or the server's drain deadline passes.  Returns whether the
 * body ended cleanly (the connection may be kept). */
static bool pump_stream(struct conn *c, ds41_http_exchange *ex, ds41_http_stream *s, bool chunked) {
    ds41_http_metrics *metrics = ex->router->metrics;
    char *blk = malloc(STREAM_BLOCK);
    if (!blk) return false;
    bool clean = false;
    for (;;) {
        bool ended, overflow;
        size_t n = stream_take(s, blk, STREAM_BLOCK, &ended, &overflow);
        if (n) {
            if (send_piece(c, chunked, blk, n) != 0) break;
            continue;
        }
        if (ended) {
            clean = !chunked || conn_write(c, "0\r\n\r\n", 5) == 0;
            break;
        }
        if (overflow) break;
        struct pollfd p[3] = {
            {.fd = s->efd, .events = POLLIN},
            {.fd = c->fd, .events = POLLRDHUP},
            {.fd = c->srv->abort_fd, .events = POLLIN},
        };
        int r = poll(p, 3, (int)c->srv->cfg.sse_keepalive_ms);
        if (r < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (p[1].revents & GONE_EVENTS) {
            ds41_http_metrics_event(metrics, DS41_HTTP_EV_CLIENT_GONE);
            break;
        }
        if (p[2].revents & POLLIN) {
            /* Server stop: the producer's further writes are dropped; the
             * client gets the route's stop event and a clean end. */
            pthread_mutex_lock(&s->mu);
            s->consumer_gone = true;
            pthread_mutex_unlock(&s->mu);
            if (ex->stop_event && send_piece(c, chunked, ex->stop_event, strlen(ex->stop_event)) != 0) break;
            if (chunked) (void)conn_write(c, "0\r\n\r\n", 5);
            break; /* the connection closes: the server is stopping */
        }
        if (p[0].revents & POLLIN) {
            drain_eventfd(s->efd);
            continue;
        }
        if (r == 0 && send_piece(c, chunked, keepalive_comment, sizeof keepalive_comment - 1) != 0) break;
    }
    free(blk);
    return clean;
}

/* ============================================================ connections */

static void exchange_end(struct conn *c, ds41_http_exchange *ex) {
    ds41_http_server *srv = c->srv;
    ds41_http_metrics_request(srv->router->metrics, ex->route ? ex->route->name : NULL, ex->status);
    pthread_mutex_lock(&srv->mu);
    if (ex->counted_active) srv->active--;
    pthread_cond_broadcast(&srv->cond);
    pthread_mutex_unlock(&srv->mu);
    if (ex->counted_active) ds41_http_metrics_gauge(srv->router->metrics, GAUGE_ACTIVE, -1);
    exchange_free(ex);
}

/* Write the handler's answer.  Returns whether the connection may be kept. */
static bool send_answer(struct conn *c, ds41_http_exchange *ex, const ds41_http_head *h, bool keep) {
    if (ex->abandoned || !ex->answered) return false;
    bool head_only = strcmp(h->method, "HEAD") == 0;
    if (!ex->resp_stream)
        return send_buffered(c, ex, ex->status, ex->resp_type, ex->resp_body, ex->resp_len, head_only, keep,
                             h->minor) == 0 &&
               keep;
    ds41_http_stream *s = ex->resp_stream;
    ex->resp_stream = NULL;
    bool chunked = h->minor == 1;
    if (!chunked) keep = false; /* an HTTP/1.0 body ends with the connection */
    size_t hl = 0;
    char *head = answer_head(ex, ex->status, ex->resp_type, chunked ? FRAME_CHUNKED : FRAME_UNTIL_CLOSE, 0,
                             keep, h->minor, &hl);
    bool ok = false;
    if (head) {
        /* the stream's own headers, after the handler's */
        static const char extra[] = "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n\r\n";
        struct iovec iov[2] = {{head, hl - 2}, {(void *)extra, sizeof extra - 1}};
        ok = conn_writev(c, iov, 2) == 0;
        free(head);
    }
    if (ok && !head_only) ok = pump_stream(c, ex, s, chunked);
    stream_release_consumer(s);
    return ok && keep;
}

/* Read, handle and answer one request.  Returns whether to serve another on
 * this connection. */
static bool serve_request(struct conn *c, int64_t deadline) {
    ds41_http_server *srv = c->srv;
    ds41_http_metrics *metrics = srv->router->metrics;
    ds41_http_head *h = malloc(sizeof *h);
    if (!h) return false;
    ds41_http_parse_error perr;
    size_t used = 0;
    bool keep = false;
    for (;;) {
        ds41_http_parse_result r =
            c->len ? ds41_http_parse_head(c->buf, c->len, h, &used, &perr) : DS41_HTTP_PARSE_INCOMPLETE;
        if (r == DS41_HTTP_PARSE_OK) break;
        if (r == DS41_HTTP_PARSE_ERROR) {
            send_protocol_error(c, perr.status, perr.code, perr.message);
            goto out;
        }
        io_result io = conn_fill(c, deadline);
        if (io == IO_OK) continue;
        if (io == IO_TIMEOUT) {
            ds41_http_metrics_event(metrics, DS41_HTTP_EV_TIMEOUT);
            send_protocol_error(c, 408, "request_timeout",
                                "the request was not received within the request timeout");
        } else if (io == IO_IDLE && c->len) {
            ds41_http_metrics_event(metrics, DS41_HTTP_EV_TIMEOUT);
        }
        goto out;
    }
    conn_consume(c, used);

    ds41_http_exchange *ex = calloc(1, sizeof *ex);
    if (!ex) goto out;
    ex->kind = EX_SOCKET;
    ex->router = srv->router;
    ex->srv = srv;
    ex->sock_fd = c->fd;
    ex->abort_fd = srv->abort_fd;
    ex->auth = c->auth;
    ex->peer = c->peer;
    pthread_mutex_lock(&srv->mu);
    bool draining = srv->draining;
    srv->active++;
    ex->counted_active = true;
    pthread_mutex_unlock(&srv->mu);
    ds41_http_metrics_gauge(metrics, GAUGE_ACTIVE, +1);

    bool body_pending = h->chunked || (h->has_length && h->content_length > 0);
    if (draining) {
        snprintf(ex->method, sizeof ex->method, "%s", h->method);
        ds41_http_add_header(ex, "Connection", "close");
        ds41_http_add_header(ex, "Retry-After", "1");
        ds41_http_respond_error(ex, 503, NULL, "shutting_down", NULL, "the server is shutting down");
    } else if (!route_request(ex, h->method, h->path, h->has_length, h->content_length,
                              h->has_content_type ? h->content_type : NULL)) {
        if (body_pending && h->expect_continue) {
            static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
            if (conn_write(c, cont, sizeof cont - 1) != 0) ex->abandoned = true;
        }
        body_result br = ex->abandoned ? BODY_GONE : read_body(c, ex, h, deadline, &perr);
        if (br == BODY_OK) body_pending = false;
        if (br == BODY_OK && now_ms() >= deadline) br = BODY_TIMEOUT; /* complete, but late */
        switch (br) {
        case BODY_OK:
            run_handler(ex);
            break;
        case BODY_TIMEOUT:
            ds41_http_metrics_event(metrics, DS41_HTTP_EV_TIMEOUT);
            ds41_http_add_header(ex, "Connection", "close");
            ds41_http_respond_error(ex, 408, NULL, "request_timeout", NULL,
                                    "the request was not received within the request timeout");
            break;
        case BODY_TOO_LARGE: {
            ds41_http_metrics_event(metrics, DS41_HTTP_EV_TOO_LARGE);
            ds41_http_add_header(ex, "Connection", "close");
            ds41_http_respond_error(ex, 413, NULL, "request_too_large", NULL,
                                    "request body exceeds the limit of %zu bytes",
                                    router_max_body(srv->router));
            break;
        }
        case BODY_BAD:
            ds41_http_add_header(ex, "Connection", "close");
            ds41_http_respond_error(ex, perr.status, NULL, perr.code, NULL, "%s", perr.message);
            break;
        case BODY_GONE:
            ds41_http_abandon(ex);
            break;
        }
    }
    /* An answer given before the body was read (404, 413, ...) ends the
     * connection: the unread body cannot be told from a next request. */
    keep = h->keep_alive && !body_pending && !wants_close(ex);
    pthread_mutex_lock(&srv->mu);
    if (srv->draining) keep = false;
    pthread_mutex_unlock(&srv->mu);
    keep = send_answer(c, ex, h, keep);
    exchange_end(c, ex);
out:
    free(h);
    return keep;
}

/* Before the close: end our side, then read (and drop) what the client
 * still sends for a moment.  Closing a socket with unread bytes resets the
 * connection (TCP) or fails the client's pending send with ECONNRESET (Unix)
 * -- a client still sending a body that was refused (413, 404, a framing
 * error) would lose the answer instead of reading it.  Bounded in time and
 * bytes; a client that closes ends it at once. */
static void conn_linger(struct conn *c) {
    shutdown(c->fd, SHUT_WR);
    int64_t until = now_ms() + LINGER_MS;
    char sink[16384];
    for (size_t total = 0; total < LINGER_BYTES;) {
        int64_t left = until - now_ms();
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        if (left <= 0 || poll(&p, 1, (int)left) <= 0) break;
        ssize_t n = recv(c->fd, sink, sizeof sink, MSG_DONTWAIT);
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (n <= 0) break;
        total += (size_t)n;
    }
}

static void *conn_main(void *arg) {
    struct conn *c = arg;
    ds41_http_server *srv = c->srv;
    if (c->ls->is_unix)
        read_peer(srv, c);
    else
        c->auth = c->ls->credless_class;
    /* A complete request is due within request_timeout_ms of the connect,
     * or of the end of the previous answer plus the idle time. */
    int64_t deadline = c->accepted_ms + srv->cfg.request_timeout_ms;
    while (serve_request(c, deadline)) {
        c->last_rx_ms = now_ms();
        deadline = c->last_rx_ms + (int64_t)srv->cfg.idle_timeout_s * 1000 + srv->cfg.request_timeout_ms;
    }
    conn_linger(c);
    ds41_http_metrics *metrics = srv->router->metrics;
    ds41_http_metrics_gauge(metrics, GAUGE_CONNECTIONS, -1);
    pthread_mutex_lock(&srv->mu);
    if (c->prev) c->prev->next = c->next;
    if (c->next) c->next->prev = c->prev;
    if (srv->conns == c) srv->conns = c->next;
    srv->n_conns--;
    c->ls->n_conns--;
    pthread_cond_broadcast(&srv->cond);
    pthread_mutex_unlock(&srv->mu);
    /* srv may be gone from here on (stop waits only for the count above) */
    close(c->fd);
    free(c->buf);
    free(c);
    return NULL;
}

/* ================================================================ accept */

/* A connection over max_connections (or one that arrives while the server drains) gets a 503 with
 * Retry-After before it is closed, so a client can tell "busy, retry" from a crash.  One write on
 * the non-blocking socket, before reading anything: it fits the socket's buffer, and a client that
 * sent its request meanwhile still reads the answer. */
static void refuse_busy(int fd, bool draining, unsigned limit) {
    char msg[128];
    snprintf(msg, sizeof msg, "too many open connections (%u on this socket); retry later", limit);
    size_t blen = 0;
    char *body = ds41_http_error_json(503, NULL, draining ? "shutting_down" : "too_many_connections", NULL,
                                      draining ? "the server is shutting down" : msg, &blen);
    if (!body) return;
    char head[256];
    int hl = snprintf(head, sizeof head,
                      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                      "Content-Length: %zu\r\nRetry-After: 1\r\nConnection: close\r\n\r\n",
                      blen);
    struct iovec iov[2] = {{.iov_base = head, .iov_len = (size_t)hl}, {.iov_base = body, .iov_len = blen}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
    (void)!sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    free(body);
}

static void *accept_main(void *arg) {
    struct listener_state *ls = arg;
    ds41_http_server *srv = ls->srv;
    for (;;) {
        struct pollfd p[2] = {{.fd = ls->fd, .events = POLLIN}, {.fd = srv->stop_fd, .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            srv_log(srv, "poll on listener fd %d: %s", ls->fd, strerror(errno));
            break;
        }
        if (p[1].revents & POLLIN) break;
        if (!(p[0].revents & POLLIN)) continue;
        int fd = accept4(ls->fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED) continue;
            srv_log(srv, "accept on fd %d: %s", ls->fd, strerror(errno));
            /* out of fds or memory: back off instead of spinning */
            struct pollfd stop = {.fd = srv->stop_fd, .events = POLLIN};
            if (poll(&stop, 1, 100) > 0) break;
            continue;
        }
        struct conn *c = calloc(1, sizeof *c);
        char *buf = c ? malloc(CONN_BUF) : NULL;
        pthread_mutex_lock(&srv->mu);
        bool refuse = !buf || srv->draining || ls->n_conns >= srv->cfg.max_connections;
        if (!refuse) {
            c->srv = srv;
            c->ls = ls;
            c->fd = fd;
            c->buf = buf;
            c->accepted_ms = c->last_rx_ms = now_ms();
            c->next = srv->conns;
            if (srv->conns) srv->conns->prev = c;
            srv->conns = c;
            srv->n_conns++;
            ls->n_conns++;
        }
        pthread_mutex_unlock(&srv->mu);
        if (refuse) {
            ds41_http_metrics_event(srv->router->metrics, DS41_HTTP_EV_REFUSED_PEER);
            if (buf) refuse_busy(fd, srv->draining, srv->cfg.max_connections);
            close(fd);
            free(buf);
            free(c);
            continue;
        }
        ds41_http_metrics_gauge(srv->router->metrics, GAUGE_CONNECTIONS, +1);
        pthread_attr_t attr;
        pthread_t t;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, conn_main, c);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            srv_log(srv, "cannot start a connection thread: %s", strerror(rc));
            ds41_http_metrics_gauge(srv->router->metrics, GAUGE_CONNECTIONS, -1);
            pthread_mutex_lock(&srv->mu);
            if (c->next) c->next->prev = c->prev;
            srv->conns = c->next;
            srv->n_conns--;
            ls->n_conns--;
            pthread_cond_broadcast(&srv->cond);
            pthread_mutex_unlock(&srv->mu);
            close(fd);
            free(buf);
            free(c);
        }
    }
    return NULL;
}

/* ============================================================ start / stop */

static void stop_accepting(ds41_http_server *s) {
    uint64_t one = 1;
    if (s->stop_fd >= 0) (void)!write(s->stop_fd, &one, sizeof one);
    for (size_t i = 0; i < s->n_ls; i++)
        if (s->ls[i].thread_started) {
            pthread_join(s->ls[i].thread, NULL);
            s->ls[i].thread_started = false;
        }
}

static void server_free(ds41_http_server *s) {
    for (size_t i = 0; i < s->n_ls; i++)
        if (s->ls[i].fd >= 0) close(s->ls[i].fd);
    if (s->stop_fd >= 0) close(s->stop_fd);
    if (s->abort_fd >= 0) close(s->abort_fd);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int ds41_http_server_start(const ds41_http_config *cfg, const ds41_http_router *router,
                           ds41_http_server **out, ds41_error *err) {
    *out = NULL;
    if (!cfg || !router || cfg->n_listeners == 0 || cfg->n_listeners > MAX_LISTENERS)
        return ds41_fail(err, "http server: need 1..%d listeners", MAX_LISTENERS);
    for (size_t i = 0; i < router->n_routes; i++)
        if (!router->routes[i].handler || !router->routes[i].path || !router->routes[i].method)
            return ds41_fail(err, "http server: route %zu is incomplete", i);
    ds41_http_server *s = calloc(1, sizeof *s);
    if (!s) return ds41_fail(err, "http server: out of memory");
    s->cfg = *cfg;
    s->cfg.listeners = NULL;
    if (!s->cfg.max_connections) s->cfg.max_connections = DEFAULT_MAX_CONNECTIONS;
    if (!s->cfg.request_timeout_ms) s->cfg.request_timeout_ms = DEFAULT_REQUEST_TIMEOUT_MS;
    if (!s->cfg.idle_timeout_s) s->cfg.idle_timeout_s = DEFAULT_IDLE_TIMEOUT_S;
    if (!s->cfg.sse_keepalive_ms) s->cfg.sse_keepalive_ms = DEFAULT_KEEPALIVE_MS;
    if (!s->cfg.max_stream_buffer) s->cfg.max_stream_buffer = DEFAULT_STREAM_BUFFER;
    s->router = router;
    s->stop_fd = s->abort_fd = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cond, &ca);
    pthread_condattr_destroy(&ca);
    for (size_t i = 0; i < MAX_LISTENERS; i++) s->ls[i].fd = -1;

    s->abort_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    s->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->abort_fd < 0 || s->stop_fd < 0) {
        ds41_fail(err, "http server: eventfd: %s", strerror(errno));
        goto fail;
    }
    for (size_t i = 0; i < cfg->n_listeners; i++) {
        int fd = cfg->listeners[i].fd;
        int v = 0;
        socklen_t vl = sizeof v;
        if (fd < 0 || getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &v, &vl) != 0 || !v) {
            ds41_fail(err, "http server: listener %zu (fd %d) is not a listening socket", i, fd);
            goto fail;
        }
        vl = sizeof v;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &v, &vl) != 0 || v != SOCK_STREAM) {
            ds41_fail(err, "http server: listener %zu (fd %d) is not a stream socket", i, fd);
            goto fail;
        }
        vl = sizeof v;
        if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &v, &vl) != 0 ||
            (v != AF_UNIX && v != AF_INET && v != AF_INET6)) {
            ds41_fail(err, "http server: listener %zu (fd %d) has an unsupported address family", i, fd);
            goto fail;
        }
        struct listener_state *ls = &s->ls[i];
        ls->srv = s;
        ls->is_unix = v == AF_UNIX;
        ls->credless_class =
            cfg->listeners[i].credless_class ? cfg->listeners[i].credless_class : DS41_AUTH_INFERENCE;
        ls->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        s->n_ls = i + 1;
        if (ls->fd < 0) {
            ds41_fail(err, "http server: dup of listener fd %d: %s", fd, strerror(errno));
            goto fail;
        }
        /* accept4 after poll must not block when another process took the
         * connection first (the flag is shared with the caller's fd, which
         * only ever hands it on). */
        int fl = fcntl(ls->fd, F_GETFL);
        if (fl < 0 || fcntl(ls->fd, F_SETFL, fl | O_NONBLOCK) != 0) {
            ds41_fail(err, "http server: listener fd %d: %s", fd, strerror(errno));
            goto fail;
        }
    }
    for (size_t i = 0; i < s->n_ls; i++) {
        int rc = pthread_create(&s->ls[i].thread, NULL, accept_main, &s->ls[i]);
        if (rc != 0) {
            ds41_fail(err, "http server: cannot start the accept thread: %s", strerror(rc));
            goto fail;
        }
        s->ls[i].thread_started = true;
    }
    *out = s;
    return 0;
fail:
    stop_accepting(s);
    server_free(s);
    return -1;
}

/* Wait (s->mu held) until no request is active or the monotonic deadline. */
static void wait_idle_locked(ds41_http_server *s, int64_t deadline) {
    while (s->active > 0) {
        if (now_ms() >= deadline) break;
        struct timespec ts = {.tv_sec = (time_t)(deadline / 1000),
                              .tv_nsec = (long)(deadline % 1000) * 1000000};
        pthread_cond_timedwait(&s->cond, &s->mu, &ts);
    }
}

unsigned ds41_http_server_stop(ds41_http_server *s, unsigned drain_ms) {
    if (!s) return 0;
    pthread_mutex_lock(&s->mu);
    s->draining = true;
    pthread_mutex_unlock(&s->mu);
    stop_accepting(s); /* the listening fds stay open in the caller's hands */
    pthread_mutex_lock(&s->mu);
    wait_idle_locked(s, now_ms() + drain_ms);
    unsigned aborted = s->active;
    if (aborted) {
        uint64_t one = 1;
        (void)!write(s->abort_fd, &one, sizeof one);
        wait_idle_locked(s, now_ms() + 5000);
    }
    /* Close what is left: idle keep-alive connections, clients still
     * sending a request.  A handler still inside a slow service call is
     * waited for (its thread owns the connection). */
    for (struct conn *c = s->conns; c; c = c->next) shutdown(c->fd, SHUT_RDWR);
    while (s->n_conns > 0) pthread_cond_wait(&s->cond, &s->mu);
    pthread_mutex_unlock(&s->mu);
    server_free(s);
    return aborted;
}

unsigned ds41_http_server_connections(ds41_http_server *s) {
    pthread_mutex_lock(&s->mu);
    unsigned n = s->n_conns;
    pthread_mutex_unlock(&s->mu);
    return n;
}

unsigned ds41_http_server_active_requests(ds41_http_server *s) {
    pthread_mutex_lock(&s->mu);
    unsigned n = s->active;
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* ====================================================== in-memory dispatch */

int ds41_http_dispatch_memory(const ds41_http_router *router, const char *method, const char *path,
                              ds41_auth_class auth, const char *content_type, const void *body,
                              size_t body_len, int timeout_ms, ds41_http_memory_response *out,
                              ds41_error *err) {
    memset(out, 0, sizeof *out);
    ds41_http_exchange *ex = calloc(1, sizeof *ex);
    if (!ex) return ds41_fail(err, "dispatch: out of memory");
    ex->kind = EX_MEMORY;
    ex->router = router;
    ex->sock_fd = -1;
    ex->abort_fd = -1;
    ex->auth = auth;
    ex->mem = out;
    if (!route_request(ex, method, path, true, body_len, content_type)) {
        if (body_len && body_append(ex, body, body_len) != 0) {
            ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        } else {
            run_handler(ex);
        }
    }
    if (ex->mem_stream) {
        ds41_http_stream *s = ex->mem_stream;
        ds41_buf b = {0};
        ds41_buf_put(&b, "", 0);
        int64_t deadline = timeout_ms >= 0 ? now_ms() + timeout_ms : 0;
        char chunk[4096];
        for (;;) {
            bool ended, overflow;
            size_t n = stream_take(s, chunk, sizeof chunk, &ended, &overflow);
            if (n) {
                ds41_buf_put(&b, chunk, n);
                continue;
            }
            if (ended || overflow) break;
            int wait_ms = -1;
            if (timeout_ms >= 0) {
                int64_t left = deadline - now_ms();
                if (left <= 0) {
                    out->timed_out = true;
                    break;
                }
                wait_ms = left > INT32_MAX ? INT32_MAX : (int)left;
            }
            struct pollfd p = {.fd = s->efd, .events = POLLIN};
            if (poll(&p, 1, wait_ms) > 0) drain_eventfd(s->efd);
        }
        stream_release_consumer(s);
        out->body = b.data;
        out->body_len = b.oom ? 0 : b.len;
        if (b.oom) {
            free(b.data);
            out->body = NULL;
        }
    }
    if (!out->body && out->status) {
        out->body = calloc(1, 1);
    }
    if (router->metrics)
        ds41_http_metrics_request(router->metrics, ex->route ? ex->route->name : NULL, out->status);
    exchange_free(ex);
    return 0;
}

void ds41_http_memory_response_free(ds41_http_memory_response *r) {
    if (!r) return;
    free(r->content_type);
    free(r->headers);
    free(r->body);
    memset(r, 0, sizeof *r);
}
