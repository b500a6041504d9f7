/* Minimal TAP producer for ds41's C tests.
 *
 * Each test program prints one "ok N - what" / "not ok N - what" line per
 * test case and a closing plan "1..N"; meson runs them with protocol 'tap' and
 * .ci/count-tests counts the lines.  A case is one behaviour worth naming:
 * loops over many inputs report once (with the first failing input in the
 * message), so the case count stays meaningful.
 *
 * Usage:
 *     TAP_CHECK(x == 3, "parses three");
 *     TAP_CHECKF(cond, "code 0x%02x round-trips", c);
 *     return tap_done();
 */
#ifndef DS41_TESTS_TAP_H
#define DS41_TESTS_TAP_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

static int tap_count;
static int tap_failed;

__attribute__((format(printf, 4, 5), unused)) static int tap_check(int ok, const char *file, int line,
                                                                   const char *fmt, ...) {
    va_list ap;
    char what[4096];
    tap_count++;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    /* one case is one line: a description that quotes a log line or a reply must not break the
     * TAP stream (meson reads a stray line as unknown output) */
    for (char *c = what; *c; c++)
        if (*c == '\n' || *c == '\r') *c = ' ';
    printf("%sok %d - %s", ok ? "" : "not ", tap_count, what);
    if (!ok) {
        printf(" # at %s:%d", file, line);
        tap_failed++;
    }
    printf("\n");
    fflush(stdout);
    return ok;
}

#define TAP_CHECK(cond, ...) tap_check(!!(cond), __FILE__, __LINE__, __VA_ARGS__)

/* A diagnostic line (ignored by TAP consumers). */
#define TAP_NOTE(...)                                                                              \
    do {                                                                                           \
        printf("# ");                                                                              \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
    } while (0)

/* Skip one case with a reason (counts as passed by TAP). */
#define TAP_SKIP(...)                                                                              \
    do {                                                                                           \
        tap_count++;                                                                               \
        printf("ok %d - skipped # SKIP ", tap_count);                                              \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
    } while (0)

__attribute__((unused)) static int tap_done(void) {
    printf("1..%d\n", tap_count);
    return tap_failed ? 1 : 0;
}

#endif
