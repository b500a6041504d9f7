/* ds41_http: the HTTP/1.1 server under the API (our own, over the sockets
 * it is given; the request syntax is ipc/http_parser.h).
 *
 * Listening.  The server never creates sockets itself: it serves listening
 * fds it is given (a Unix socket the daemon created with ds41_listen_unix()
 * or received from systemd, and optionally a loopback TCP socket).  Each fd
 * gets its own accept thread; the caller keeps ownership of the fds (the
 * server works on duplicates, set non-blocking), so a socket passed by
 * systemd survives a restart of the server.
 *
 * Threads.  One thread per connection: it reads a request, runs the route
 * handler, writes the answer and, on a kept-alive connection, reads the next
 * (pipelined requests are answered in order).  A route handler may block --
 * a non-streaming completion waits for the service's terminal event with
 * ds41_http_wait(), an SSE stream's pump waits for the next event -- without
 * stalling other clients.  While blocked, the thread also polls the client
 * socket for POLLRDHUP/POLLHUP, so a client that disconnects is noticed at
 * once (not at the next write) and the service's cancel is called.
 * Generation events arrive on the service's threads and are handed over
 * through a ds41_http_stream (mutex + eventfd).  The cost is one thread per
 * open connection, bounded by max_connections; a local inference daemon
 * serves tens of clients, not tens of thousands.
 *
 * Protocol errors.  Every answer is exactly one HTTP/1.1 response with a
 * Content-Length (or, for a stream, chunked framing); every refusal carries
 * the error shape below as its body.  A request the server cannot read
 * safely is answered and the connection closed (Connection: close): bad
 * request line or header (400), HTTP/1.1 without Host (400), a Content-Length
 * that is not a plain decimal number below 2^63, or two different ones, or
 * one next to Transfer-Encoding (400), Transfer-Encoding other than chunked
 * (501), bad chunked framing (400), request-target over 8 KiB (414), request
 * line + headers over 64 KiB or 128 fields (431), a version other than
 * HTTP/1.0 and 1.1 (505).  The body's "code" names the case
 * (invalid_content_length, missing_host, invalid_header, malformed_request,
 * unsupported_transfer_encoding, invalid_chunked_encoding, uri_too_long,
 * header_too_large, http_version_not_supported, method_not_implemented).
 *
 * Authorization.  Each connection gets a class when accepted:
 *   - AF_UNIX peers: SO_PEERCRED gives pid/uid/gid; uid 0 -> ADMIN; a peer
 *     whose primary gid or any supplementary gid equals the configured admin
 *     gid -> ADMIN; everyone else who could connect -> INFERENCE (the socket's
 *     mode 0660 and group already decide who can connect at all).
 *     Supplementary groups come from SO_PEERGROUPS: the kernel's snapshot of
 *     the peer's credentials at connect(), exact and race-free.  getgrouplist()
 *     (the group database, not the process) would grant admin to a process
 *     that dropped the group and miss one that was given it without an
 *     /etc/group entry; /proc/PID/status races PID reuse and is hidden by
 *     ProtectProc=.  Only on kernels without SO_PEERGROUPS (< 4.13) the server
 *     falls back to getgrouplist() of the peer uid.
 *   - TCP peers have no credentials: they get the listener's credless_class,
 *     INFERENCE unless configured otherwise.
 * A route names the class it needs; a weaker peer gets 403 permission_error.
 *
 * Limits (each answered in the OpenAI error shape):
 *   - body larger than max_body_bytes: 413, sent before any of the body is
 *     read when Content-Length announces it (also answers "Expect:
 *     100-continue"); for chunked bodies at the moment the limit is crossed.
 *     The connection is closed after a 413.
 *   - request_timeout_ms: a client must deliver a complete request (headers
 *     and body) within this time of connecting or of the end of the previous
 *     response (+ idle_timeout_s on a kept-alive connection); a client that
 *     dribbles bytes makes progress but does not move this deadline.  On
 *     expiry the client gets 408 and the connection is closed.
 *   - idle_timeout_s: a connection that makes no progress for this long is
 *     closed (idle keep-alive, or a client that stops reading a response).
 *   - max_connections: a further connection is answered 503 (code
 *     too_many_connections, Retry-After: 1) without reading its request and
 *     closed (counted as refused_peer); while the server drains, 503
 *     shutting_down.
 *   - a stream whose client does not read while max_stream_buffer bytes pile
 *     up is cut off and its generation cancelled.
 *   - an answer given before the body was read (404, 405, 403, 413, 415)
 *     closes the connection: the unread body is not taken for a request.
 *   - a route with a body accepts Content-Type application/json, text/plain,
 *     application/x-www-form-urlencoded (what `curl -d` sends) or none; any
 *     other type is a 415.
 *   - a client that half-closes its socket (shutdown(SHUT_WR)) while its
 *     request runs is treated as gone, like one that closed it.
 *
 * Blocking service calls.  The drain deadline interrupts waits on the
 * service (ds41_http_wait) and streams, not a service function that is
 * itself slow to return (e.g. a tokenize call); stop waits for those to
 * return before it closes the last connections.
 *
 * Stopping.  ds41_http_server_stop() stops accepting (the listening fds stay
 * open in the caller's hands, so queued clients wait for the next instance),
 * answers new requests on open connections with 503 + Connection: close,
 * lets running requests and streams finish until the drain deadline, then
 * aborts what is left (streams end with an SSE error event, waiting handlers
 * answer 503, the service is asked to cancel) and closes everything. */
