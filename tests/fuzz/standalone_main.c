/* Replay driver for fuzz targets without libFuzzer: feeds every file of the
 * given directories (or files) to LLVMFuzzerTestOneInput once, printing one
 * TAP case per input.  A crash or sanitizer report fails the test. */
#include "tests/tap.h"

#include <dirent.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    uint8_t *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            cap = cap ? cap * 2 : 4096;
            uint8_t *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return -1;
            }
            buf = nb;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        if (got == 0) break;
        len += got;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, len);
    free(buf);
    return 0;
}

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            TAP_CHECK(0, "corpus %s exists", argv[i]);
            continue;
        }
        if (!S_ISDIR(st.st_mode)) {
            TAP_CHECK(replay_file(argv[i]) == 0, "replay %s", argv[i]);
            continue;
        }
        DIR *d = opendir(argv[i]);
        char **names = NULL;
        size_t n = 0;
        struct dirent *de;
        while (d && (de = readdir(d))) {
            if (de->d_name[0] == '.') continue;
            char **nn = realloc(names, (n + 1) * sizeof *names);
            if (!nn) break;
            names = nn;
            names[n++] = strdup(de->d_name);
        }
        if (d) closedir(d);
        qsort(names, n, sizeof *names, cmp_names);
        for (size_t k = 0; k < n; k++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[i], names[k]);
            TAP_CHECK(replay_file(path) == 0, "replay %s", names[k]);
            free(names[k]);
        }
        free(names);
        TAP_CHECK(n > 0, "corpus %s is not empty", argv[i]);
    }
    return tap_done();
}
