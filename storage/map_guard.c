/* map_guard: the SIGBUS handler and its table of guarded ranges (see map_guard.h). */
#include "storage/map_guard.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The handler reads the table with plain atomic loads; they must not hide a
 * lock (a lock taken by the interrupted thread would deadlock it). */
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "atomic int must be lock-free");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "atomic 64-bit integers must be lock-free");
_Static_assert(ATOMIC_POINTER_LOCK_FREE == 2, "atomic pointers must be lock-free");
_Static_assert(sizeof(uintptr_t) == 8 && sizeof(size_t) == 8, "a 64-bit address space is assumed");

enum { SLOT_FREE = 0, SLOT_CLAIMED = 1, SLOT_ACTIVE = 2 };

typedef struct guard_slot {
    atomic_int state;           /* SLOT_*: a range is looked at only while ACTIVE */
    atomic_uintptr_t start;     /* page aligned */
    atomic_uint_least64_t len;  /* bytes, > 0 */
    atomic_uint_least64_t lost; /* first absorbed fault's offset, or DS41_MAP_GUARD_INTACT */
} guard_slot;

static guard_slot g_slots[DS41_MAP_GUARD_SLOTS];
/* Slots [0, g_used) have ever been claimed: the handler scans only those. */
static atomic_int g_used;
static atomic_uint_least64_t g_losses;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_install_errno;         /* 0 = installed */
static uintptr_t g_page_mask;       /* ~(page size - 1), set before the handler is installed */
static struct sigaction g_previous; /* read by the handler; written before it is installed */

/* Hand a fault we do not own to whoever handled SIGBUS before us, or die of
 * it: with SIG_DFL restored, raise() leaves SIGBUS pending (it is blocked
 * while its handler runs) and it is delivered, with the default action
 * (terminate + core), as soon as the handler returns.  sigaction and raise
 * are async-signal-safe. */
static void pass_on(int sig, siginfo_t *info, void *uctx) {
    if ((g_previous.sa_flags & SA_SIGINFO) && g_previous.sa_sigaction) {
        g_previous.sa_sigaction(sig, info, uctx);
        return;
    }
    if (!(g_previous.sa_flags & SA_SIGINFO) && g_previous.sa_handler != SIG_DFL &&
        g_previous.sa_handler != SIG_IGN) {
        g_previous.sa_handler(sig);
        return;
    }
    /* SIG_DFL, or SIG_IGN (a hardware fault cannot be ignored: the faulting
     * instruction would rerun forever). */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    raise(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *uctx) {
    const int saved_errno = errno;
    /* si_code <= 0: sent by a process (kill, tgkill, sigqueue); si_addr then
     * means nothing. */
    if (info && info->si_code > 0) {
        const uintptr_t a = (uintptr_t)info->si_addr;
        const int used = atomic_load_explicit(&g_used, memory_order_acquire);
        for (int i = 0; i < used; i++) {
            guard_slot *s = &g_slots[i];
            if (atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_ACTIVE) continue;
            const uintptr_t start = atomic_load_explicit(&s->start, memory_order_relaxed);
            const uint64_t len = atomic_load_explicit(&s->len, memory_order_relaxed);
            if (a < start || a - start >= len) continue;
            const uintptr_t page = a & g_page_mask;
            const uintptr_t end = (start + (uintptr_t)len + ~g_page_mask) & g_page_mask;
            /* Zero pages over the rest of the range.  The raw system call:
             * mmap is one syscall on Linux, safe in a signal handler, and
             * this way no sanitizer interceptor or libc bookkeeping runs
             * here.  The offset argument is in bytes on every 64-bit ABI. */
            long r = syscall(SYS_mmap, (void *)page, (size_t)(end - page), PROT_READ,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0L);
            if (r == -1 || (uintptr_t)r != page) break; /* cannot recover: die loudly */
            uint_least64_t intact = DS41_MAP_GUARD_INTACT;
            atomic_compare_exchange_strong_explicit(&s->lost, &intact, (uint_least64_t)(a - start),
                                                    memory_order_acq_rel, memory_order_relaxed);
            atomic_fetch_add_explicit(&g_losses, 1, memory_order_acq_rel);
            errno = saved_errno;
            return; /* the faulting instruction reruns and reads zeros */
        }
    }
    errno = saved_errno;
    pass_on(sig, info, uctx);
}

static void install_once(void) {
    long ps = sysconf(_SC_PAGESIZE);
    if (ps <= 0 || (ps & (ps - 1)) != 0) {
        g_install_errno = EINVAL;
        return;
    }
    g_page_mask = ~((uintptr_t)ps - 1);
    /* Read the previous disposition first, then install: a fault in another
     * thread between the two still finds g_previous complete. */
    if (sigaction(SIGBUS, NULL, &g_previous) != 0) {
        g_install_errno = errno;
        return;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    /* SA_ONSTACK: run on the thread's alternate signal stack where it has
     * one (sanitizer runtimes give every thread one); the engine's own
     * threads have none, and then the kernel uses the thread's stack, which
     * is fine: a SIGBUS here is a lost file page, never a stack overflow,
     * and the handler needs a few hundred bytes. */
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, NULL) != 0) {
        g_install_errno = errno;
        return;
    }
    /* A runtime can keep SIGBUS to itself and ignore sigaction (ASan with
     * ASAN_OPTIONS=handle_sigbus=2): then the mappings are not guarded. */
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0 || !(now.sa_flags & SA_SIGINFO) || now.sa_sigaction != on_sigbus)
        g_install_errno = EBUSY;
}

