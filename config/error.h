/* ds41_error: how every fallible function in ds41 reports what went wrong.
 *
 * Functions return 0 on success and -1 on failure; on failure they fill the
 * caller's ds41_error (when it is not NULL) with one human-readable sentence
 * that names the file, tensor, key or field at fault.  Messages are built
 * innermost first and callers may prepend context with ds41_error_prefix(),
 * e.g. "model-00002-of-00002.safetensors: tensor 'layers.0.attn.wq_a.weight':
 * data_offsets [10,20) exceed the file (15 bytes)". */
#ifndef DS41_CONFIG_ERROR_H
#define DS41_CONFIG_ERROR_H

#include <stdarg.h>

#define DS41_ERROR_MAX 1024

typedef struct ds41_error {
    char msg[DS41_ERROR_MAX];
} ds41_error;

/* Format a message into err (if not NULL).  Always returns -1 so a function
 * can write `return ds41_fail(err, "...", ...);`. */
int ds41_fail(ds41_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int ds41_vfail(ds41_error *err, const char *fmt, va_list ap);

/* Prepend "prefix: " to the message already in err (if not NULL).  Returns -1. */
int ds41_error_prefix(ds41_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
