/* storage/map_guard: a file mapping whose file is truncated under it.
 *
 * Guarded ranges: a touch past the new end (main thread, another thread, a
 * memcpy across the end) does not kill the process, reads zeros, and records
 * the first lost offset; other ranges and pages before the fault stay
 * intact.  Unguarded faults still kill (child processes: an unregistered or
 * unregistered-again range, a SIGBUS sent with kill, a SIGSEGV), and a
 * handler installed before ours is chained to.  The checkpoint level:
 * ds41_checkpoint_check_mappings names the shard file and the offset, and a
 * reopened checkpoint is intact again.  The engine: a forward step during
 * which a shard was cut fails naming the shard, every later step fails at
 * once, and the model loaded again after the file is restored gives the
 * same logits as before the fault.
 *
 * Files live in a mkdtemp directory under $TMPDIR (or /tmp), removed at the
 * end. */
#include "engine/forward/forward.h"
#include "engine/model/model_gen.h"
#include "storage/map_guard.h"
#include "storage/safetensors.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char root[PATH_MAX];
static size_t ps; /* page size */

static uint8_t pat(size_t i) {
    return (uint8_t)(i * 131u + 7u) | 1u; /* never 0 */
}

/* A file of n bytes of pat() under root, mapped read-only MAP_SHARED; its
 * descriptor in *fd.  NULL on failure. */
static uint8_t *map_file(const char *name, size_t n, int *fd) {
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/%s", root, name);
    *fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (*fd < 0) return NULL;
    uint8_t *buf = malloc(n);
    if (!buf) return NULL;
    for (size_t i = 0; i < n; i++) buf[i] = pat(i);
    ssize_t w = write(*fd, buf, n);
    free(buf);
    if (w != (ssize_t)n) return NULL;
    void *m = mmap(NULL, n, PROT_READ, MAP_SHARED, *fd, 0);
    return m == MAP_FAILED ? NULL : m;
}

/* Read one byte the compiler cannot skip. */
static uint8_t touch(const uint8_t *p) {
    return *(const volatile uint8_t *)p;
}

/* Run fn in a child process with core dumps off; returns the wait status. */
static int in_child(void (*fn)(void)) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        fn();
        _exit(0);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
    return status;
}

static void describe(int status, char *out, size_t n) {
    if (status == -1)
        snprintf(out, n, "fork/wait failed");
    else if (WIFSIGNALED(status))
        snprintf(out, n, "killed by signal %d", WTERMSIG(status));
    else
        snprintf(out, n, "exit status %d", WEXITSTATUS(status));
}

/* ---- chaining (run before this process installs the guard) ---- */

static void previous_handler(int sig, siginfo_t *info, void *uctx) {
    (void)sig;
    (void)uctx;
    _exit(info && info->si_code > 0 ? 42 : 43);
}

/* A handler installed before the guard: a fault inside a guarded range is
 * absorbed (exit code 1..3 if not), one outside reaches the old handler (42). */
static void child_chain(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = previous_handler;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, NULL) != 0) _exit(1);
    int fd1, fd2;
    uint8_t *g = map_file("chain_g", 2 * ps, &fd1), *u = map_file("chain_u", 2 * ps, &fd2);
    if (!g || !u) _exit(1);
    int h = ds41_map_guard_register(g, 2 * ps, NULL);
    if (h < 0) _exit(2);
    if (ftruncate(fd1, 0) != 0 || ftruncate(fd2, 0) != 0) _exit(1);
    if (touch(g + ps + 1) != 0 || ds41_map_guard_lost(h) != ps + 1) _exit(3);
    (void)touch(u + 5); /* not guarded: the previous handler exits 42 */
    _exit(4);
}

/* ---- faults that must still kill (children, after the guard is installed) ---- */

/* A child's own setup failed (never the outcome of a fault). */
#define SETUP_FAILED 77

static void child_unregistered(void) {
    int fd;
    uint8_t *u = map_file("kill_u", 2 * ps, &fd);
    if (!u || ftruncate(fd, 0) != 0) _exit(SETUP_FAILED);
    (void)touch(u + ps);
    _exit(0);
}

static void child_unregistered_again(void) {
    int fd;
    uint8_t *u = map_file("kill_r", 2 * ps, &fd);
    if (!u) _exit(SETUP_FAILED);
    int h = ds41_map_guard_register(u, 2 * ps, NULL);
    if (h < 0) _exit(SETUP_FAILED);
    ds41_map_guard_unregister(h);
    if (ftruncate(fd, 0) != 0) _exit(SETUP_FAILED);
    (void)touch(u + ps);
    _exit(0);
}

