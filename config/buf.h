/* ds41_buf: a growable NUL-terminated byte buffer, the one string builder of
 * every layer (JSON writers, HTTP bodies, SSE events, generated files). */
#ifndef DS41_CONFIG_BUF_H
#define DS41_CONFIG_BUF_H

#include <stdbool.h>
#include <stddef.h>

/* A NUL-terminated byte buffer.  Zero-initialise it ({0}).  Appends never fail loudly: on
 * allocation failure `oom` is set, later appends are ignored, and ds41_buf_take returns NULL,
 * so a writer checks once at the end. */
typedef struct ds41_buf {
    char *data;
    size_t len;
    size_t cap;
    bool oom;
} ds41_buf;

void ds41_buf_put(ds41_buf *b, const void *bytes, size_t n);
void ds41_buf_puts(ds41_buf *b, const char *s);
void ds41_buf_putc(ds41_buf *b, char c);
void ds41_buf_printf(ds41_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Hands the bytes over: returns the NUL-terminated heap string (free()) and its length in *len
 * (may be NULL), leaving b empty.  Returns NULL (and frees) if an append failed. */
char *ds41_buf_take(ds41_buf *b, size_t *len);
void ds41_buf_free(ds41_buf *b);

#endif
