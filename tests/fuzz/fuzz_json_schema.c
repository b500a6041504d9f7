/* Fuzz target: tool parameter schemas (engine/text/json_schema.h).  The input is a schema, a 0xFF byte,
 * then bytes fed to a matcher of each parameter (raw and JSON): compiling never crashes, a
 * refusal names a path, and the matcher's shortest completion of whatever it accepted is accepted
 * and complete. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "engine/text/json_schema.h"
#include "tests/fuzz/fuzz_split.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *feed;
    size_t fl;
    json_t *j = fuzz_split_json(data, size, &feed, &fl);
    if (!j) return 0;
    ds41_schema *s = NULL;
    ds41_error err;
    char path[128];
    if (ds41_schema_compile(j, "p", &s, path, sizeof path, &err) != 0) {
        if (s || strncmp(err.msg, "p", 1) != 0) abort();
        json_decref(j);
        return 0;
    }
    for (size_t k = 0; k < ds41_schema_n_params(s); k++) {
        for (int raw = 0; raw < 2; raw++) {
            if (raw ? !ds41_schema_param_raw_ok(s, k) : !ds41_schema_param_json_ok(s, k)) continue;
            ds41_json_match m;
            ds41_json_match_init(&m, s, k, raw);
            for (size_t i = 0; i < fl; i++) {
                ds41_json_match t;
                ds41_json_match_copy(&t, &m);
                if (ds41_json_match_byte(&t, feed[i])) ds41_json_match_copy(&m, &t);
            }
            char out[4096];
            size_t n = ds41_json_match_completion(&m, out, sizeof out);
            if (n == SIZE_MAX) abort();
            if (n <= sizeof out) {
                for (size_t i = 0; i < n; i++)
                    if (!ds41_json_match_byte(&m, (unsigned char)out[i])) abort();
                if (!ds41_json_match_complete(&m)) abort();
            }
        }
    }
    ds41_schema_free(s);
    json_decref(j);
    return 0;
}
