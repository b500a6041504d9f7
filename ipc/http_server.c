/* HTTP server on libmicrohttpd: see http_server.h for the model.
 *
 * Layout of this file: metrics, exchanges and answers, streams, signals and
 * waits, routing, the MHD callbacks (connection notify, access handler,
 * request completed), the deadline reaper, start/stop, in-memory dispatch. */
#include "ipc/http_server.h"

#include "config/buf.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <microhttpd.h>
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

#include "ipc/json_util.h"

#define DEFAULT_MAX_BODY (32u << 20)
#define DEFAULT_MAX_CONNECTIONS 256u
#define DEFAULT_REQUEST_TIMEOUT_MS 30000u
#define DEFAULT_IDLE_TIMEOUT_S 60u
#define DEFAULT_KEEPALIVE_MS 15000u
#define DEFAULT_STREAM_BUFFER (8u << 20)
#define MAX_LISTENERS 8
#define MAX_EXTRA_HEADERS 8
#define STREAM_BLOCK 16384
#define HEADER_MEMORY_LIMIT (64u << 10)
#define MAX_PATH_PARAM 128

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ================================================================ metrics */

#define METRIC_SLOTS 160

struct ds41_http_metrics {
    pthread_mutex_t mu;
    struct {
        char route[48];
        int status;
        uint64_t count;
    } req[METRIC_SLOTS];
    size_t n_req;
    uint64_t req_overflow;
    uint64_t events[DS41_HTTP_EV_COUNT];
    int64_t connections;
    int64_t active;
};

static const char *const event_names[DS41_HTTP_EV_COUNT] = {
    [DS41_HTTP_EV_CLIENT_GONE] = "client_gone",   [DS41_HTTP_EV_TIMEOUT] = "request_timeout",
    [DS41_HTTP_EV_TOO_LARGE] = "body_too_large",  [DS41_HTTP_EV_STALLED] = "stream_stalled",
    [DS41_HTTP_EV_REFUSED_PEER] = "refused_peer",
};

ds41_http_metrics *ds41_http_metrics_new(void) {
    ds41_http_metrics *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    pthread_mutex_init(&m->mu, NULL);
    return m;
}

void ds41_http_metrics_free(ds41_http_metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

void ds41_http_metrics_event(ds41_http_metrics *m, ds41_http_event ev) {
    if (!m || (unsigned)ev >= DS41_HTTP_EV_COUNT) return;
    pthread_mutex_lock(&m->mu);
    m->events[ev]++;
    pthread_mutex_unlock(&m->mu);
}

void ds41_http_metrics_request(ds41_http_metrics *m, const char *route, int status) {
    if (!m) return;
    if (!route) route = "unmatched";
    pthread_mutex_lock(&m->mu);
    size_t i;
    for (i = 0; i < m->n_req; i++)
        if (m->req[i].status == status && strcmp(m->req[i].route, route) == 0) break;
    if (i == m->n_req) {
        if (m->n_req == METRIC_SLOTS) {
            m->req_overflow++;
            pthread_mutex_unlock(&m->mu);
            return;
        }
        snprintf(m->req[i].route, sizeof m->req[i].route, "%s", route);
        m->req[i].status = status;
        m->n_req++;
    }
    m->req[i].count++;
    pthread_mutex_unlock(&m->mu);
}

enum gauge { GAUGE_CONNECTIONS, GAUGE_ACTIVE };

static void metrics_gauge(ds41_http_metrics *m, enum gauge which, int delta) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    if (which == GAUGE_CONNECTIONS)
        m->connections += delta;
    else
        m->active += delta;
    pthread_mutex_unlock(&m->mu);
}

