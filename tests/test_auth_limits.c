/* Both sides of every security comparison of the HTTP layer (issue 19): the
 * peer classification (uid 0, the admin gid as primary or supplementary group,
 * gids and uids just below, at and just above it) and the request body limit
 * at exactly the limit and one byte past it, over the real server on a Unix
 * socket with the mock service.  The existing tests sat on one side only (a
 * socket gid below the admin gid, a body far over the limit), so `==` -> `>=`
 * on the admin gid and an off-by-one in the limit passed them.  Also the admin
 * API's length limits at exactly the limit and one past, and its control
 * character check at U+001F, through ds41_http_dispatch_memory(). */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/listen.h"
#include "ipc/api.h"
#include "ipc/http_server.h"
#include "tests/ipc_mock_service.h"
#include "tests/ipc_test_util.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#define ADMIN 45672u
#define LIMIT 4096

static const char *cls_name(ds41_auth_class c) {
    return c == DS41_AUTH_ADMIN ? "admin" : c == DS41_AUTH_INFERENCE ? "inference" : "other";
}

static void test_classify(void) {
    /* uid: 0 is admin whatever its groups; 1 and every other uid are not. */
    TAP_CHECK(ds41_http_classify(0, 100, NULL, 0, true, ADMIN) == DS41_AUTH_ADMIN &&
                  ds41_http_classify(0, 100, NULL, 0, false, ADMIN) == DS41_AUTH_ADMIN,
              "uid 0 is admin with or without an admin group");
    bool ok = true;
    uid_t bad_uid = 0;
    for (uid_t u = 1; u < 3 && ok; u++) {
        ok = ds41_http_classify(u, 100, NULL, 0, true, ADMIN) == DS41_AUTH_INFERENCE;
        if (!ok) bad_uid = u;
    }
    TAP_CHECK(ok, "uids 1 and 2 without the admin group are inference peers (first wrong: %u)",
              (unsigned)bad_uid);

    /* Primary gid: below, at and above the admin gid, and the extremes. */
    const gid_t gids[] = {0, 1, ADMIN - 2, ADMIN - 1, ADMIN, ADMIN + 1, ADMIN + 2, 65534, (gid_t)-2};
    for (size_t i = 0; i < sizeof gids / sizeof gids[0]; i++) {
        ds41_auth_class want = gids[i] == ADMIN ? DS41_AUTH_ADMIN : DS41_AUTH_INFERENCE;
        ds41_auth_class got = ds41_http_classify(1000, gids[i], NULL, 0, true, ADMIN);
        TAP_CHECK(got == want, "primary gid %u with admin gid %u: %s (got %s)", (unsigned)gids[i], ADMIN,
                  cls_name(want), cls_name(got));
    }
    /* Supplementary groups: the same gids as the only extra group. */
    for (size_t i = 0; i < sizeof gids / sizeof gids[0]; i++) {
        ds41_auth_class want = gids[i] == ADMIN ? DS41_AUTH_ADMIN : DS41_AUTH_INFERENCE;
        ds41_auth_class got = ds41_http_classify(1000, 100, &gids[i], 1, true, ADMIN);
        TAP_CHECK(got == want, "supplementary gid %u with admin gid %u: %s (got %s)", (unsigned)gids[i],
                  ADMIN, cls_name(want), cls_name(got));
    }
    const gid_t around[] = {ADMIN - 1, ADMIN + 1, ADMIN + 7};
    TAP_CHECK(ds41_http_classify(1000, ADMIN + 1, around, 3, true, ADMIN) == DS41_AUTH_INFERENCE,
              "groups on both sides of the admin gid, none equal: inference");
    const gid_t last[] = {ADMIN - 1, ADMIN + 1, ADMIN};
    TAP_CHECK(ds41_http_classify(1000, 100, last, 3, true, ADMIN) == DS41_AUTH_ADMIN,
              "the admin gid as the last of several supplementary groups: admin");
    TAP_CHECK(ds41_http_classify(1000, ADMIN, NULL, 0, false, ADMIN) == DS41_AUTH_INFERENCE &&
                  ds41_http_classify(1000, ADMIN + 1, NULL, 0, false, ADMIN) == DS41_AUTH_INFERENCE,
              "without a configured admin group no non-root peer is admin");
}

/* ---- the body limit over the socket ---------------------------------------------------------- */

static char sock_path[108];