#ifndef DS41_IPC_HTTP_SERVER_H
#define DS41_IPC_HTTP_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "config/error.h"

/* ------------------------------------------------------------------ classes */

typedef enum ds41_auth_class {
    DS41_AUTH_INFERENCE = 1, /* inference routes */
    DS41_AUTH_ADMIN = 2,     /* inference + admin routes */
} ds41_auth_class;

typedef struct ds41_http_peer {
    bool has_creds; /* false for TCP and in-memory requests */
    pid_t pid;
    uid_t uid;
    gid_t gid;
} ds41_http_peer;

/* Class of a Unix-socket peer with these credentials (the rule above);
 * groups = its supplementary groups.  Exposed for tests. */
ds41_auth_class ds41_http_classify(uid_t uid, gid_t gid, const gid_t *groups, size_t n_groups,
                                   bool has_admin_gid, gid_t admin_gid);

/* --------------------------------------------------------------- exchanges */

/* One request being served.  Handed to a route handler, valid until the
 * handler returns (a stream given to ds41_http_respond_stream lives on). */
typedef struct ds41_http_exchange ds41_http_exchange;

/* A route handler.  Runs on the connection's own thread and may block.  It
 * must answer exactly once, with ds41_http_respond*() or
 * ds41_http_abandon(); returning without an answer sends a 500. */
typedef void (*ds41_http_handler)(ds41_http_exchange *ex, void *ctx);

typedef struct ds41_http_route {
    const char *method;       /* "GET", "POST", "DELETE"; GET routes also answer HEAD */
    const char *path;         /* exact path, or a prefix ending in "/" followed by '*',
                                 matching the prefix plus one non-empty segment of
                                 [A-Za-z0-9._:-] (ds41_http_path_param) */
    ds41_auth_class required; /* weakest class allowed */
    bool has_body;            /* POST-like: Content-Type checked, body collected */
    const char *name;         /* metrics label, e.g. "chat_completions" */
    ds41_http_handler handler;
} ds41_http_route;

/* Route table and the context its handlers get.  Routes are matched in
 * order; no path match -> 404, path match with another method -> 405 with
 * Allow. */
typedef struct ds41_http_router {
    const ds41_http_route *routes;
    size_t n_routes;
    void *ctx;
    size_t max_body_bytes;             /* 0 = 32 MiB */
    struct ds41_http_metrics *metrics; /* may be NULL */
} ds41_http_router;

const char *ds41_http_method(const ds41_http_exchange *ex);
const char *ds41_http_path(const ds41_http_exchange *ex);
/* The segment matched by a trailing "*" of the route, else NULL. */
const char *ds41_http_path_param(const ds41_http_exchange *ex);
/* The request body, NUL-terminated (the NUL is not counted); never NULL. */
const char *ds41_http_body(const ds41_http_exchange *ex, size_t *len);
ds41_auth_class ds41_http_auth(const ds41_http_exchange *ex);
const ds41_http_peer *ds41_http_peer_info(const ds41_http_exchange *ex);