char *ds41_http_metrics_render(ds41_http_metrics *m, size_t *len) {
    ds41_buf b = {0};
    ds41_buf_put(&b, "", 0);
    if (m) {
        pthread_mutex_lock(&m->mu);
        ds41_buf_printf(&b, "# HELP ds41_http_requests_total HTTP requests answered, by route and status.\n"
                      "# TYPE ds41_http_requests_total counter\n");
        for (size_t i = 0; i < m->n_req; i++)
            ds41_buf_printf(&b, "ds41_http_requests_total{route=\"%s\",code=\"%d\"} %" PRIu64 "\n", m->req[i].route,
                      m->req[i].status, m->req[i].count);
        ds41_buf_printf(&b, "# HELP ds41_http_events_total Connections refused or cut, by reason.\n"
                      "# TYPE ds41_http_events_total counter\n");
        for (int e = 0; e < DS41_HTTP_EV_COUNT; e++)
            ds41_buf_printf(&b, "ds41_http_events_total{event=\"%s\"} %" PRIu64 "\n", event_names[e], m->events[e]);
        ds41_buf_printf(&b,
                  "# HELP ds41_http_connections Open client connections.\n"
                  "# TYPE ds41_http_connections gauge\n"
                  "ds41_http_connections %" PRId64 "\n"
                  "# HELP ds41_http_active_requests Requests being received, handled or streamed.\n"
                  "# TYPE ds41_http_active_requests gauge\n"
                  "ds41_http_active_requests %" PRId64 "\n",
                  m->connections, m->active);
        pthread_mutex_unlock(&m->mu);
    }
    if (b.oom) {
        free(b.data);
        return NULL;
    }
    if (len) *len = b.len;
    return b.data;
}

/* ================================================================ server */

struct listener_state {
    struct ds41_http_server *srv;
    struct MHD_Daemon *daemon;
    int fd; /* our duplicate of the caller's listening fd */
    ds41_auth_class credless_class;
    bool is_unix;
};

struct conn_rec {
    struct conn_rec *prev, *next;
    int fd;
    ds41_http_peer peer;
    ds41_auth_class auth;
    int64_t deadline_ms; /* a complete request is due by then; 0 = not receiving */
    bool cut;            /* shut down by the deadline or a body limit */
};

