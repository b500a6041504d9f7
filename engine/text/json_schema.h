/* Tool parameter schemas: the JSON Schema subset ds41 validates and constrains generation to.
 *
 * A tool's `function.parameters` is compiled into a small tree of nodes.  Supported keywords:
 *   type         "object", "array", "string", "number", "integer", "boolean", "null", or a
 *                non-empty array of them without repeats ("integer" within "number" is number);
 *                absent: object when "properties" is given, array when "items" is, the enum's
 *                types when "enum"/"const" is, else any JSON value
 *   properties   object of property name -> schema (at most DS41_SCHEMA_MAX_PROPS per object;
 *                names 1..256 bytes of UTF-8 without '"', '\\', '<', '>', control characters or
 *                the DSML marker "｜DSML｜", so they are written unescaped in DSML and JSON)
 *   required     array of distinct names, each one of "properties"
 *   additionalProperties  true or false (a schema is not supported).  Generation writes only
 *                declared properties; an object schema without "properties" that does not say
 *                false accepts any keys with any values
 *   items        one schema (tuple arrays are not supported); absent: any values
 *   enum, const  non-empty list of JSON values of the declared type(s) (const = a one-value enum)
 *   nullable     true adds "null" (the OpenAPI spelling)
 * Annotations are ignored: description, title, default, examples, format, $schema, $id,
 * $comment, deprecated, readOnly, writeOnly, and keywords JSON Schema does not define.
 * Assertions ds41 does not enforce are refused rather than silently dropped: anyOf, oneOf,
 * allOf, not, $ref, $defs, definitions, pattern, patternProperties, minLength, maxLength,
 * minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf, minItems, maxItems,
 * uniqueItems, minProperties, maxProperties, prefixItems, contains, if/then/else, dependencies,
 * dependentRequired, dependentSchemas, propertyNames, unevaluatedProperties, unevaluatedItems,
 * additionalItems.  Nesting deeper than DS41_SCHEMA_MAX_DEPTH is refused.  The top level must be
 * an object schema (its properties are the DSML parameters); an absent `parameters` is an object
 * without properties.
 *
 * Matching (ds41_json_match) is byte by byte and never accepts a byte after which no valid
 * completion exists, so a constrained generation cannot paint itself into a corner.  It accepts
 * only JSON that jansson and Python parse back: strings of well-formed UTF-8 without control
 * characters, \u escapes that are neither 0000 nor surrogates, integers and fractions of at most
 * 18 digits, exponents of at most 2 digits, whitespace runs of at most 16 bytes between tokens (a
 * value matcher: ws_max), strings of at most str_max bytes (a value matcher; 0: no limit), objects
 * with each property at most once and '}' only once every required property is present.
 * Values may not contain the DSML marker "｜DSML｜" (it would end the DSML parameter).
 *
 * Thread safety: a compiled schema is immutable; matchers are plain values. */
#ifndef DS41_ENGINE_JSON_SCHEMA_H
#define DS41_ENGINE_JSON_SCHEMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "config/error.h"

#define DS41_SCHEMA_MAX_DEPTH 16 /* nested schemas (properties / items) */
#define DS41_SCHEMA_MAX_PROPS 64 /* properties of one object */
#define DS41_SCHEMA_MAX_NODES 4096
#define DS41_JSON_MATCH_DEPTH 32 /* nested arrays / objects while matching (free values too) */

typedef struct ds41_schema ds41_schema;

/* Compiles a tool's parameters schema (NULL = no parameters).  path names it in messages
 * ("tools[2].function.parameters").  On failure *out is NULL, err says "PATH: why" and
 * err_path (if not NULL, err_path_cap bytes) receives the path of the offending field, e.g.
 * "tools[2].function.parameters.properties.city.type". */
int ds41_schema_compile(const json_t *params, const char *path, ds41_schema **out, char *err_path,
                        size_t err_path_cap, ds41_error *err);
/* A whole JSON document's schema (structured output): as ds41_schema_compile, but the top level
 * may be any schema of the subset ({} or NULL: any JSON value). */
