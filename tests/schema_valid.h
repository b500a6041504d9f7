/* An independent validator of the tool-schema subset (engine/text/json_schema.h) for tests: a jansson
 * value against the schema's JSON (type or type list, nullable, enum, properties, required,
 * additionalProperties false, items).  Written from the JSON Schema rules, not from the matcher. */
#ifndef DS41_TESTS_SCHEMA_VALID_H
#define DS41_TESTS_SCHEMA_VALID_H

#include <stdbool.h>
#include <string.h>

#include <jansson.h>

static inline bool type_ok(const char *t, const json_t *v) {
    if (strcmp(t, "null") == 0) return json_is_null(v);
    if (strcmp(t, "boolean") == 0) return json_is_boolean(v);
    if (strcmp(t, "integer") == 0) return json_is_integer(v);
    if (strcmp(t, "number") == 0) return json_is_number(v);
    if (strcmp(t, "string") == 0) return json_is_string(v);
    if (strcmp(t, "array") == 0) return json_is_array(v);
    if (strcmp(t, "object") == 0) return json_is_object(v);
    return false;
}

static inline bool valid(const json_t *sc, const json_t *v) {
    const json_t *type = json_object_get(sc, "type");
    if (json_is_null(v) && json_is_true(json_object_get(sc, "nullable"))) return true;
    if (json_is_string(type) && !type_ok(json_string_value(type), v)) return false;
    if (json_is_array(type)) {
        bool any = false;
        size_t i;
        const json_t *t;
        json_array_foreach(type, i, t) any = any || type_ok(json_string_value(t), v);
        if (!any) return false;
    }
    const json_t *en = json_object_get(sc, "enum");
    if (en) {
        bool any = false;
        size_t i;
        const json_t *e;
        json_array_foreach(en, i, e) any = any || json_equal(e, v);
        if (!any) return false;
    }
    if (json_is_object(v)) {
        const json_t *props = json_object_get(sc, "properties"), *req = json_object_get(sc, "required");
        const char *k;
        const json_t *x;
        json_object_foreach((json_t *)v, k, x) {
            const json_t *ps = json_object_get(props, k);
            if (ps && !valid(ps, x)) return false;
            if (!ps && json_is_false(json_object_get(sc, "additionalProperties"))) return false;
        }
        size_t i;
        json_array_foreach(req, i, x) if (!json_object_get(v, json_string_value(x))) return false;
    }
    if (json_is_array(v) && json_object_get(sc, "items")) {
        size_t i;
        const json_t *x;
        json_array_foreach(v, i, x) if (!valid(json_object_get(sc, "items"), x)) return false;
    }
    return true;
}

#endif