struct ds41_http_server {
    ds41_http_config cfg;
    const ds41_http_router *router;
    struct listener_state ls[MAX_LISTENERS];
    size_t n_ls;
    pthread_mutex_t mu;
    pthread_cond_t cond; /* CLOCK_MONOTONIC: active / connections changed, reaper stop */
    struct conn_rec *conns;
    unsigned n_conns;
    unsigned active;
    bool draining;
    bool reaper_stop;
    bool reaper_started;
    pthread_t reaper;
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

enum ex_kind { EX_MHD, EX_MEMORY };

struct ds41_http_exchange {
    enum ex_kind kind;
    const ds41_http_router *router;
    const ds41_http_route *route;
    ds41_http_server *srv; /* EX_MHD */
    struct conn_rec *rec;  /* EX_MHD */
    struct MHD_Connection *conn;
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

static void mhd_add_headers(ds41_http_exchange *ex, struct MHD_Response *r, const char *content_type) {
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    for (int i = 0; i < ex->n_hdr; i++) MHD_add_response_header(r, ex->hdr[i].name, ex->hdr[i].value);
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
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)(uintptr_t)body, MHD_RESPMEM_MUST_COPY);
    if (!r) {
        ex->abandoned = true;
        return -1;
    }
    mhd_add_headers(ex, r, content_type);
    enum MHD_Result q = MHD_queue_response(ex->conn, (unsigned)status, r);
    MHD_destroy_response(r);
    if (q != MHD_YES) {
        ex->abandoned = true;
        return -1;
    }
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
    int sock_fd;                /* the client's socket once attached over MHD, else -1 */
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

struct stream_consumer {
    ds41_http_stream *s;
    int sock_fd;
    int abort_fd;
    unsigned keepalive_ms;
    ds41_http_metrics *metrics;
    char *stop_event;
    size_t stop_off;
    bool stopping;
};

static const char keepalive_comment[] = ": keep-alive\n\n";

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    struct stream_consumer *c = cls;
    if (c->stopping) {
        size_t n = c->stop_event ? strlen(c->stop_event) - c->stop_off : 0;
        if (n == 0) return MHD_CONTENT_READER_END_OF_STREAM;
        if (n > max) n = max;
        memcpy(buf, c->stop_event + c->stop_off, n);
        c->stop_off += n;
        return (ssize_t)n;
    }
    for (;;) {
        bool ended, overflow;
        size_t n = stream_take(c->s, buf, max, &ended, &overflow);
        if (n) return (ssize_t)n;
        if (ended) return MHD_CONTENT_READER_END_OF_STREAM;
        if (overflow) return MHD_CONTENT_READER_END_WITH_ERROR;
        struct pollfd p[3] = {
            {.fd = c->s->efd, .events = POLLIN},
            {.fd = c->sock_fd, .events = POLLRDHUP},
            {.fd = c->abort_fd, .events = POLLIN},
        };
        int r = poll(p, c->abort_fd >= 0 ? 3 : 2, (int)c->keepalive_ms);
        if (r < 0) {
            if (errno == EINTR) continue;
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (p[1].revents & GONE_EVENTS) {
            ds41_http_metrics_event(c->metrics, DS41_HTTP_EV_CLIENT_GONE);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (c->abort_fd >= 0 && (p[2].revents & POLLIN)) {
            /* Server stop: the producer's further writes are dropped; the
             * client gets the route's stop event and a clean end. */
            pthread_mutex_lock(&c->s->mu);
            c->s->consumer_gone = true;
            pthread_mutex_unlock(&c->s->mu);
            c->stopping = true;
            return stream_reader(cls, pos, buf, max);
        }
        if (p[0].revents & POLLIN) {
            drain_eventfd(c->s->efd);
            continue;
        }
        if (r == 0 && max >= sizeof keepalive_comment - 1) {
            memcpy(buf, keepalive_comment, sizeof keepalive_comment - 1);
            return (ssize_t)(sizeof keepalive_comment - 1);
        }
    }
}

static void stream_consumer_free(void *cls) {
    struct stream_consumer *c = cls;
    stream_release_consumer(c->s);
    free(c->stop_event);
    free(c);
}

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
    struct stream_consumer *c = calloc(1, sizeof *c);
    if (!c) {
        ex->abandoned = true;
        stream_release_consumer(s);
        return -1;
    }
    pthread_mutex_lock(&s->mu);
    s->sock_fd = ex->sock_fd;
    s->metrics = ex->router->metrics;
    pthread_mutex_unlock(&s->mu);
    c->s = s;
    c->sock_fd = ex->sock_fd;
    c->abort_fd = ex->abort_fd;
    c->keepalive_ms = ex->srv->cfg.sse_keepalive_ms;
    c->metrics = ex->router->metrics;
    c->stop_event = stop_event ? strdup(stop_event) : NULL;
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, STREAM_BLOCK, stream_reader,
                                                               c, stream_consumer_free);
    if (!r) {
        ex->abandoned = true;
        stream_consumer_free(c);
        return -1;
    }
    mhd_add_headers(ex, r, content_type);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no");
    enum MHD_Result q = MHD_queue_response(ex->conn, (unsigned)status, r);
    MHD_destroy_response(r); /* frees c (and abandons the stream) if the queue failed */
    if (q != MHD_YES) {
        ex->abandoned = true;
        return -1;
    }
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
    free(ex->path);
    free(ex->body);
    free(ex);
}

/* ====================================================== MHD: connections */