/* chunked: the body as one chunk (Transfer-Encoding: chunked), so the limit is checked while
 * decoding instead of against Content-Length. */
static int status_of(size_t body_len, bool chunked) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock_path);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    /* A valid chat request padded with spaces (JSON whitespace) to body_len bytes. */
    const char *json = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    size_t jl = strlen(json);
    char *body = malloc(body_len + 1);
    memcpy(body, json, jl);
    memset(body + jl, ' ', body_len - jl);
    char head[256];
    int hl =
        chunked
            ? snprintf(head, sizeof head,
                       "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       "Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n%zx\r\n",
                       body_len)
            : snprintf(head, sizeof head,
                       "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       "Connection: close\r\nContent-Length: %zu\r\n\r\n",
                       body_len);
    int status = -1;
    if (write(fd, head, (size_t)hl) == hl) {
        /* The server may answer 413 before reading the body: ignore a failed write then. */
        size_t off = 0;
        while (off < body_len) {
            ssize_t w = send(fd, body + off, body_len - off, MSG_NOSIGNAL);
            if (w <= 0) break;
            off += (size_t)w;
        }
        if (chunked && off == body_len) (void)!send(fd, "\r\n0\r\n\r\n", 7, MSG_NOSIGNAL);
        char buf[64] = {0};
        size_t got = 0;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        while (got < 12 && poll(&p, 1, 10000) == 1) {
            ssize_t r = read(fd, buf + got, sizeof buf - 1 - got);
            if (r <= 0) break;
            got += (size_t)r;
        }
        if (got >= 12 && strncmp(buf, "HTTP/1.1 ", 9) == 0) status = atoi(buf + 9);
    }
    free(body);
    close(fd);
    return status;
}

/* The real server on a Unix socket in a temporary directory, over the mock service. */
typedef struct fixture {
    char dir[96]; /* + "/s" within sun_path */
    ds41_listener l;
    mock_service *mock;
    ds41_http_metrics *metrics;
    ds41_api *api;
    ds41_http_server *server;
} fixture;

static void fixture_stop(fixture *fx) {
    if (fx->server) ds41_http_server_stop(fx->server, 5000);
    ds41_listener_close(&fx->l);
    if (fx->dir[0]) tmpdir_remove(fx->dir);
    if (fx->api) ds41_api_free(fx->api);
    if (fx->mock) mock_service_free(fx->mock);
    if (fx->metrics) ds41_http_metrics_free(fx->metrics);
}

/* Starts it (the socket in sock_path); false after a failed check. */
static bool fixture_start(fixture *fx, unsigned max_connections) {
    *fx = (fixture){.l = {.fd = -1}};
    ds41_error err = {0};
    if (!tmpdir_make(fx->dir, sizeof fx->dir, "TMPDIR", "ds41-authlim-XXXXXX")) {
        fx->dir[0] = 0;
        TAP_CHECK(0, "mkdtemp: %s", strerror(errno));
        return false;
    }
    snprintf(sock_path, sizeof sock_path, "%s/s", fx->dir);
    fx->mock = mock_service_new(false);
    fx->metrics = ds41_http_metrics_new();
    ds41_api_options opts = {.max_body_bytes = LIMIT};
    if (ds41_listen_unix(sock_path, 0600, NULL, 16, &fx->l, &err) != 0 || !fx->mock || !fx->metrics ||
        ds41_api_new(mock_service_iface(fx->mock), fx->metrics, &opts, &fx->api, &err) != 0) {
        TAP_CHECK(0, "setup: %s", err.msg);
        fixture_stop(fx);
        return false;
    }
    ds41_http_listener ls[1] = {{.fd = fx->l.fd}};
    ds41_http_config cfg = {.listeners = ls,
                            .n_listeners = 1,
                            .max_connections = max_connections,
                            .request_timeout_ms = 10000,
                            .idle_timeout_s = 10,
                            .sse_keepalive_ms = 1000,
                            .max_stream_buffer = 256 << 10};
    if (ds41_http_server_start(&cfg, ds41_api_router(fx->api), &fx->server, &err) != 0) {
        TAP_CHECK(0, "server start: %s", err.msg);
        fixture_stop(fx);
        return false;
    }
    return true;
}

static int connect_sock(void) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock_path);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* What the server sends on fd until it closes, or until nothing came for wait_ms; with head_only,
 * only until the end of the first answer's head. */
