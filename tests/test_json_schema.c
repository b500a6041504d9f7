/* Tool parameter schemas (engine/text/json_schema.h): the subset is compiled or refused with the
 * field's path, and the byte matcher accepts only prefixes of valid values, never dead-ends, and
 * completes any prefix into JSON that an independent validator accepts. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "engine/text/json_schema.h"
#include "engine/model/pcg64.h"
#include "tests/schema_valid.h"
#include "tests/tap.h"

static ds41_schema *compile(const char *json, char *path, size_t cap, ds41_error *err) {
    json_error_t je;
    json_t *j = json_loads(json, 0, &je);
    if (!j) {
        snprintf(err->msg, sizeof err->msg, "test JSON: %s", je.text);
        return NULL;
    }
    ds41_schema *s = NULL;
    ds41_schema_compile(j, "p", &s, path, cap, err);
    json_decref(j);
    return s;
}

static const char *const GOOD[] = {
    "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"description\":\"c\"},"
    "\"days\":{\"type\":\"integer\"},\"unit\":{\"enum\":[\"C\",\"F\"]}},\"required\":[\"city\",\"days\"]}",
    "{\"type\":\"object\",\"properties\":{\"q\":{\"type\":[\"string\",\"null\"]},\"n\":{\"type\":\"number\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"enum\":[\"a\",\"ab\",\"b\"]}},"
    "\"opt\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"boolean\"},\"y\":{\"type\":\"integer\"}},"
    "\"required\":[\"x\",\"y\"],\"additionalProperties\":false}},\"required\":[\"opt\",\"tags\"]}",
    "{\"type\":\"object\",\"properties\":{\"any\":{},\"free\":{\"type\":\"object\"},\"c\":{\"const\":3},"
    "\"m\":{\"enum\":[1,\"x\",null,[1,2],{\"k\":true}]}},\"required\":[\"any\",\"free\",\"c\",\"m\"]}",
    "{\"type\":\"object\",\"properties\":{\"deep\":{\"type\":\"array\",\"items\":{\"type\":\"array\","
    "\"items\":"
    "{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"number\",\"nullable\":true}},\"required\":[\"v\"]"
    "}}}},"
    "\"required\":[\"deep\"]}",
};

static void test_compile(void) {
    char path[128];
    ds41_error err;
    for (size_t i = 0; i < sizeof GOOD / sizeof *GOOD; i++) {
        ds41_schema *s = compile(GOOD[i], path, sizeof path, &err);
        TAP_CHECK(s != NULL, "good schema %zu compiles (%s)", i, s ? "ok" : err.msg);
        ds41_schema_free(s);
    }
    ds41_schema *s = NULL;
    TAP_CHECK(ds41_schema_compile(NULL, "p", &s, path, sizeof path, &err) == 0 && s &&
                  ds41_schema_n_params(s) == 0,
              "absent parameters: an object without parameters");
    ds41_schema_free(s);
    s = compile(GOOD[0], path, sizeof path, &err);
    TAP_CHECK(s && ds41_schema_n_params(s) == 3 && strcmp(ds41_schema_param_name(s, 0), "city") == 0 &&
                  ds41_schema_param_required(s, 1) && !ds41_schema_param_required(s, 2) &&
                  ds41_schema_param_raw_ok(s, 0) && !ds41_schema_param_json_ok(s, 0) &&
                  !ds41_schema_param_raw_ok(s, 1) && ds41_schema_param_json_ok(s, 1) &&
                  ds41_schema_param_raw_ok(s, 2),
              "parameters in schema order, required flags, string=\"true\" only for strings");
    ds41_schema_free(s);

    static const struct {
        const char *json, *path;
    } bad[] = {
        {"{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"strin\"}}}", "p.properties.city.type"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"}},\"required\":[\"b\"]}",
         "p.required[0]"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"}},\"required\":[\"a\",\"a\"]}",
         "p.required[1]"},
        {"{\"type\":\"object\",\"required\":\"a\"}", "p.required"},
        {"{\"type\":\"string\"}", "p.type"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"minLength\":2}}}",
         "p.properties.a.minLength"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"anyOf\":[]}}}", "p.properties.a.anyOf"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/x\"}}}", "p.properties.a.$ref"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"enum\":[]}}}", "p.properties.a.enum"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"enum\":[1,\"x\"]}}}",
         "p.properties.a.enum[1]"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"items\":[{}]}}}",
         "p.properties.a.items"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":[\"string\",\"string\"]}}}",
         "p.properties.a.type[1]"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":[]}}}", "p.properties.a.type"},
        {"{\"type\":\"object\",\"properties\":{\"a\\\"b\":{}}}", "p.properties.a\"b"},
        {"{\"type\":\"object\",\"properties\":{\"\":{}}}", "p.properties."},
        {"{\"type\":\"object\",\"properties\":{\"a\":5}}", "p.properties.a"},
        {"{\"type\":\"object\",\"additionalProperties\":{\"type\":\"string\"}}", "p.additionalProperties"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"enum\":[\"x｜DSML｜y\"]}}}",
         "p.properties.a.enum[0]"},
        {"[1]", "p"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        s = compile(bad[i].json, path, sizeof path, &err);
        TAP_CHECK(!s && strcmp(path, bad[i].path) == 0 &&
                      strncmp(err.msg, bad[i].path, strlen(bad[i].path)) == 0,
                  "refused, naming %s (%s)", bad[i].path, s ? "accepted" : err.msg);
        ds41_schema_free(s);
    }
    /* nesting past the limit */
    char deep[4096] = "";
    for (int d = 0; d < DS41_SCHEMA_MAX_DEPTH + 1; d++) strcat(deep, "{\"type\":\"array\",\"items\":");
    strcat(deep, "{}");
    for (int d = 0; d < DS41_SCHEMA_MAX_DEPTH + 1; d++) strcat(deep, "}");
    char top[4200];
    snprintf(top, sizeof top, "{\"type\":\"object\",\"properties\":{\"a\":%s}}", deep);
    s = compile(top, path, sizeof path, &err);
    TAP_CHECK(!s && strstr(err.msg, "deeper"), "schemas nested past %d levels are refused (%s)",
              DS41_SCHEMA_MAX_DEPTH, err.msg);
}