/* Credentials of a Unix-socket peer and its class. */
static void read_peer(ds41_http_server *srv, struct conn_rec *rec) {
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

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    struct listener_state *ls = cls;
    ds41_http_server *srv = ls->srv;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        struct conn_rec *rec = calloc(1, sizeof *rec);
        *socket_context = rec;
        if (!rec) return; /* the access handler refuses a connection without a record */
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        rec->fd = ci ? ci->connect_fd : -1;
        if (ls->is_unix && rec->fd >= 0)
            read_peer(srv, rec);
        else
            rec->auth = ls->credless_class;
        pthread_mutex_lock(&srv->mu);
        rec->deadline_ms = now_ms() + srv->cfg.request_timeout_ms;
        rec->next = srv->conns;
        if (srv->conns) srv->conns->prev = rec;
        srv->conns = rec;
        srv->n_conns++;
        pthread_cond_broadcast(&srv->cond);
        pthread_mutex_unlock(&srv->mu);
        metrics_gauge(srv->router->metrics, GAUGE_CONNECTIONS, +1);
        return;
    }
    struct conn_rec *rec = *socket_context;
    if (!rec) return;
    *socket_context = NULL;
    pthread_mutex_lock(&srv->mu);
    if (rec->prev) rec->prev->next = rec->next;
    if (rec->next) rec->next->prev = rec->prev;
    if (srv->conns == rec) srv->conns = rec->next;
    srv->n_conns--;
    pthread_cond_broadcast(&srv->cond);
    pthread_mutex_unlock(&srv->mu);
    metrics_gauge(srv->router->metrics, GAUGE_CONNECTIONS, -1);
    free(rec);
}

/* Answer a request MHD is still reading by writing it straight onto the
 * socket, then shut the connection down.  Only while MHD reads (deadline
 * set), so nothing MHD sends can interleave.  Called with srv->mu held. */
