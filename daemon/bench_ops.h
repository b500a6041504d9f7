/* Per-layer time split by op for ds41-bench --ops.
 *
 * Wraps a backend's op table (engine/backend/ops.h) with timers before the
 * engine is loaded on it: every op call is timed (CLOCK_MONOTONIC around the
 * call, so an op's own parallel work counts in full) and charged to
 * (block, sub-layer, op).  The block and sub-layer come from the order the
 * forward pass calls ops in (engine/forward/forward.c): `embed` starts a
 * pass, each block ends its attention and its FFN sub-layer with one
 * `hc_post` each, and what follows the last block is the head.  Engram's mix
 * before a block is charged to that block's attention part.  Linears are
 * split by stored format (FP8, FP4, BF16); `linear_batch` (a MoE layer's
 * routed experts in one call) is its own op.  Time between ops (the engine's
 * own code: index selection glue, expert-tier waits, bookkeeping) is the
 * step time minus the ops' sum.
 *
 * One profile per process (the wrappers reach it through a static pointer);
 * ops called from several threads at once are not supported (the forward
 * pass calls them from one). */
#ifndef DS41_DAEMON_BENCH_OPS_H
#define DS41_DAEMON_BENCH_OPS_H

#include "engine/backend/backend.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

typedef struct ds41_op_profile ds41_op_profile;

/* Wraps be->ops (the original table is kept inside the profile); n_layers
 * = the backbone's block count.  NULL when out of memory or when a profile
 * already exists. */
ds41_op_profile *ds41_op_profile_install(ds41_backend *be, int n_layers);

/* Zero the counters (start of a timed phase). */
void ds41_op_profile_reset(ds41_op_profile *p);

/* A copy of the counters, to print later (NULL when out of memory). */
ds41_op_profile *ds41_op_profile_snapshot(const ds41_op_profile *p);

/* Text: per block, attention and FFN milliseconds per step and their split by
 * op; the head; the time between ops.  `seconds` is the phase's wall time,
 * `steps` the forward calls it made. */
void ds41_op_profile_print_text(const ds41_op_profile *p, FILE *f, const char *phase, double seconds,
                                size_t steps);

/* JSON object {"phase":..., "seconds_per_step":..., "between_ops_seconds_per_step":...,
 * "blocks":[{"block":L,"attn":{op:seconds per step,...},"ffn":{...}},...],
 * "head":{...}} */
void ds41_op_profile_print_json(const ds41_op_profile *p, FILE *f, const char *phase, double seconds,
                                size_t steps);

void ds41_op_profile_free(ds41_op_profile *p);

#endif
