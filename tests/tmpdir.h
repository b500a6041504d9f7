/* Removing the C tests' temporary directories: everything under a path,
 * files and directories, symlinks not followed (nftw(3), depth first). */
#ifndef DS41_TESTS_TMPDIR_H
#define DS41_TESTS_TMPDIR_H

#include <ftw.h>
#include <stdio.h>
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

#endif