static void cut_locked(ds41_http_server *srv, struct conn_rec *rec, int status, const char *code,
                       const char *message) {
    if (rec->cut) return;
    rec->cut = true;
    rec->deadline_ms = 0;
    if (rec->fd < 0) return;
    size_t blen = 0;
    char *body = ds41_http_error_json(status, NULL, code, NULL, message, &blen);
    if (body) {
        char head[256];
        int hl = snprintf(head, sizeof head,
                          "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                          "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                          status, status == 408 ? "Request Timeout" : "Content Too Large", blen);
        if (hl > 0 && (size_t)hl < sizeof head) {
            struct iovec iov[2] = {{head, (size_t)hl}, {body, blen}};
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
            (void)!sendmsg(rec->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        free(body);
    }
    shutdown(rec->fd, SHUT_RDWR);
    (void)srv;
}

/* ===================================================== MHD: access handler */

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
    (void)version;
    struct listener_state *ls = cls;
    ds41_http_server *srv = ls->srv;
    ds41_http_exchange *ex = *con_cls;

    if (!ex) { /* headers complete: first call */
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        struct conn_rec *rec = ci ? ci->socket_context : NULL;
        if (!rec) return MHD_NO;
        ex = calloc(1, sizeof *ex);
        if (!ex) return MHD_NO;
        ex->kind = EX_MHD;
        ex->router = srv->router;
        ex->srv = srv;
        ex->rec = rec;
        ex->conn = conn;
        ex->sock_fd = rec->fd;
        ex->abort_fd = srv->abort_fd;
        ex->auth = rec->auth;
        ex->peer = rec->peer;
        *con_cls = ex;
        pthread_mutex_lock(&srv->mu);
        bool cut = rec->cut, draining = srv->draining;
        srv->active++;
        ex->counted_active = true;
        pthread_mutex_unlock(&srv->mu);
        metrics_gauge(srv->router->metrics, GAUGE_ACTIVE, +1);
        if (cut) return MHD_NO;
        if (draining) {
            snprintf(ex->method, sizeof ex->method, "%s", method);
            ds41_http_add_header(ex, "Connection", "close");
            ds41_http_add_header(ex, "Retry-After", "1");
            ds41_http_respond_error(ex, 503, NULL, "shutting_down", NULL, "the server is shutting down");
            return MHD_YES;
        }
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        uint64_t length = 0;
        bool has_length = false;
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long v = strtoull(cl, &end, 10);
            if (end != cl && *end == 0 && errno == 0) {
                has_length = true;
                length = v;
            } else if (errno == ERANGE) {
                has_length = true;
                length = UINT64_MAX;
            }
        }
        const char *ct = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Type");
        route_request(ex, method, url, has_length, length, ct);
        return ex->abandoned ? MHD_NO : MHD_YES;
    }

    if (*upload_data_size) { /* a piece of the body */
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (ex->answered) return MHD_YES; /* early answer: MHD discards the body */
        struct conn_rec *rec = ex->rec;
        pthread_mutex_lock(&srv->mu);
        if (rec->cut) {
            pthread_mutex_unlock(&srv->mu);
            return MHD_NO;
        }
        if (rec->deadline_ms && now_ms() >= rec->deadline_ms) {
            cut_locked(srv, rec, 408, "request_timeout",
                       "the request was not received within the request timeout");
            pthread_mutex_unlock(&srv->mu);
            ds41_http_metrics_event(srv->router->metrics, DS41_HTTP_EV_TIMEOUT);
            ex->status = 408;
            return MHD_NO;
        }
        size_t max = router_max_body(srv->router);
        if (ex->body_len + n > max) {
            char msg[128];
            snprintf(msg, sizeof msg, "request body exceeds the limit of %zu bytes", max);
            cut_locked(srv, rec, 413, "request_too_large", msg);
            pthread_mutex_unlock(&srv->mu);
            ds41_http_metrics_event(srv->router->metrics, DS41_HTTP_EV_TOO_LARGE);
            ex->status = 413;
            return MHD_NO;
        }
        pthread_mutex_unlock(&srv->mu);
        if (body_append(ex, upload_data, n) != 0) return MHD_NO;
        return MHD_YES;
    }

    /* request complete */
    if (ex->answered) return MHD_YES;
    struct conn_rec *rec = ex->rec;
    pthread_mutex_lock(&srv->mu);
    if (rec->cut) {
        pthread_mutex_unlock(&srv->mu);
        return MHD_NO;
    }
    bool late = rec->deadline_ms && now_ms() >= rec->deadline_ms;
    rec->deadline_ms = 0;
    pthread_mutex_unlock(&srv->mu);
    if (late) {
        ds41_http_metrics_event(srv->router->metrics, DS41_HTTP_EV_TIMEOUT);
        ds41_http_add_header(ex, "Connection", "close");
        ds41_http_respond_error(ex, 408, NULL, "request_timeout", NULL,
                                "the request was not received within the request timeout");
        return MHD_YES;
    }
    run_handler(ex);
    return ex->abandoned ? MHD_NO : MHD_YES;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)conn;
    struct listener_state *ls = cls;
    ds41_http_server *srv = ls->srv;
    ds41_http_exchange *ex = *con_cls;
    if (!ex) return;
    *con_cls = NULL;
    if (toe == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED)
        ds41_http_metrics_event(srv->router->metrics, DS41_HTTP_EV_TIMEOUT);
    ds41_http_metrics_request(srv->router->metrics, ex->route ? ex->route->name : NULL, ex->status);
    pthread_mutex_lock(&srv->mu);
    if (ex->counted_active) srv->active--;
    if (ex->rec && !ex->rec->cut)
        ex->rec->deadline_ms =
            now_ms() + (int64_t)srv->cfg.idle_timeout_s * 1000 + srv->cfg.request_timeout_ms;
    pthread_cond_broadcast(&srv->cond);
    pthread_mutex_unlock(&srv->mu);
    if (ex->counted_active) metrics_gauge(srv->router->metrics, GAUGE_ACTIVE, -1);
    exchange_free(ex);
}

static enum MHD_Result accept_policy(void *cls, const struct sockaddr *addr, socklen_t addrlen) {
    (void)addr;
    struct listener_state *ls = cls;
    /* MHD 0.9.75 copies addrlen bytes out of its sockaddr_in6-sized buffer;
     * refuse a (bound, long-named Unix) client whose address did not fit. */
    if (addrlen > (socklen_t)sizeof(struct sockaddr_in6)) {
        ds41_http_metrics_event(ls->srv->router->metrics, DS41_HTTP_EV_REFUSED_PEER);
        return MHD_NO;
    }
    return MHD_YES;
}

