/* map_guard: file mappings that survive their file being truncated under
 * them.
 *
 * The checkpoint's shards are mapped MAP_SHARED read-only
 * (storage/safetensors.h).  When such a file is truncated (or its pages
 * become unreadable: an I/O error on the device) while mapped, touching a
 * page past the new end raises SIGBUS, which by default kills the whole
 * process -- every session of the daemon with it.
 *
 * A mapping registered here is guarded: a process-wide SIGBUS handler looks
 * the faulting address up in a fixed-size, lock-free table of registered
 * ranges.  Inside one, it maps anonymous zero pages (MAP_FIXED) over the
 * range from the faulting page to the end of that mapping -- so the faulting
 * instruction reruns on zeros and no later access to the rest of the range
 * can fault again -- and records the loss (the mapping's first lost offset,
 * and a process-wide loss counter), then returns.  The values read there are
 * garbage: whoever owns the mapping must check ds41_map_guard_lost() after
 * using it and throw away whatever it computed (the engine fails the step
 * and refuses every later one until the model is reloaded).
 *
 * Outside every registered range (a real bug, or a SIGBUS sent by kill),
 * the handler passes the signal on: to the handler installed before it
 * (sanitizer runtimes, libFuzzer), or, with none, it restores the default
 * action and re-raises, so the process still dies loudly with SIGBUS.
 *
 * Only SIGBUS is handled: SIGSEGV keeps whatever handling the process has.
 *
 * Thread safety: every function may be called from any thread.  The table
 * is read by the handler without locks (atomics only); registering and
 * unregistering a range is safe against a concurrent fault in any other
 * range.  Unregister a range before unmapping it. */
#ifndef DS41_STORAGE_MAP_GUARD_H
#define DS41_STORAGE_MAP_GUARD_H

#include "config/error.h"

#include <stddef.h>
#include <stdint.h>

/* Ranges that can be guarded at once (a checkpoint uses one per shard: 48
 * for the release; a reload holds old and new at the same time). */
#define DS41_MAP_GUARD_SLOTS 1024

/* Offset reported by ds41_map_guard_lost for an intact range. */
#define DS41_MAP_GUARD_INTACT UINT64_MAX

/* Install the SIGBUS handler (once per process; later calls do nothing and
 * return 0).  The handler installed before it, if any, is kept and called
 * for faults outside guarded ranges.  ds41_map_guard_register calls this
 * itself; call it directly to install the handler earlier (e.g. after a
 * runtime that installs its own SIGBUS handler at its start).  Returns 0,
 * or -1 when sigaction fails or the handler did not take (a runtime that
 * keeps SIGBUS to itself: ASan with ASAN_OPTIONS=handle_sigbus=2; ASan's
 * default, handle_sigbus=1, lets ours replace its handler and is chained
 * to). */
int ds41_map_guard_install(ds41_error *err);

/* Guard [base, base + len): base must be page aligned (as mmap returns it),
 * len > 0; the range must be a mapping the caller owns until it calls
 * ds41_map_guard_unregister (the caller keeps which handle guards what: the
 * checkpoint keeps one per shard).  Installs the handler when it is not yet.
 * Returns a handle >= 0, or -1 (err filled: bad arguments, every one of the
 * DS41_MAP_GUARD_SLOTS slots in use, sigaction failing). */
int ds41_map_guard_register(const void *base, size_t len, ds41_error *err);

/* Stop guarding the range of handle (from ds41_map_guard_register); the
 * handle is dead afterwards.  Call it before munmap.  A negative handle is
 * ignored. */
void ds41_map_guard_unregister(int handle);

/* Whether the range of handle lost pages: returns the byte offset (from
 * base) of the first fault the handler absorbed in it, or
 * DS41_MAP_GUARD_INTACT when none did (also for a negative or unregistered
 * handle).  Cheap (one atomic load): safe to call after every use. */
uint64_t ds41_map_guard_lost(int handle);

/* Number of faults absorbed so far in all guarded ranges of the process (it
 * only grows): a quick test before looking at individual handles. */
uint64_t ds41_map_guard_losses(void);

#endif
