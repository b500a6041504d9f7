/* Fuzz target: response formats for structured output (engine/text/json_schema.h
 * ds41_schema_compile_format and the value matcher).  The input is a response_format object, a
 * 0xFF byte, then bytes fed to a document matcher with small bounds (2 whitespace bytes, strings
 * of 8 bytes): compiling never crashes and a refusal names a path under "response_format"; each
 * accepted byte lengthens the shortest completion by at most ds41_schema_step_growth (the
 * budget check relies on it); the completion of whatever was accepted is accepted, complete and
 * parses as JSON. */
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
    char path[256];
    if (ds41_schema_compile_format(j, "response_format", &s, path, sizeof path, &err) != 0) {
        if (s || strncmp(err.msg, "response_format", 15) != 0 || strncmp(path, "response_format", 15) != 0)
            abort();
        json_decref(j);
        return 0;
    }
    if (!s) {
        json_decref(j);
        return 0;
    }
    size_t growth = ds41_schema_step_growth(s);
    ds41_json_match m;
    ds41_json_match_init_value(&m, s, 2, 8);
    char buf[8192];
    size_t have = 0;
    size_t now = ds41_json_match_completion(&m, NULL, 0);
    for (size_t i = 0; i < fl && have < sizeof buf; i++) {
        ds41_json_match t;
        ds41_json_match_copy(&t, &m);
        if (!ds41_json_match_byte(&t, feed[i])) continue;
        size_t next = ds41_json_match_completion(&t, NULL, 0);
        if (next == SIZE_MAX || next > now + growth) abort();
        ds41_json_match_copy(&m, &t);
        buf[have++] = (char)feed[i];
        now = next;
    }
    char out[8192];
    size_t n = ds41_json_match_completion(&m, out, sizeof out);
    if (n == SIZE_MAX) abort();
    if (n <= sizeof out && have + n <= sizeof buf) {
        for (size_t i = 0; i < n; i++)
            if (!ds41_json_match_byte(&m, (unsigned char)out[i])) abort();
        if (!ds41_json_match_complete(&m)) abort();
        memcpy(buf + have, out, n);
        json_t *v = json_loadb(buf, have + n, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
        if (!v) abort();
        json_decref(v);
    }
    ds41_schema_free(s);
    json_decref(j);
    return 0;
}