static void mhd_logger(void *cls, const char *fmt, va_list ap) {
    ds41_http_server *srv = cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    srv_log(srv, "%s", msg);
}

/* ================================================================ reaper */

static void *reaper_main(void *arg) {
    ds41_http_server *srv = arg;
    pthread_mutex_lock(&srv->mu);
    while (!srv->reaper_stop) {
        int64_t now = now_ms();
        int64_t next = now + 1000;
        for (struct conn_rec *r = srv->conns; r; r = r->next) {
            if (!r->deadline_ms || r->cut) continue;
            if (now >= r->deadline_ms) {
                cut_locked(srv, r, 408, "request_timeout",
                           "the request was not received within the request timeout");
                ds41_http_metrics_event(srv->router->metrics, DS41_HTTP_EV_TIMEOUT);
            } else if (r->deadline_ms < next) {
                next = r->deadline_ms;
            }
        }
        struct timespec ts = {.tv_sec = (time_t)(next / 1000), .tv_nsec = (long)(next % 1000) * 1000000};
        pthread_cond_timedwait(&srv->cond, &srv->mu, &ts);
    }
    pthread_mutex_unlock(&srv->mu);
    return NULL;
}

/* ============================================================ start / stop */

static void server_free(ds41_http_server *s) {
    for (size_t i = 0; i < s->n_ls; i++) {
        if (s->ls[i].daemon) MHD_stop_daemon(s->ls[i].daemon);
        if (s->ls[i].fd >= 0) close(s->ls[i].fd);
    }
    if (s->abort_fd >= 0) close(s->abort_fd);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static void stop_reaper(ds41_http_server *s) {
    if (!s->reaper_started) return;
    pthread_mutex_lock(&s->mu);
    s->reaper_stop = true;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->reaper, NULL);
    s->reaper_started = false;
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
    s->abort_fd = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cond, &ca);
    pthread_condattr_destroy(&ca);
    for (size_t i = 0; i < MAX_LISTENERS; i++) s->ls[i].fd = -1;

    s->abort_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->abort_fd < 0) {
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
        ls->daemon = MHD_start_daemon(
            MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | MHD_USE_ITC |
                MHD_USE_ERROR_LOG,
            0, accept_policy, ls, on_request, ls, MHD_OPTION_EXTERNAL_LOGGER, mhd_logger, s,
            MHD_OPTION_LISTEN_SOCKET, ls->fd, MHD_OPTION_CONNECTION_LIMIT, s->cfg.max_connections,
            MHD_OPTION_CONNECTION_TIMEOUT, s->cfg.idle_timeout_s, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
            (size_t)HEADER_MEMORY_LIMIT, MHD_OPTION_NOTIFY_COMPLETED, on_completed, ls,
            MHD_OPTION_NOTIFY_CONNECTION, on_connection, ls, MHD_OPTION_END);
        if (!ls->daemon) {
            ds41_fail(err, "http server: libmicrohttpd refused to start on fd %d", fd);
            goto fail;
        }
    }
    if (pthread_create(&s->reaper, NULL, reaper_main, s) != 0) {
        ds41_fail(err, "http server: cannot start the deadline thread");
        goto fail;
    }
    s->reaper_started = true;
    *out = s;
    return 0;
fail:
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
    for (size_t i = 0; i < s->n_ls; i++)
        if (s->ls[i].daemon) (void)MHD_quiesce_daemon(s->ls[i].daemon); /* fd closed after stop */
    pthread_mutex_lock(&s->mu);
    wait_idle_locked(s, now_ms() + drain_ms);
    unsigned aborted = s->active;
    if (aborted) {
        uint64_t one = 1;
        (void)!write(s->abort_fd, &one, sizeof one);
        wait_idle_locked(s, now_ms() + 5000);
    }
    pthread_mutex_unlock(&s->mu);
    stop_reaper(s);
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
