/* The HTTP server's Prometheus counters (see http_server.h, "metrics"): requests by route and
 * status, refused/cut connections by reason, open connections and active requests. */
#include "ipc/http_server.h"

#include "config/buf.h"
#include "ipc/http_internal.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

void ds41_http_metrics_gauge(ds41_http_metrics *m, enum ds41_http_gauge which, int delta) {
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
