#include "config/error.h"

#include <stdio.h>
#include <string.h>

int ds41_vfail(ds41_error *err, const char *fmt, va_list ap) {
    if (err) vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    return -1;
}

int ds41_fail(ds41_error *err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ds41_vfail(err, fmt, ap);
    va_end(ap);
    return -1;
}

int ds41_error_prefix(ds41_error *err, const char *fmt, ...) {
    if (!err) return -1;
    char prefix[DS41_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    size_t plen = strlen(prefix);
    if (plen + 2 >= sizeof err->msg) {
        memcpy(err->msg, prefix, sizeof err->msg - 1);
        err->msg[sizeof err->msg - 1] = 0;
        return -1;
    }
    /* Shift the old message right (truncating its tail) and put the prefix in front. */
    size_t keep = strnlen(err->msg, sizeof err->msg - 1);
    if (keep > sizeof err->msg - 1 - plen - 2) keep = sizeof err->msg - 1 - plen - 2;
    memmove(err->msg + plen + 2, err->msg, keep);
    err->msg[plen + 2 + keep] = 0;
    memcpy(err->msg, prefix, plen);
    err->msg[plen] = ':';
    err->msg[plen + 1] = ' ';
    return -1;
}
