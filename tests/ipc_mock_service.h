/* A deterministic ds41_service for the ipc tests and the api fuzz target.
 *
 * Generation output depends only on the request:
 *   - thinking enabled: reasoning deltas "think0 ", "think1 " first;
 *   - tools given and tool_choice not "none": one call of the first tool,
 *     arguments {"x": 1} in two fragments, finish "tool_calls";
 *   - otherwise the content tokens "Hello", " from", " the", " mock", " \u2713"
 *     (max_tokens < 5 cuts them: finish "length"; else "stop");
 *   - logprobs: token i has logprob -0.25*(i+1), alternatives "alt0".. with
 *     -1-k; usage: prompt_tokens = input bytes / 4 + 1, cached_tokens 2.
 * The model name picks a behaviour:
 *   "missing" -> 404 model_not_found; "queue-full" -> 429 (Retry-After 3);
 *   "kv-full" -> 503 (Retry-After 7); "late-error" -> one delta then an
 *   error event (kv_full); "cancel-self" -> finishes as cancelled;
 * and, in async mode only (events from a worker thread per request):
 *   "slow" -> 20 ms between events; "gated" -> each event waits for
 *   mock_service_gate(); "hang" -> one delta, then nothing until cancelled;
 *   "flood" -> max_tokens deltas of 64 bytes as fast as possible.
 * Sync mode delivers every event inside submit(). */
#ifndef DS41_TESTS_IPC_MOCK_SERVICE_H
#define DS41_TESTS_IPC_MOCK_SERVICE_H

#include <stdbool.h>
#include <stddef.h>

#include "ipc/service.h"

typedef struct mock_service mock_service;

mock_service *mock_service_new(bool async);
/* Cancels live requests, waits for the workers, frees. */
void mock_service_free(mock_service *m);
const ds41_service *mock_service_iface(mock_service *m);

void mock_service_set_health(mock_service *m, ds41_health_state state, const char *detail);
/* Let one waiting event of every "gated" request through. */
void mock_service_gate(mock_service *m);
/* cancel() calls that found a live request. */
unsigned mock_service_cancels(mock_service *m);
/* Accepted requests whose terminal event has not been delivered yet. */
unsigned mock_service_live(mock_service *m);
/* Wait until mock_service_live() is 0; false on timeout. */
bool mock_service_wait_idle(mock_service *m, int timeout_ms);
/* A one-line summary of the last submitted request ("model=...;thinking=...;...")
 * copied into out. */
void mock_service_last_request(mock_service *m, char *out, size_t n);
/* Number of submit() calls that were accepted. */
unsigned mock_service_accepted(mock_service *m);

#endif