static size_t read_all(int fd, char *buf, size_t cap, int wait_ms, bool head_only) {
    size_t got = 0;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    buf[0] = 0;
    while (got + 1 < cap && !(head_only && strstr(buf, "\r\n\r\n")) && poll(&p, 1, wait_ms) == 1) {
        ssize_t r = read(fd, buf + got, cap - 1 - got);
        if (r <= 0) break;
        got += (size_t)r;
        buf[got] = 0;
    }
    return got;
}

static void test_body_limit(void) {
    fixture fx;
    if (!fixture_start(&fx, 16)) return;
    int at = status_of(LIMIT, false), below = status_of(LIMIT - 1, false), past = status_of(LIMIT + 1, false);
    TAP_CHECK(at == 200 && below == 200,
              "a body of exactly max_body_bytes (%d) and one byte less is served (%d, %d)", LIMIT, at, below);
    TAP_CHECK(past == 413, "a body one byte over max_body_bytes is refused with 413 (got %d)", past);
    at = status_of(LIMIT, true), past = status_of(LIMIT + 1, true);
    TAP_CHECK(at == 200 && past == 413,
              "chunked: a body of exactly max_body_bytes is served, one byte more refused with 413 (%d, %d)",
              at, past);
    /* Content-Length one over the limit is refused from the head alone: 413 instead of
     * "100 Continue", before any body byte is sent. */
    int fd = connect_sock();
    char first[32] = {0};
    if (fd >= 0) {
        char head[256];
        int hl =
            snprintf(head, sizeof head,
                     "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Expect: 100-continue\r\nContent-Length: %d\r\n\r\n",
                     LIMIT + 1);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (write(fd, head, (size_t)hl) == hl && poll(&p, 1, 10000) == 1 && read(fd, first, 12) < 0)
            first[0] = 0;
        close(fd);
    }
    TAP_CHECK(strncmp(first, "HTTP/1.1 413", 12) == 0,
              "Content-Length of max_body_bytes + 1 with Expect: 100-continue -> 413 at once (got '%.12s')",
              first);

    /* An answer given before the body was read ends the connection: the unread body (here a whole
     * request) is never taken for the next request. */
    static const char smuggled[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    char req[256], buf[4096];
    int rl =
        snprintf(req, sizeof req, "POST /no/such/route HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                 sizeof smuggled - 1, smuggled);
    fd = connect_sock();
    size_t got = 0;
    if (fd >= 0 && send(fd, req, (size_t)rl, MSG_NOSIGNAL) == rl)
        got = read_all(fd, buf, sizeof buf, 3000, false);
    if (fd >= 0) close(fd);
    int answers = 0;
    for (const char *q = got ? buf : ""; (q = strstr(q, "HTTP/1.1 ")) != NULL; q++) answers++;
    TAP_CHECK(
        got && strncmp(buf, "HTTP/1.1 404", 12) == 0 && answers == 1,
        "a 404 before the body was read: one answer, then the connection ends (the body is not a request; "
        "%d answers)",
        answers);
    fixture_stop(&fx);
}

/* max_connections at exactly the limit and one past: two open connections are both served, a third
 * is answered 503 and closed while they stay open. */
static void test_connection_limit(void) {
    fixture fx;
    if (!fixture_start(&fx, 2)) return;
    static const char get[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    int fds[3] = {-1, -1, -1};
    bool served[3] = {false, false, false};
    char buf[4096], third[4096] = "";
    for (int i = 0; i < 3; i++) {
        fds[i] = connect_sock();
        if (fds[i] < 0) continue;
        /* MSG_NOSIGNAL: the refused one may already be closed; its answer is read all the same */
        (void)!send(fds[i], get, sizeof get - 1, MSG_NOSIGNAL);
        /* keep-alive: the answer comes, the connection stays; the refused one's ends at close */
        size_t got = read_all(fds[i], buf, sizeof buf - 1, i < 2 ? 10000 : 3000, i < 2);
        buf[got] = 0;
        served[i] = got >= 12 && strncmp(buf, "HTTP/1.1 200", 12) == 0;
        if (i == 2) memcpy(third, buf, got + 1);
    }
    TAP_CHECK(served[0] && served[1], "max_connections 2: two open connections are both served");
    const char *body = strstr(third, "\r\n\r\n");
    json_t *j = body ? json_loads(body + 4, 0, NULL) : NULL;
    TAP_CHECK(!served[2] && strncmp(third, "HTTP/1.1 503", 12) == 0 && strstr(third, "\r\nRetry-After: 1\r\n") &&
                  is_error_shape(j, "server_error", "too_many_connections", NULL),
              "max_connections 2: a third connection while both are open is answered 503 too_many_connections "
              "with Retry-After, then closed (got '%.12s')",
              third);
    json_decref(j);
    for (int i = 0; i < 3; i++)
        if (fds[i] >= 0) close(fds[i]);
    fixture_stop(&fx);
}

/* Status of an admin POST through the router in memory; 400 answers must name `param`. */
static int admin_post(ds41_api *api, const char *path, const char *body, const char *param) {
    ds41_http_memory_response r = {0};
    ds41_error err = {0};
    if (ds41_http_dispatch_memory(ds41_api_router(api), "POST", path, DS41_AUTH_ADMIN, "application/json",
                                  body, strlen(body), 5000, &r, &err) != 0)
        return -1;
    int status = r.status;
    if (status == 400) {
        json_t *j = r.body ? json_loadb(r.body, r.body_len, 0, NULL) : NULL;
        if (!is_error_shape(j, "invalid_request_error", NULL, param)) status = -400;
        json_decref(j);
    }
    ds41_http_memory_response_free(&r);
    return status;
}

/* {"KEY": "<prefix><n - strlen(prefix) times c>"} */
static char *body_of(const char *key, const char *prefix, size_t n, char c) {
    char *v = malloc(n + 1);
    size_t pl = strlen(prefix);
    memcpy(v, prefix, pl);
    memset(v + pl, c, n - pl);
    v[n] = 0;
    char *b = malloc(n + 64);
    snprintf(b, n + 64, "{\"%s\":\"%s\"}", key, v);
    free(v);
    return b;
}

/* An API over the mock service with one hook replaced by `patch` (may be NULL); *mock and
 * *api are NULL (and a failed check reported) when setup fails. */
static ds41_api *api_over_mock(mock_service **mock, void (*patch)(ds41_service *svc)) {
    ds41_api_options opts = {.max_body_bytes = 65536};
    ds41_api *api = NULL;
    ds41_error err = {0};
    *mock = mock_service_new(false);
    ds41_service svc = {0};
    if (*mock) {
        svc = *mock_service_iface(*mock);
        if (patch) patch(&svc);
    }
    if (!*mock || ds41_api_new(&svc, NULL, &opts, &api, &err) != 0) {
        TAP_CHECK(0, "api setup: %s", err.msg);
        mock_service_free(*mock);
        *mock = NULL;
        return NULL;
    }
    return api;
}

/* A service that forwards to the mock but reports every logprob as -9999.25 (and the
 * alternatives as -9999.75): just below OpenAI's floor of -9999, where the API must clamp. */
static ds41_service mock_svc;
static ds41_gen_sink inner_sink;

static void low_event(void *ctx, const ds41_gen_event *ev) {
    (void)ctx;
    ds41_gen_event e = *ev;
    ds41_gen_logprob lp[4];
    ds41_gen_top_logprob tops[4][20];
    if (ev->n_logprobs && ev->n_logprobs <= 4) {
        for (size_t i = 0; i < ev->n_logprobs; i++) {
            lp[i] = ev->logprobs[i];
            lp[i].logprob = -9999.25;
            size_t nt = lp[i].n_top < 20 ? lp[i].n_top : 20;
            for (size_t k = 0; k < nt; k++) {
                tops[i][k] = ev->logprobs[i].top[k];
                tops[i][k].logprob = -9999.75;
            }
            lp[i].top = tops[i];
            lp[i].n_top = nt;
        }
        e.logprobs = lp;
    }
    inner_sink.event(inner_sink.sink_ctx, &e);
}

static int low_submit(void *ctx, const ds41_gen_request *req, const ds41_gen_sink *sink,
                      ds41_gen_accept *accept, ds41_svc_error *err) {
    inner_sink = *sink;
    ds41_gen_sink mine = {.event = low_event, .sink_ctx = NULL};
    return mock_svc.submit(ctx, req, &mine, accept, err);
}

static void low_patch(ds41_service *svc) {
    mock_svc = *svc;
    svc->submit = low_submit;
}

static void test_logprob_floor(void) {
    mock_service *mock;
    ds41_api *api = api_over_mock(&mock, low_patch);
    if (!api) return;
    ds41_error err = {0};
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"logprobs\":true,"
                       "\"top_logprobs\":2}";
    ds41_http_memory_response r = {0};
    double lp = 0, top = 0;
    if (ds41_http_dispatch_memory(ds41_api_router(api), "POST", "/v1/chat/completions", DS41_AUTH_INFERENCE,
                                  "application/json", body, strlen(body), 5000, &r, &err) == 0 &&
        r.status == 200) {
        json_t *j = r.body ? json_loadb(r.body, r.body_len, 0, NULL) : NULL;
        json_t *c0 = json_array_get(
            json_object_get(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"),
                            "content"),
            0);
        lp = json_number_value(json_object_get(c0, "logprob"));
        top = json_number_value(
            json_object_get(json_array_get(json_object_get(c0, "top_logprobs"), 0), "logprob"));
        json_decref(j);
    }
    ds41_http_memory_response_free(&r);
    TAP_CHECK(lp == -9999.0 && top == -9999.0,
              "logprobs just below -9999 (-9999.25, -9999.75) are shown as -9999 (got %g, %g)", lp, top);
    ds41_api_free(api);
    mock_service_free(mock);
}

/* The mock has no snapshots: an unknown id is all the limit checks need behind them. */
static int no_snapshot(void *ctx, const char *snapshot_id, char *session_id, size_t session_id_size,
                       uint64_t *tokens, ds41_svc_error *err) {
    (void)ctx;
    (void)session_id;
    (void)session_id_size;
    (void)tokens;
    return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "id", "no snapshot '%.20s'", snapshot_id);
}

static void snapshot_patch(ds41_service *svc) {
    svc->restore_snapshot = no_snapshot;
}

static void test_api_limits(void) {
    mock_service *mock;
    ds41_api *api = api_over_mock(&mock, snapshot_patch);
    if (!api) return;
    /* A model path of 4095 bytes fits PATH_MAX with its NUL; 4096 does not. */
    char *p4095 = body_of("path", "/models/", 4095, 'a'), *p4096 = body_of("path", "/models/", 4096, 'a');
    const int s4095 = admin_post(api, "/admin/models/load", p4095, "path"),
              s4096 = admin_post(api, "/admin/models/load", p4096, "path");
    TAP_CHECK(s4095 != 400 && s4095 != -400 && s4096 == 400,
              "model load: a 4095-byte path passes the API's check (%d), 4096 bytes -> 400 naming path (%d)",
              s4095, s4096);
    free(p4095);
    free(p4096);
    /* Control characters: U+001F is one, U+0020 is not. */
    const int c1f = admin_post(api, "/admin/models/load", "{\"path\":\"/models/a\\u001fb\"}", "path"),
              c20 = admin_post(api, "/admin/models/load", "{\"path\":\"/models/a b\"}", "path");
    TAP_CHECK(c1f == 400 && c20 != 400 && c20 != -400,
              "model load: a path with U+001F -> 400 (%d), with a space it passes the check (%d)", c1f, c20);
    /* Model names: 1..256 bytes. */
    char *n256 = body_of("name", "", 256, 'm'), *n257 = body_of("name", "", 257, 'm');
    const int s256 = admin_post(api, "/admin/models/load", n256, "name"),
              s257 = admin_post(api, "/admin/models/load", n257, "name");
    TAP_CHECK(s256 != 400 && s256 != -400 && s257 == 400,
              "model load: a 256-byte name passes the API's check (%d), 257 bytes -> 400 naming name (%d)",
              s256, s257);
    free(n256);
    free(n257);
    /* Snapshot ids: 1..200 bytes. */
    char *i200 = body_of("id", "", 200, 'f'), *i201 = body_of("id", "", 201, 'f');
    const int e0 = admin_post(api, "/admin/snapshots/restore", "{\"id\":\"\"}", "id"),
              s200 = admin_post(api, "/admin/snapshots/restore", i200, "id"),
              s201 = admin_post(api, "/admin/snapshots/restore", i201, "id");
    TAP_CHECK(e0 == 400 && s200 != 400 && s200 != -400 && s201 == 400,
              "snapshot restore: an empty id -> 400 (%d), 200 bytes pass the check (%d), 201 -> 400 (%d)", e0,
              s200, s201);
    free(i200);
    free(i201);
    ds41_api_free(api);
    mock_service_free(mock);
}

int main(void) {
    test_classify();
    test_api_limits();
    test_logprob_floor();
    test_body_limit();
    test_connection_limit();
    return tap_done();
}