/* Add a response header (e.g. Retry-After, Allow) for the answer still to
 * come.  At most 8; name and value are copied (value up to 255 bytes).
 * Returns 0, or -1 when the table is full or the value has CR/LF. */
int ds41_http_add_header(ds41_http_exchange *ex, const char *name, const char *value);

/* Answer with a complete body (copied).  content_type NULL = application/json.
 * Returns 0, -1 if already answered. */
int ds41_http_respond(ds41_http_exchange *ex, int status, const char *content_type, const void *body,
                      size_t len);

/* Answer with the OpenAI error shape
 *   {"error":{"message":...,"type":...,"param":...|null,"code":...|null}}
 * type NULL = derived from status (400/405/408/409/413/415 invalid_request_error,
 * 401 authentication_error, 403 permission_error, 404 not_found_error,
 * 429 rate_limit_error, 5xx server_error); code/param NULL or "" = null. */
int ds41_http_respond_error(ds41_http_exchange *ex, int status, const char *type, const char *code,
                            const char *param, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* The error shape as a malloc()ed JSON text (*len set when len != NULL);
 * NULL only when out of memory.  Used for SSE error events too. */
char *ds41_http_error_json(int status, const char *type, const char *code, const char *param,
                           const char *message, size_t *len);

/* Close the connection without an answer (the client is gone). */
void ds41_http_abandon(ds41_http_exchange *ex);

/* ------------------------------------------------------------------ signals */

/* A one-shot-or-more wakeup a service thread raises and a handler waits for. */
typedef struct ds41_http_signal {
    int fd; /* eventfd */
} ds41_http_signal;

int ds41_http_signal_init(ds41_http_signal *sig, ds41_error *err);
void ds41_http_signal_raise(ds41_http_signal *sig); /* any thread */
void ds41_http_signal_destroy(ds41_http_signal *sig);

typedef enum ds41_http_wait_result {
    DS41_HTTP_WAIT_SIGNALLED = 0,
    DS41_HTTP_WAIT_TIMEOUT,
    DS41_HTTP_WAIT_CLIENT_GONE, /* the client closed its end: cancel the work, ds41_http_abandon() */
    DS41_HTTP_WAIT_STOPPING,    /* the drain deadline passed: cancel, answer 503 */
} ds41_http_wait_result;

/* Block until sig is raised (consuming it), the client disconnects, the
 * server's drain deadline passes, or timeout_ms elapses (-1 = no timeout). */
ds41_http_wait_result ds41_http_wait(ds41_http_exchange *ex, ds41_http_signal *sig, int timeout_ms);

/* ------------------------------------------------------------------ streams */

/* A byte stream from a producer (any thread) to the client (an SSE body).
 * Reference counted: the producer holds one reference from _new until _end;
 * ds41_http_respond_stream takes one for the connection.  on_abandon(ctx)
 * is called exactly once, from the connection's thread, when the
 * connection lets go of the stream before the producer ended it (client
 * gone, stalled, server stopping); ctx_free(ctx) runs when the last
 * reference goes.  Either callback may be NULL. */
typedef struct ds41_http_stream ds41_http_stream;

ds41_http_stream *ds41_http_stream_new(void (*on_abandon)(void *ctx), void *ctx, void (*ctx_free)(void *ctx));

/* Append bytes (copied; thread-safe; each write is flushed to the client as
 * soon as the connection's thread wakes).  Returns 0, or -1 when the client
 * is gone or stalled (the bytes are dropped; keep calling _end). */
int ds41_http_stream_write(ds41_http_stream *s, const void *data, size_t len);

/* The producer is done: the client gets what was written, then the end of
 * the body.  Drops the producer's reference; s must not be used after. */
void ds41_http_stream_end(ds41_http_stream *s);

/* Answer with this stream as the body (Transfer-Encoding: chunked;
 * Cache-Control: no-cache).  content_type NULL = text/event-stream.  The
 * connection sends ": keep-alive" SSE comments while the producer is quiet,
 * and on server stop writes `stop_event` (a complete SSE event the route
 * handler supplies, may be NULL) before ending the body.  Returns 0, or -1
 * if already answered (the reference is not taken). */
int ds41_http_respond_stream(ds41_http_exchange *ex, int status, const char *content_type,
                             ds41_http_stream *s, const char *stop_event);

/* ------------------------------------------------------------------ metrics */

/* Counters kept by the server: requests by route and status, refusals by
 * reason, open connections, active requests.  Thread-safe. */
typedef struct ds41_http_metrics ds41_http_metrics;

ds41_http_metrics *ds41_http_metrics_new(void);
void ds41_http_metrics_free(ds41_http_metrics *m);
/* Prometheus text exposition of the counters, malloc()ed; NULL if out of memory. */
char *ds41_http_metrics_render(ds41_http_metrics *m, size_t *len);

typedef enum ds41_http_event {
    DS41_HTTP_EV_CLIENT_GONE = 0, /* a waiting handler or stream lost its client */
    DS41_HTTP_EV_TIMEOUT,         /* request deadline cut a slow client */
    DS41_HTTP_EV_TOO_LARGE,       /* body over the limit */
    DS41_HTTP_EV_STALLED,         /* stream client stopped reading */
    DS41_HTTP_EV_REFUSED_PEER,    /* connection refused: max_connections reached or stopping */
    DS41_HTTP_EV_COUNT
} ds41_http_event;

void ds41_http_metrics_event(ds41_http_metrics *m, ds41_http_event ev);
void ds41_http_metrics_request(ds41_http_metrics *m, const char *route, int status);

/* ------------------------------------------------------------------- server */

typedef struct ds41_http_listener {
    int fd;                         /* bound, listening socket (AF_UNIX, AF_INET, AF_INET6) */
    ds41_auth_class credless_class; /* class of peers without SO_PEERCRED (TCP); 0 = INFERENCE */
} ds41_http_listener;

typedef struct ds41_http_config {
    const ds41_http_listener *listeners;
    size_t n_listeners; /* 1..8 */
    bool has_admin_gid;
    gid_t admin_gid;
    unsigned max_connections;    /* per listener; 0 = 256 */
    unsigned request_timeout_ms; /* 0 = 30000 */
    unsigned idle_timeout_s;     /* 0 = 60 */
    unsigned sse_keepalive_ms;   /* 0 = 15000 */
    size_t max_stream_buffer;    /* 0 = 8 MiB */
    /* the server's diagnostics (accept failures); NULL = stderr with "ds41 http: " */
    void (*log)(void *log_ctx, const char *message);
    void *log_ctx;
} ds41_http_config;

typedef struct ds41_http_server ds41_http_server;

/* Start serving.  router (and what it points to) must outlive the server.
 * Errors: a listener fd that is not a listening stream socket, a thread
 * that cannot start, out of memory.  Returns 0 / -1. */
int ds41_http_server_start(const ds41_http_config *cfg, const ds41_http_router *router,
                           ds41_http_server **out, ds41_error *err);

/* Graceful stop (see above), then free everything.  drain_ms bounds the wait
 * for running requests.  Returns the number of requests that were still
 * running at the deadline and got aborted.  s may be NULL. */
unsigned ds41_http_server_stop(ds41_http_server *s, unsigned drain_ms);

/* Open connections and running requests right now. */
unsigned ds41_http_server_connections(ds41_http_server *s);
unsigned ds41_http_server_active_requests(ds41_http_server *s);

/* ------------------------------------------------------ in-memory dispatch */

/* Serve one request without sockets: same routing, limits and handlers, the
 * answer captured in memory.  For tests and fuzzing.  A streamed answer is
 * collected until the producer ends it or timeout_ms passes (then the
 * stream is abandoned: its on_abandon runs, timed_out is set). */
typedef struct ds41_http_memory_response {
    int status;         /* 0 = abandoned without answer */
    char *content_type; /* malloc()ed or NULL */
    char *headers;      /* extra headers as "Name: value\n" lines, malloc()ed or NULL */
    char *body;         /* malloc()ed, NUL-terminated (not counted) */
    size_t body_len;
    bool streamed;
    bool timed_out;
} ds41_http_memory_response;

int ds41_http_dispatch_memory(const ds41_http_router *router, const char *method, const char *path,
                              ds41_auth_class auth, const char *content_type, const void *body,
                              size_t body_len, int timeout_ms, ds41_http_memory_response *out,
                              ds41_error *err);
void ds41_http_memory_response_free(ds41_http_memory_response *r);

#endif
