/* Helpers shared by the C tests (header-only, like tap.h). */
#ifndef DS41_TESTS_TEST_UTIL_H
#define DS41_TESTS_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>

/* The whole file as a malloc'd NUL-terminated buffer (its length in *len when
 * len is not NULL), or NULL when it cannot be read.  Reads in a loop, so it
 * works for pipes and /proc files too. */
__attribute__((unused)) static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap + 1);
    while (b) {
        if (n == cap) {
            char *nb = realloc(b, cap * 2 + 1);
            if (!nb) {
                free(b);
                b = NULL;
                break;
            }
            b = nb;
            cap *= 2;
        }
        size_t got = fread(b + n, 1, cap - n, f);
        if (!got) break;
        n += got;
    }
    int failed = ferror(f);
    fclose(f);
    if (!b || failed) {
        free(b);
        return NULL;
    }
    b[n] = 0;
    if (len) *len = n;
    return b;
}

#endif
