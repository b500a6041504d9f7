/* ds41ctl's HTTP/1.1 client over ds41d's Unix socket: one request per connection
 * (Connection: close), Content-Length or chunked response bodies, and server-sent events read
 * as they arrive.  Small on purpose: it only has to talk to ds41d. */
#ifndef DS41_DAEMON_CTL_CLIENT_H
#define DS41_DAEMON_CTL_CLIENT_H

#include "config/error.h"

#include <stdbool.h>
#include <stddef.h>

typedef struct ds41_ctl_response {
    int status;      /* HTTP status */
    char *body;      /* NUL-terminated (malloc'd) */
    size_t body_len;
    char retry_after[16]; /* the Retry-After header, "" when none */
} ds41_ctl_response;

void ds41_ctl_response_free(ds41_ctl_response *r);

/* One request (body may be NULL) to `socket_path`.  Fails (-1, err) when the socket cannot be
 * reached ("cannot reach ds41d at PATH: ... (is it running?)", "permission denied ... group"),
 * on a malformed answer, or after timeout_ms without progress (0 = none). */
int ds41_ctl_request(const char *socket_path, const char *method, const char *path, const char *body,
                     size_t body_len, int timeout_ms, ds41_ctl_response *out, ds41_error *err);

/* A streamed request: the status line and headers are read, then on_event(ctx, data, len) is
 * called with the payload of every SSE "data: ..." event as it arrives (without "data: ", NUL
 * terminated); return false from it to stop early.  A non-2xx answer or a non-stream body is
 * returned whole in *out (status and body) without events.  *out->body is empty after a stream. */
int ds41_ctl_stream(const char *socket_path, const char *path, const char *body, size_t body_len,
                    bool (*on_event)(void *ctx, const char *data, size_t len), void *ctx, ds41_ctl_response *out,
                    ds41_error *err);

#endif