static void child_kill_sigbus(void) {
    kill(getpid(), SIGBUS);
    _exit(0);
}

static void child_sigsegv(void) {
    int fd;
    uint8_t *g = map_file("kill_s", ps, &fd);
    if (!g || ds41_map_guard_register(g, ps, NULL) < 0) _exit(SETUP_FAILED);
    *(volatile uint8_t *)g = 1; /* write to a read-only guarded mapping: SIGSEGV, not ours */
    _exit(0);
}

/* ---- a fault on another thread ---- */

typedef struct thread_arg {
    const uint8_t *p;
    size_t n;
    uint8_t *copy;
    int ok;
} thread_arg;

static void *thread_copy(void *p) {
    thread_arg *a = p;
    memcpy(a->copy, a->p, a->n);
    a->ok = 1;
    return NULL;
}

/* ---- a checkpoint with two shards ---- */

static int write_checkpoint(const char *dir, ds41_error *e) {
    static const int64_t shape_a[1] = {3 * 4096}, shape_b[1] = {5 * 4096};
    ds41_st_writer *w = ds41_checkpoint_writer_new(dir, 0, e);
    if (!w) return -1;
    int rc = ds41_checkpoint_writer_declare(w, "a", DS41_U8, 1, shape_a, e);
    if (rc == 0) rc = ds41_checkpoint_writer_break_shard(w);
    if (rc == 0) rc = ds41_checkpoint_writer_declare(w, "b", DS41_U8, 1, shape_b, e);
    if (rc == 0) rc = ds41_checkpoint_writer_begin(w, e);
    uint8_t *buf = malloc(5 * 4096);
    if (!buf) rc = -1;
    for (size_t i = 0; rc == 0 && i < 5 * 4096; i++) buf[i] = pat(i);
    if (rc == 0) rc = ds41_checkpoint_writer_write(w, "a", buf, 3 * 4096, e);
    if (rc == 0) rc = ds41_checkpoint_writer_write(w, "b", buf, 5 * 4096, e);
    if (rc == 0) rc = ds41_checkpoint_writer_finish(w, e);
    free(buf);
    ds41_checkpoint_writer_free(w);
    return rc;
}

static bool data_is_pattern(const ds41_tensor *t) {
    const uint8_t *d = t->data;
    for (size_t i = 0; i < t->nbytes; i++)
        if (touch(d + i) != pat(i)) return false;
    return true;
}

static void test_checkpoint(void) {
    char dir[PATH_MAX + 16], shard[PATH_MAX + 64], want[PATH_MAX + 200];
    snprintf(dir, sizeof dir, "%s/ckpt", root);
    mkdir(dir, 0700);
    ds41_error e = {{0}};
    if (write_checkpoint(dir, &e) != 0) {
        TAP_CHECK(0, "a two-shard checkpoint is written (%s)", e.msg);
        return;
    }
    ds41_checkpoint *c = ds41_checkpoint_open(dir, &e);
    TAP_CHECK(c && ds41_checkpoint_shard_count(c) == 2, "the checkpoint opens with two shards (%s)",
              c ? "opened" : e.msg);
    if (!c) return;
    const ds41_tensor *a = ds41_checkpoint_find(c, "a"), *b = ds41_checkpoint_find(c, "b");
    TAP_CHECK(a && b && b->shard == 1 && data_is_pattern(a) && data_is_pattern(b) &&
                  ds41_checkpoint_check_mappings(c, &e) == 0,
              "intact: both tensors read their bytes and check_mappings passes");
    if (!a || !b || b->shard != 1) {
        ds41_checkpoint_close(c);
        return;
    }
    snprintf(shard, sizeof shard, "%s", ds41_checkpoint_shard_path(c, 1));
    const uint64_t size = ds41_checkpoint_shard_size(c, 1);
    /* Cut the shard at the first page boundary after b's payload starts
     * + 1 page: b's first page survives, the rest is lost. */
    const uint64_t cut = (b->file_offset / ps + 2) * ps;
    int ok = truncate(shard, (off_t)cut) == 0;
    /* The first byte past the cut that b holds, read through the tensor. */
    const uint64_t lost_at = cut - b->file_offset;
    ok = ok && touch((const uint8_t *)b->data + lost_at + 9) == 0;
    ok = ok && touch((const uint8_t *)b->data) == pat(0); /* before the fault: the file's bytes */
    int rc = ds41_checkpoint_check_mappings(c, &e);
    snprintf(want, sizeof want,
             "%s was truncated or became unreadable while mapped (SIGBUS at offset %" PRIu64
             "): the model must be reloaded",
             shard, cut + 9);
    TAP_CHECK(ok && rc == -1 && strcmp(e.msg, want) == 0,
              "a shard truncated under the mapping: reading past the cut gives zeros, check_mappings fails "
              "naming the shard and the file offset (%s)",
              e.msg);
    TAP_CHECK(data_is_pattern(a), "the other shard stays intact");
    ds41_checkpoint_close(c);

    /* Restore the files (the writer rewrites them in place) and open again. */
    ok = write_checkpoint(dir, &e) == 0;
    c = ok ? ds41_checkpoint_open(dir, &e) : NULL;
    b = c ? ds41_checkpoint_find(c, "b") : NULL;
    TAP_CHECK(c && b && ds41_checkpoint_shard_size(c, 1) == size && data_is_pattern(b) &&
                  ds41_checkpoint_check_mappings(c, &e) == 0,
              "the shard rewritten and the checkpoint opened again: fresh mappings, intact (%s)",
              c ? "opened" : e.msg);
    ds41_checkpoint_close(c);
}