int ds41_map_guard_install(ds41_error *err) {
    pthread_once(&g_once, install_once);
    if (g_install_errno == EBUSY)
        return ds41_fail(err,
                         "cannot install the SIGBUS handler for the checkpoint mappings: another runtime "
                         "keeps SIGBUS to itself (ASAN_OPTIONS=handle_sigbus=2?)");
    if (g_install_errno)
        return ds41_fail(err, "cannot install the SIGBUS handler for the checkpoint mappings: %s",
                         strerror(g_install_errno));
    return 0;
}

int ds41_map_guard_register(const void *base, size_t len, ds41_error *err) {
    if (ds41_map_guard_install(err) != 0) return -1;
    if (!base || len == 0 || ((uintptr_t)base & ~g_page_mask) != 0)
        return ds41_fail(err, "map guard: a range must start on a page and be non-empty");
    if ((uintptr_t)base + len < (uintptr_t)base)
        return ds41_fail(err, "map guard: the range wraps the address space");
    for (int i = 0; i < DS41_MAP_GUARD_SLOTS; i++) {
        guard_slot *s = &g_slots[i];
        int expect = SLOT_FREE;
        if (!atomic_compare_exchange_strong_explicit(&s->state, &expect, SLOT_CLAIMED, memory_order_acq_rel,
                                                     memory_order_relaxed))
            continue;
        atomic_store_explicit(&s->start, (uintptr_t)base, memory_order_relaxed);
        atomic_store_explicit(&s->len, (uint_least64_t)len, memory_order_relaxed);
        atomic_store_explicit(&s->lost, DS41_MAP_GUARD_INTACT, memory_order_relaxed);
        int used = atomic_load_explicit(&g_used, memory_order_relaxed);
        while (used < i + 1 && !atomic_compare_exchange_weak_explicit(
                                   &g_used, &used, i + 1, memory_order_acq_rel, memory_order_relaxed)) {
        }
        /* Publish: the handler sees start/len only after this store. */
        atomic_store_explicit(&s->state, SLOT_ACTIVE, memory_order_release);
        return i;
    }
    return ds41_fail(err, "map guard: all %d slots for guarded mappings are in use", DS41_MAP_GUARD_SLOTS);
}

void ds41_map_guard_unregister(int handle) {
    if (handle < 0 || handle >= DS41_MAP_GUARD_SLOTS) return;
    atomic_store_explicit(&g_slots[handle].state, SLOT_FREE, memory_order_release);
}

uint64_t ds41_map_guard_lost(int handle) {
    if (handle < 0 || handle >= DS41_MAP_GUARD_SLOTS) return DS41_MAP_GUARD_INTACT;
    const guard_slot *s = &g_slots[handle];
    if (atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_ACTIVE) return DS41_MAP_GUARD_INTACT;
    return atomic_load_explicit(&s->lost, memory_order_acquire);
}

uint64_t ds41_map_guard_losses(void) {
    return atomic_load_explicit(&g_losses, memory_order_acquire);
}