int ds41_schema_compile_value(const json_t *schema, const char *path, ds41_schema **out, char *err_path,
                              size_t err_path_cap, ds41_error *err);
/* A response format: {"type": "text"} or NULL (*out NULL: nothing to enforce), {"type":
 * "json_object"} (any JSON object), {"type": "json_schema", "json_schema": {"schema": S}} (chat
 * completions) or {"type": "json_schema", "schema": S} (the Responses API's text.format): S as
 * ds41_schema_compile_value (absent: any JSON value).  path names the format
 * ("response_format"); refusals name the keyword's path as ds41_schema_compile's do. */
int ds41_schema_compile_format(const json_t *format, const char *path, ds41_schema **out, char *err_path,
                               size_t err_path_cap, ds41_error *err);
void ds41_schema_free(ds41_schema *s);
/* An upper bound on how much one byte fed to a matcher of s can lengthen its shortest completion
 * (ds41_json_match_completion): a budget check may skip tokens that cannot come near it. */
size_t ds41_schema_step_growth(const ds41_schema *s);

/* The top-level properties (DSML parameters), in the schema's order. */
size_t ds41_schema_n_params(const ds41_schema *s);
const char *ds41_schema_param_name(const ds41_schema *s, size_t i);
bool ds41_schema_param_required(const ds41_schema *s, size_t i);
/* The parameter may be written string="true" (a raw string: its schema allows strings) /
 * string="false" (JSON: its schema allows a type other than string). */
bool ds41_schema_param_raw_ok(const ds41_schema *s, size_t i);
bool ds41_schema_param_json_ok(const ds41_schema *s, size_t i);

/* A matcher over one DSML parameter value: raw (string="true": the string's text itself) or
 * JSON (string="false").  Copy it by value or with ds41_json_match_copy (faster: only the
 * frames in use). */
typedef struct ds41_json_frame {
    uint16_t node;
    uint8_t kind; /* array / object */
    uint8_t st;
    uint16_t key;  /* object: the property whose value is open (UINT16_MAX: a free key) */
    uint64_t seen; /* object: properties present */
} ds41_json_frame;

typedef struct ds41_json_match {
    const ds41_schema *s;
    uint16_t root;
    uint8_t raw, done, ws, depth, ws_max;
    uint8_t lex, esc, u8need, u8lo, u8hi, numst, ndig, int_only, dead;
    uint16_t lnode, hexval;
    uint16_t str_max, slen; /* value matchers: the string length bound; bytes of the open string */
    uint32_t lo, hi, pos;
    ds41_json_frame f[DS41_JSON_MATCH_DEPTH];
} ds41_json_match;

void ds41_json_match_init(ds41_json_match *m, const ds41_schema *s, size_t param, bool raw);
/* A matcher over a whole document of a ds41_schema_compile_value / _format schema: at most ws_max
 * whitespace bytes in a row (at most 16), strings of at most str_max bytes (0: no limit). */
void ds41_json_match_init_value(ds41_json_match *m, const ds41_schema *s, unsigned ws_max, unsigned str_max);
void ds41_json_match_copy(ds41_json_match *dst, const ds41_json_match *src);
/* Feeds one byte; false (and the matcher dead) when no valid value continues with it. */
bool ds41_json_match_byte(ds41_json_match *m, unsigned char c);
/* What was fed is a whole valid value (a number or enum value may still grow). */
bool ds41_json_match_complete(const ds41_json_match *m);
/* Inside a string (a value or a free key): the bytes of the open string so far (slen). */
bool ds41_json_match_in_string(const ds41_json_match *m);
/* The shortest bytes that make what was fed a whole valid value: writes up to cap bytes to out
 * (out may be NULL with cap 0) and returns the full length. */
size_t ds41_json_match_completion(const ds41_json_match *m, char *out, size_t cap);

/* The shortest valid value of a parameter (raw or JSON), as ds41_json_match_completion of a
 * fresh matcher. */
size_t ds41_schema_param_min(const ds41_schema *s, size_t param, bool raw, char *out, size_t cap);

#endif