/* ---- the engine over a generated tiny checkpoint ---- */

static int forward_prompt(ds41_engine *e, float *logits, ds41_error *err) {
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, err);
    ds41_kv_seq *seq = pool ? ds41_kv_seq_new(pool, err) : NULL;
    static const int32_t ids[6] = {0, 40, 41, 42, 43, 44};
    ds41_fwd_item it = {.seq = seq, .ids = ids, .n_ids = 6, .logits = logits, .logits_last_only = true};
    int rc = seq ? ds41_forward(e, &it, 1, NULL, err) : -1;
    ds41_kv_seq_free(seq);
    ds41_kv_pool_free(pool);
    return rc;
}

static void test_engine(void) {
    char dir[PATH_MAX + 16];
    snprintf(dir, sizeof dir, "%s/model", root);
    ds41_error e = {{0}};
    ds41_model_gen_opts go = {.preset = "tiny", .seed = 11};
    ds41_model_config cfg;
    if (ds41_model_generate(dir, &go, &cfg, &e) != 0) {
        TAP_CHECK(0, "a tiny checkpoint is generated (%s)", e.msg);
        return;
    }
    const size_t V = (size_t)cfg.vocab_size;
    ds41_model_config_free(&cfg);
    /* The shard holding the output head (read by every step). */
    char shard[PATH_MAX + 64] = "";
    ds41_checkpoint *c = ds41_checkpoint_open(dir, &e);
    const ds41_tensor *head = c ? ds41_checkpoint_find(c, "head.weight") : NULL;
    if (head) snprintf(shard, sizeof shard, "%s", ds41_checkpoint_shard_path(c, head->shard));
    ds41_checkpoint_close(c);
    size_t backup_len = 0;
    uint8_t *backup = NULL;
    FILE *f = shard[0] ? fopen(shard, "rb") : NULL;
    if (f) {
        fseek(f, 0, SEEK_END);
        backup_len = (size_t)ftell(f);
        rewind(f);
        backup = malloc(backup_len);
        if (backup && fread(backup, 1, backup_len, f) != backup_len) backup_len = 0;
        fclose(f);
    }
    ds41_engine_opts eo = {.cpu = {.threads = 2}};
    ds41_engine *eng = ds41_engine_load(dir, &eo, &e);
    float *before = malloc(V * sizeof *before), *after = malloc(V * sizeof *after);
    int ok = eng && backup && backup_len && before && after && forward_prompt(eng, before, &e) == 0;
    TAP_CHECK(ok && ds41_engine_check_mappings(eng, NULL) == 0, "engine: tiny loads and runs a prompt (%s)",
              ok ? "intact" : e.msg);
    if (!ok) goto out;

    const char *base = strrchr(shard, '/') + 1;
    ok = truncate(shard, 0) == 0;
    int rc = forward_prompt(eng, after, &e);
    TAP_CHECK(ok && rc == -1 && strstr(e.msg, base) &&
                  strstr(e.msg, "truncated or became unreadable while mapped") &&
                  strstr(e.msg, "the model must be reloaded"),
              "engine: the shard holding head.weight cut to 0 bytes: the step fails naming it (%s)", e.msg);
    ds41_error e2 = {{0}};
    rc = forward_prompt(eng, after, &e2);
    TAP_CHECK(rc == -1 && strcmp(e.msg, e2.msg) == 0 && ds41_engine_check_mappings(eng, NULL) == -1,
              "engine: every later step fails at once with the same message");

    /* Restore the file in place, load again: the same logits as before. */
    f = fopen(shard, "r+b");
    ok = f && fwrite(backup, 1, backup_len, f) == backup_len;
    if (f) ok = fclose(f) == 0 && ok;
    ds41_engine_free(eng);
    eng = ok ? ds41_engine_load(dir, &eo, &e) : NULL;
    ok = eng && forward_prompt(eng, after, &e) == 0;
    TAP_CHECK(ok && memcmp(before, after, V * sizeof *after) == 0,
              "engine: the shard restored and the model loaded again: the same logits bit for bit (%s)",
              ok ? "intact" : e.msg);
out:
    ds41_engine_free(eng);
    free(backup);
    free(before);
    free(after);
}

