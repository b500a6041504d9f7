/* What ipc/http_server.c and ipc/http_metrics.c share (not a public contract). */
#ifndef DS41_IPC_HTTP_INTERNAL_H
#define DS41_IPC_HTTP_INTERNAL_H

#include "ipc/http_server.h"

enum ds41_http_gauge { GAUGE_CONNECTIONS, GAUGE_ACTIVE };

/* Moves a gauge by delta (m may be NULL). */
void ds41_http_metrics_gauge(ds41_http_metrics *m, enum ds41_http_gauge which, int delta);

#endif
