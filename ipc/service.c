#include "ipc/service.h"

#include "config/utf8.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int ds41_svc_fail(ds41_svc_error *err, ds41_svc_status status, const char *param, const char *fmt, ...) {
    if (!err) return -1;
    err->status = status;
    err->retry_after_s = 0;
    err->code[0] = 0;
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    ds41_svc_error_clip_utf8(err);
    return -1;
}

void ds41_svc_error_clip_utf8(ds41_svc_error *err) {
    err->param[ds41_utf8_valid_prefix(err->param, strlen(err->param))] = 0;
    err->message[ds41_utf8_valid_prefix(err->message, strlen(err->message))] = 0;
}

const char *ds41_svc_status_code(ds41_svc_status status) {
    switch (status) {
    case DS41_SVC_OK:
        return "ok";
    case DS41_SVC_BAD_REQUEST:
        return "invalid_value";
    case DS41_SVC_CONTEXT_LENGTH:
        return "context_length_exceeded";
    case DS41_SVC_FORBIDDEN:
        return "forbidden";
    case DS41_SVC_NOT_FOUND:
        return "not_found";
    case DS41_SVC_CONFLICT:
        return "conflict";
    case DS41_SVC_QUEUE_FULL:
        return "queue_full";
    case DS41_SVC_KV_FULL:
        return "kv_full";
    case DS41_SVC_UNAVAILABLE:
        return "unavailable";
    case DS41_SVC_CANCELLED:
        return "cancelled";
    case DS41_SVC_INTERNAL:
        return "internal_error";
    }
    return "internal_error";
}
