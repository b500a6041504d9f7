/* The C tests' temporary directories: made under the directory an
 * environment variable names (or /tmp), and removed with everything under
 * them, files and directories, symlinks not followed (nftw(3), depth first). */
#ifndef DS41_TESTS_TMPDIR_H
#define DS41_TESTS_TMPDIR_H

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

static inline int tmpdir_rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static inline void tmpdir_remove(const char *path) {
    nftw(path, tmpdir_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* mkdtemp of "$ENV/TEMPLATE" (TEMPLATE ends in XXXXXX; /tmp when the
 * variable is unset or empty) into buf: buf, or NULL when it fails. */
static inline char *tmpdir_make(char *buf, size_t size, const char *env, const char *template_name) {
    const char *base = getenv(env);
    if (snprintf(buf, size, "%s/%s", base && *base ? base : "/tmp", template_name) >= (int)size) return NULL;
    return mkdtemp(buf);
}

#endif
