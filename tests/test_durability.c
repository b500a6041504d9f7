/* The durability steps of a snapshot save, in order (issue 19): the
 * temporary file's bytes are fsync'ed before it is renamed over the final
 * name, and the directory is fsync'ed after the rename.  A missing step is
 * invisible to every functional test (the bytes are there until power is
 * lost), so this program interposes fsync(2) and rename(2) -- its own
 * definitions take precedence over libc's for the static ds41 library -- and
 * records what was synced and when. */
#include "storage/snapshot.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* the cache partition the snapshots of this test belong to (any fixed one) */
static const ds41_snapshot_owner SNAP_OWNER = {.key = {0x5a, 1}, .uid = 1000};

enum ev_kind { EV_FSYNC_FILE, EV_FSYNC_DIR, EV_RENAME };
static enum ev_kind events[32];
static int n_events;
static int recording;

static void record(enum ev_kind k) {
    if (recording && n_events < 32) events[n_events++] = k;
}

int fsync(int fd) {
    struct stat st;
    if (fstat(fd, &st) == 0) record(S_ISDIR(st.st_mode) ? EV_FSYNC_DIR : EV_FSYNC_FILE);
    return (int)syscall(SYS_fsync, fd);
}

int rename(const char *from, const char *to) {
    record(EV_RENAME);
    return (int)syscall(SYS_renameat, AT_FDCWD, from, AT_FDCWD, to);
}

static int index_of(enum ev_kind k, int from) {
    for (int i = from; i < n_events; i++)
        if (events[i] == k) return i;
    return -1;
}

int main(void) {
    char dir[200];
    if (!tmpdir_make(dir, sizeof dir, "TMPDIR", "ds41-durable-XXXXXX")) {
        TAP_CHECK(0, "temporary directory");
        return tap_done();
    }
    char path[256];
    snprintf(path, sizeof path, "%s/s.snap", dir);
    const uint8_t model[DS41_SNAPSHOT_ID_BYTES] = {1, 2, 3};
    const int32_t ids[3] = {5, 6, 7};
    const uint8_t kv[64] = {9};
    ds41_error err = {{0}};
    recording = 1;
    const int rc =
        ds41_snapshot_write(path, model, &SNAP_OWNER, ids, 3, kv, sizeof kv, NULL, 0, NULL, NULL, &err);
    recording = 0;
    TAP_CHECK(rc == 0, "snapshot written%s%s", rc ? ": " : "", rc ? err.msg : "");
    const int f = index_of(EV_FSYNC_FILE, 0), r = index_of(EV_RENAME, 0),
              d = r >= 0 ? index_of(EV_FSYNC_DIR, r) : -1;
    TAP_CHECK(f >= 0 && r > f, "the temporary file is fsync'ed before the rename (fsync at %d, rename at %d)",
              f, r);
    TAP_CHECK(d > r, "the directory is fsync'ed after the rename (at %d)", d);
    struct stat st;
    TAP_CHECK(stat(path, &st) == 0 && st.st_size > 0, "the snapshot is under its final name");
    tmpdir_remove(dir);
    return tap_done();
}