int main(void) {
    ps = (size_t)sysconf(_SC_PAGESIZE);
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-map-guard-XXXXXX")) {
        printf("Bail out! mkdtemp failed: %s\n", strerror(errno));
        return 1;
    }
    char why[64];

    /* What handled SIGBUS before us: a sanitizer runtime, or nothing. */
    struct sigaction before;
    sigaction(SIGBUS, NULL, &before);
    const bool had_handler =
        (before.sa_flags & SA_SIGINFO) ? before.sa_sigaction != NULL : before.sa_handler != SIG_DFL;
    if (had_handler)
        TAP_NOTE("a SIGBUS handler was installed before ours (a sanitizer runtime): it is chained to");

    int st = in_child(child_chain);
    describe(st, why, sizeof why);
    TAP_CHECK(
        st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 42,
        "with a handler installed before the guard: a guarded fault is absorbed, an unguarded one reaches "
        "the old handler (%s)",
        why);

    /* Argument checks. */
    ds41_error e = {{0}};
    TAP_CHECK(ds41_map_guard_register(NULL, ps, &e) == -1 && strstr(e.msg, "page"),
              "register: NULL base refused (%s)", e.msg);
    static char not_aligned[16];
    TAP_CHECK(ds41_map_guard_register(not_aligned + 1, ps, &e) == -1 && strstr(e.msg, "page"),
              "register: a base off a page boundary refused");
    TAP_CHECK(ds41_map_guard_lost(-1) == DS41_MAP_GUARD_INTACT &&
                  ds41_map_guard_lost(DS41_MAP_GUARD_SLOTS) == DS41_MAP_GUARD_INTACT,
              "lost(): a handle out of range reads as intact");

    /* Main thread: 4 pages, cut to 1 page + 100 bytes. */
    int fd1;
    uint8_t *m1 = map_file("one", 4 * ps, &fd1);
    int h1 = m1 ? ds41_map_guard_register(m1, 4 * ps, &e) : -1;
    TAP_CHECK(h1 >= 0 && ds41_map_guard_lost(h1) == DS41_MAP_GUARD_INTACT && ds41_map_guard_losses() == 0 &&
                  touch(m1 + 3 * ps) == pat(3 * ps),
              "a registered mapping reads its file and is intact (%s)", h1 >= 0 ? "handle ok" : e.msg);
    if (h1 < 0) {
        printf("Bail out! cannot map or register a file\n");
        return 1;
    }
    int ok = ftruncate(fd1, (off_t)(ps + 100)) == 0;
    ok = ok && touch(m1 + 3 * ps + 7) == 0 && touch(m1 + 4 * ps - 1) == 0;
    TAP_CHECK(ok && ds41_map_guard_lost(h1) == 3 * ps + 7 && ds41_map_guard_losses() == 1,
              "main thread: a touch past the new end reads zeros, the first lost offset is recorded (%" PRIu64
              ")",
              ds41_map_guard_lost(h1));
    TAP_CHECK(touch(m1) == pat(0) && touch(m1 + ps + 50) == pat(ps + 50) && touch(m1 + ps + 200) == 0,
              "pages before the fault still read the file (the partial last page: zeros past the end)");
    ok = touch(m1 + 2 * ps + 1) == 0;
    TAP_CHECK(ok && ds41_map_guard_lost(h1) == 3 * ps + 7 && ds41_map_guard_losses() == 2,
              "a second fault earlier in the range is absorbed too; the first offset stays");

    /* Another thread: memcpy across the end of a 3-page file cut to 2 pages. */
    int fd2;
    uint8_t *m2 = map_file("two", 3 * ps, &fd2);
    int h2 = m2 ? ds41_map_guard_register(m2, 3 * ps, &e) : -1;
    thread_arg ta = {.p = m2, .n = 3 * ps, .copy = malloc(3 * ps)};
    ok = h2 >= 0 && ta.copy && ftruncate(fd2, (off_t)(2 * ps)) == 0;
    pthread_t t;
    ok = ok && pthread_create(&t, NULL, thread_copy, &ta) == 0 && pthread_join(t, NULL) == 0 && ta.ok;
    bool bytes_ok = ok;
    for (size_t i = 0; bytes_ok && i < 3 * ps; i++) bytes_ok = ta.copy[i] == (i < 2 * ps ? pat(i) : 0);
    TAP_CHECK(bytes_ok && ds41_map_guard_lost(h2) == 2 * ps,
              "another thread: a memcpy across the new end completes (file bytes, then zeros); lost at %zu",
              2 * ps);
    TAP_CHECK(ds41_map_guard_lost(h1) == 3 * ps + 7, "the other range's record is untouched");
    free(ta.copy);

    /* Unregister: the handle reads intact (dead), the range can be unmapped. */
    ds41_map_guard_unregister(h1);
    ds41_map_guard_unregister(h2);
    TAP_CHECK(ds41_map_guard_lost(h1) == DS41_MAP_GUARD_INTACT && munmap(m1, 4 * ps) == 0 &&
                  munmap(m2, 3 * ps) == 0,
              "unregistered: the handle is dead, the zero-filled ranges unmap");
    close(fd1);
    close(fd2);

    /* The table fills up, and a freed slot is reused. */
    int *handles = malloc(DS41_MAP_GUARD_SLOTS * sizeof *handles);
    void *page = mmap(NULL, ps, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    int n = 0;
    while (handles && page != MAP_FAILED && n < DS41_MAP_GUARD_SLOTS &&
           (handles[n] = ds41_map_guard_register(page, ps, &e)) >= 0)
        n++;
    ok = n == DS41_MAP_GUARD_SLOTS && ds41_map_guard_register(page, ps, &e) == -1 && strstr(e.msg, "slots");
    TAP_CHECK(ok, "the table holds %d ranges, the next is refused (%s)", n, e.msg);
    if (n > 0) {
        ds41_map_guard_unregister(handles[n / 2]);
        int again = ds41_map_guard_register(page, ps, &e);
        TAP_CHECK(again == handles[n / 2], "a freed slot is used again");
        if (again >= 0) ds41_map_guard_unregister(again);
    }
    for (int i = 0; i < n; i++)
        if (i != n / 2) ds41_map_guard_unregister(handles[i]);
    free(handles);
    if (page != MAP_FAILED) munmap(page, ps);

    /* Faults the guard does not own still kill.  Without another handler
     * before ours: killed by SIGBUS.  With one (ASan), it gets the fault
     * and ends the process itself (its report, exit status 1). */
    struct {
        void (*fn)(void);
        const char *what;
    } kills[] = {
        {child_unregistered, "a truncated mapping that was never registered"},
        {child_unregistered_again, "a truncated mapping registered and unregistered again"},
        {child_kill_sigbus, "a SIGBUS sent with kill()"},
    };
    for (size_t i = 0; i < sizeof kills / sizeof kills[0]; i++) {
        st = in_child(kills[i].fn);
        describe(st, why, sizeof why);
        bool died =
            st != -1 &&
            (had_handler ? (WIFSIGNALED(st) || (WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != SETUP_FAILED))
                         : (WIFSIGNALED(st) && WTERMSIG(st) == SIGBUS));
        TAP_CHECK(died, "%s still kills the process (%s)", kills[i].what, why);
    }
    st = in_child(child_sigsegv);
    describe(st, why, sizeof why);
    /* (Under ASan its handler reports the fault and exits with status 1, or
     * aborts with abort_on_error=1 as CI sets it: any death counts there.) */
    TAP_CHECK(st != -1 &&
                  (had_handler ? (WIFSIGNALED(st) || (WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != SETUP_FAILED))
                               : (WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV)),
              "a SIGSEGV in a guarded range is not absorbed (%s)", why);

    test_checkpoint();
    test_engine();

    tmpdir_remove(root);
    return tap_done();
}