static bool feed(ds41_json_match *m, const char *s) {
    for (; *s; s++)
        if (!ds41_json_match_byte(m, (unsigned char)*s)) return false;
    return true;
}

static void test_match(void) {
    char path[128];
    ds41_error err;
    ds41_schema *s = compile(GOOD[1], path, sizeof path, &err);
    if (!TAP_CHECK(s != NULL, "schema (%s)", s ? "ok" : err.msg)) return;
    /* params: q, n, tags, opt (schema order) */
    static const struct {
        size_t param;
        const char *text;
        bool ok, complete;
    } cases[] = {
        {3, "{\"x\":true,\"y\":5}", true, true},
        {3, "{ \"y\" : -12 , \"x\" : false }", true, true},
        {3, "{\"x\":true}", false, false},               /* '}' before y */
        {3, "{\"x\":true,\"x\":false", false, false},    /* a key twice */
        {3, "{\"z\":1", false, false},                   /* undeclared */
        {3, "{\"y\":1.5", false, false},                 /* integer */
        {3, "{\"y\":01", false, false},                  /* leading zero */
        {3, "{\"y\":1234567890123456789", false, false}, /* 19 digits */
        {1, "-1.5e+10", true, true},
        {1, "1e100", false, false}, /* 3 exponent digits */
        {1, "1.", true, false},
        {2, "[\"a\",\"ab\",\"b\"]", true, true},
        {2, "[\"c\"", false, false},
        {2, "[\"a\" ,", true, false},
        {0, "null", true, true},
        {0, "\"h\\u00e9llo\\n\"", true, true},
        {0, "\"\\u0000\"", false, false},
        {0, "\"\\ud800\"", false, false},
        {0, "\"a\tb\"", false, false},         /* raw control character */
        {0, "\"\xc3\x28\"", false, false},     /* ill-formed UTF-8 */
        {0, "\"\xed\xa0\x80\"", false, false}, /* a surrogate in UTF-8 */
        {0, "\"x｜DSML｜\"", true, true},      /* the matcher allows it; generate.c's guard does not */
        {0, "true", false, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        ds41_json_match m;
        ds41_json_match_init(&m, s, cases[i].param, false);
        bool ok = feed(&m, cases[i].text);
        bool complete = ok && ds41_json_match_complete(&m);
        TAP_CHECK(ok == cases[i].ok && complete == cases[i].complete, "param %zu '%s': %s%s", cases[i].param,
                  cases[i].text, ok ? "accepted" : "refused", complete ? ", complete" : "");
    }
    /* raw mode: a string's text itself */
    ds41_json_match m;
    ds41_json_match_init(&m, s, 0, true);
    TAP_CHECK(feed(&m, "any \"text\" \\ <here>\n") && ds41_json_match_complete(&m), "raw: any text");
    ds41_json_match_init(&m, s, 0, true);
    TAP_CHECK(feed(&m, "\xe2\x82") && !ds41_json_match_complete(&m) &&
                  ds41_json_match_completion(&m, NULL, 0) == 1,
              "raw: half a character is not complete; one byte completes it");
    ds41_schema_free(s);

    s = compile(GOOD[0], path, sizeof path, &err);
    ds41_json_match_init(&m, s, 2, true); /* unit: enum C / F */
    TAP_CHECK(s && feed(&m, "C") && ds41_json_match_complete(&m) && !ds41_json_match_byte(&m, 'x'),
              "raw enum: exactly one of the values");
    ds41_json_match_init(&m, s, 2, false);
    TAP_CHECK(feed(&m, "\"F\"") && ds41_json_match_complete(&m), "JSON enum: the value as JSON");
    ds41_schema_free(s);
}

/* Random walks: at every point some byte continues (or the value is complete), and the shortest
 * completion of any prefix is valid JSON that the validator accepts. */
static void test_walks(void) {
    size_t walks = 0, bad_dead = 0, bad_value = 0, completes = 0;
    char why[600] = "";
    ds41_pcg64 rng;
    ds41_seedseq_pcg64(&rng, 7);
    for (size_t gi = 0; gi < sizeof GOOD / sizeof *GOOD; gi++) {
        char path[128];
        ds41_error err;
        ds41_schema *s = compile(GOOD[gi], path, sizeof path, &err);
        json_t *sj = json_loads(GOOD[gi], 0, NULL);
        if (!s || !sj) continue;
        const json_t *props = json_object_get(sj, "properties");
        for (size_t k = 0; k < ds41_schema_n_params(s); k++) {
            const json_t *ps = json_object_get(props, ds41_schema_param_name(s, k));
            for (int raw = 0; raw < 2; raw++) {
                if (raw ? !ds41_schema_param_raw_ok(s, k) : !ds41_schema_param_json_ok(s, k)) continue;
                for (int w = 0; w < 150; w++) {
                    ds41_json_match m;
                    ds41_json_match_init(&m, s, k, raw);
                    char text[512];
                    size_t n = 0, steps = (size_t)(ds41_pcg64_next64(&rng) % 60);
                    for (size_t st = 0; st < steps; st++) {
                        unsigned char allowed[256];
                        size_t na = 0;
                        for (int c = 0; c < 256; c++) {
                            ds41_json_match t = m;
                            if (ds41_json_match_byte(&t, (unsigned char)c)) allowed[na++] = (unsigned char)c;
                        }
                        if (!na) {
                            if (!ds41_json_match_complete(&m)) {
                                bad_dead++;
                                snprintf(why, sizeof why, "dead end after '%.*s'", (int)n, text);
                            }
                            break;
                        }
                        /* favour structure over long strings: printable ASCII first */
                        unsigned char c = allowed[ds41_pcg64_next64(&rng) % na];
                        ds41_json_match_byte(&m, c);
                        text[n++] = (char)c;
                    }
                    char comp[2048];
                    size_t cl = ds41_json_match_completion(&m, comp, sizeof comp);
                    bool ok = cl < sizeof comp;
                    ds41_json_match t = m;
                    for (size_t i = 0; ok && i < cl; i++)
                        ok = ds41_json_match_byte(&t, (unsigned char)comp[i]);
                    ok = ok && ds41_json_match_complete(&t);
                    char full[2600];
                    size_t fl = 0;
                    if (ok) {
                        if (raw) {
                            /* a raw value is a string's text */
                            memcpy(full, text, n);
                            memcpy(full + n, comp, cl);
                            json_t *all = json_stringn(full, n + cl);
                            ok = all && valid(ps, all);
                            json_decref(all);
                        } else {
                            memcpy(full, text, n);
                            memcpy(full + n, comp, cl);
                            fl = n + cl;
                            json_t *v = json_loadb(full, fl, JSON_DECODE_ANY, NULL);
                            ok = v && valid(ps, v);
                            json_decref(v);
                        }
                    }
                    if (!ok) {
                        bad_value++;
                        snprintf(why, sizeof why, "schema %zu param %zu raw %d: '%.*s' + '%.*s'", gi, k, raw,
                                 (int)n, text, (int)(cl < sizeof comp ? cl : 0), comp);
                    }
                    if (ds41_json_match_complete(&m)) completes++;
                    walks++;
                }
            }
        }
        json_decref(sj);
        ds41_schema_free(s);
    }
    TAP_CHECK(
        walks > 1000 && bad_dead == 0 && bad_value == 0,
        "%zu random byte walks (%zu ended complete): no dead end, every completion is valid JSON of the "
        "schema %s",
        walks, completes, why);
}

/* Every limit exactly at its edge, both sides (issue 19): nesting depth, properties per object,
 * the 64-bit set of properties seen (required properties past the 32nd), the matcher's frames. */
static void test_limits(void) {
    char path[128];
    ds41_error err;
    /* levels: the parameters object is level 1, property a level 2, then each items one more */
    for (int levels = DS41_SCHEMA_MAX_DEPTH; levels <= DS41_SCHEMA_MAX_DEPTH + 1; levels++) {
        char deep[4096] = "";
        for (int d = 2; d < levels; d++) strcat(deep, "{\"type\":\"array\",\"items\":");
        strcat(deep, "{}");
        for (int d = 2; d < levels; d++) strcat(deep, "}");
        char top[4200];
        snprintf(top, sizeof top, "{\"type\":\"object\",\"properties\":{\"a\":%s}}", deep);
        ds41_schema *s = compile(top, path, sizeof path, &err);
        if (levels == DS41_SCHEMA_MAX_DEPTH)
            TAP_CHECK(s != NULL, "schemas nested exactly %d levels are accepted (%s)", levels,
                      s ? "ok" : err.msg);
        else
            TAP_CHECK(!s && strstr(err.msg, "deeper"), "schemas nested %d levels are refused", levels);
        ds41_schema_free(s);
    }

    /* an object of exactly DS41_SCHEMA_MAX_PROPS required properties, and one more */
    for (int np = DS41_SCHEMA_MAX_PROPS; np <= DS41_SCHEMA_MAX_PROPS + 1; np++) {
        char *js = malloc(16384), *val = malloc(4096);
        int n = snprintf(js, 128,
                         "{\"type\":\"object\",\"properties\":{\"o\":{\"type\":\"object\",\"properties\":{");
        int v = snprintf(val, 8, "{");
        for (int k = 0; k < np; k++) {
            n += snprintf(js + n, 64, "%s\"p%d\":{\"type\":\"integer\"}", k ? "," : "", k);
            v += snprintf(val + v, 32, "%s\"p%d\":%d", k ? "," : "", k, k);
        }
        n += snprintf(js + n, 64, "},\"required\":[");
        for (int k = 0; k < np; k++) n += snprintf(js + n, 32, "%s\"p%d\"", k ? "," : "", k);
        snprintf(js + n, 64, "]}},\"required\":[\"o\"]}");
        snprintf(val + v, 8, "}");
        ds41_schema *s = compile(js, path, sizeof path, &err);
        if (np == DS41_SCHEMA_MAX_PROPS) {
            TAP_CHECK(s != NULL, "an object schema of exactly %d properties is accepted (%s)", np,
                      s ? "ok" : err.msg);
            bool whole = false, early = true;
            if (s) {
                ds41_json_match m;
                ds41_json_match_init(&m, s, 0, false);
                /* '}' is refused until the last required property is in */
                char *cut = strrchr(val, ',');
                *cut = 0;
                early = feed(&m, val) && !ds41_json_match_byte(&m, '}');
                *cut = ',';
                ds41_json_match_init(&m, s, 0, false);
                whole = feed(&m, val) && ds41_json_match_complete(&m);
            }
            TAP_CHECK(whole && early,
                      "all %d required properties (bits past 32 of the seen set) close the object, %d do not",
                      np, np - 1);
        } else {
            TAP_CHECK(!s && strstr(err.msg, "properties"), "%d properties are refused (%s)", np,
                      s ? "accepted" : err.msg);
        }
        ds41_schema_free(s);
        free(js);
        free(val);
    }

    /* the matcher's stack: DS41_JSON_MATCH_DEPTH nested arrays in a free value, not one more */
    ds41_schema *s = compile("{\"type\":\"object\",\"properties\":{\"any\":{}}}", path, sizeof path, &err);
    if (TAP_CHECK(s != NULL, "free-value schema (%s)", s ? "ok" : err.msg)) {
        ds41_json_match m;
        ds41_json_match_init(&m, s, 0, false);
        bool ok = true;
        for (int d = 0; d < DS41_JSON_MATCH_DEPTH; d++) ok &= ds41_json_match_byte(&m, '[');
        ds41_json_match one_more;
        ds41_json_match_copy(&one_more, &m);
        const bool refused = !ds41_json_match_byte(&one_more, '[');
        for (int d = 0; d < DS41_JSON_MATCH_DEPTH; d++) ok &= ds41_json_match_byte(&m, ']');
        TAP_CHECK(ok && ds41_json_match_complete(&m) && refused,
                  "the matcher takes exactly %d nested arrays; one more '[' is refused",
                  DS41_JSON_MATCH_DEPTH);
    }
    ds41_schema_free(s);
}

int main(void) {
    test_compile();
    test_match();
    test_walks();
    test_limits();
    return tap_done();
}
