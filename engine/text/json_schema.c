/* Tool parameter schemas and the byte-level JSON matcher (see json_schema.h). */
#include "engine/text/json_schema.h"

#include "config/json_util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { T_NULL = 1, T_BOOL = 2, T_INT = 4, T_NUM = 8, T_STR = 16, T_ARR = 32, T_OBJ = 64, T_ALL = 127 };

#define ANY 0 /* node 0: any JSON value */
#define NO_KEY UINT16_MAX
#define WS_MAX 16
#define INT_DIGITS 18
#define EXP_DIGITS 2
#define FRAC_DIGITS 18
#define DSML_MARK "｜DSML｜"

typedef struct text {
    char *s;
    size_t len;
} text;

typedef struct snode {
    uint8_t types;
    bool free_keys;          /* object: any key, any value */
    uint16_t items;          /* array: the items' node */
    uint32_t prop0, nprops;  /* props[prop0 .. +nprops), sorted by name */
    uint32_t enum0, nenum;   /* enums[]: compact JSON texts, sorted */
    uint32_t renum0, nrenum; /* enums[]: the string values' raw texts, sorted */
    size_t min_len;          /* shortest JSON instance */
    size_t min_raw;          /* shortest raw string (T_STR only) */
} snode;

typedef struct sprop {
    text name;
    uint16_t node;
    bool required;
} sprop;

struct ds41_schema {
    snode *nodes;
    size_t n_nodes, cap_nodes;
    sprop *props;
    size_t n_props, cap_props;
    text *enums;
    size_t n_enums, cap_enums;
    uint16_t root;
    size_t *order; /* the root's properties in schema order: indexes into props */
    size_t n_order;
};

/* ---- compile ---------------------------------------------------------------------------------- */

typedef struct cctx {
    ds41_schema *s;
    ds41_error *err;
    char *err_path;
    size_t err_path_cap;
} cctx;

static int cfail(cctx *c, const char *path, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int cfail(cctx *c, const char *path, const char *fmt, ...) {
    char msg[DS41_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->err_path && c->err_path_cap) snprintf(c->err_path, c->err_path_cap, "%s", path);
    return ds41_fail(c->err, "%s: %s", path, msg);
}

static int text_cmp(const void *a, const void *b) {
    const text *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int r = memcmp(x->s, y->s, n);
    return r ? r : (x->len > y->len) - (x->len < y->len);
}

static int prop_cmp(const void *a, const void *b) {
    return text_cmp(&((const sprop *)a)->name, &((const sprop *)b)->name);
}

static void *grow(void *p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return p;
    size_t nc = *cap ? *cap * 2 : 8;
    while (nc < need) nc *= 2;
    void *q = realloc(p, nc * elem);
    if (q) *cap = nc;
    return q;
}

static int new_node(cctx *c, const char *path, uint16_t *out) {
    ds41_schema *s = c->s;
    if (s->n_nodes >= DS41_SCHEMA_MAX_NODES)
        return cfail(c, path, "more than %d schemas in all", DS41_SCHEMA_MAX_NODES);
    snode *n = grow(s->nodes, &s->cap_nodes, s->n_nodes + 1, sizeof *n);
    if (!n) return ds41_fail(c->err, "out of memory");
    s->nodes = n;
    memset(&n[s->n_nodes], 0, sizeof *n);
    *out = (uint16_t)s->n_nodes++;
    return 0;
}

static int add_enum(cctx *c, const char *s, size_t len) {
    text *e = grow(c->s->enums, &c->s->cap_enums, c->s->n_enums + 1, sizeof *e);
    if (!e) return ds41_fail(c->err, "out of memory");
    c->s->enums = e;
    char *d = malloc(len + 1);
    if (!d) return ds41_fail(c->err, "out of memory");
    memcpy(d, s, len);
    d[len] = 0;
    e[c->s->n_enums++] = (text){d, len};
    return 0;
}

static uint8_t type_bit(const char *t) {
    static const char *const names[] = {"null", "boolean", "integer", "number", "string", "array", "object"};
    for (int i = 0; i < 7; i++)
        if (strcmp(t, names[i]) == 0) return (uint8_t)(1u << i);
    return 0;
}

static uint8_t value_types(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_NULL:
        return T_NULL;
    case JSON_TRUE:
    case JSON_FALSE:
        return T_BOOL;
    case JSON_INTEGER:
        return T_INT | T_NUM;
    case JSON_REAL:
        return T_NUM;
    case JSON_STRING:
        return T_STR;
    case JSON_ARRAY:
        return T_ARR;
    case JSON_OBJECT:
        return T_OBJ;
    }
    return 0;
}

static bool name_ok(const char *s, size_t n) {
    if (n == 0 || n > 256) return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch < 0x20 || ch == 0x7f || ch == '"' || ch == '\\' || ch == '<' || ch == '>') return false;
    }
    return memmem(s, n, DSML_MARK, strlen(DSML_MARK)) == NULL;
}

/* Paths are cut when they do not fit (vsnprintf: a cut path is still a useful message). */
static void pathf(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void pathf(char *out, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, cap, fmt, ap);
    va_end(ap);
}

static void join(char *out, size_t cap, const char *a, const char *b) {
    pathf(out, cap, "%s.%s", a, b);
}

static const char *const UNSUPPORTED[] = {"anyOf",
                                          "oneOf",
                                          "allOf",
                                          "not",
                                          "$ref",
                                          "$defs",
                                          "definitions",
                                          "pattern",
                                          "patternProperties",
                                          "minLength",
                                          "maxLength",
                                          "minimum",
                                          "maximum",
                                          "exclusiveMinimum",
                                          "exclusiveMaximum",
                                          "multipleOf",
                                          "minItems",
                                          "maxItems",
                                          "uniqueItems",
                                          "minProperties",
                                          "maxProperties",
                                          "prefixItems",
                                          "contains",
                                          "if",
                                          "then",
                                          "else",
                                          "dependencies",
                                          "dependentRequired",
                                          "dependentSchemas",
                                          "propertyNames",
                                          "unevaluatedProperties",
                                          "unevaluatedItems",
                                          "additionalItems",
                                          NULL};

static size_t minz(size_t a, size_t b) {
    return a < b ? a : b;
}

static int compile_node(cctx *c, const json_t *j, const char *path, int depth, uint16_t *out);

/* Sorts enums[e0..) and drops repeats (matching narrows sorted ranges); returns how many stay. */
static size_t sort_unique(ds41_schema *s, size_t e0) {
    size_t n = s->n_enums - e0, w = 0;
    qsort(s->enums + e0, n, sizeof *s->enums, text_cmp);
    for (size_t k = 0; k < n; k++) {
        text *e = &s->enums[e0 + k];
        if (w && text_cmp(&s->enums[e0 + w - 1], e) == 0) {
            free(e->s);
            continue;
        }
        s->enums[e0 + w++] = *e;
    }
    s->n_enums = e0 + w;
    return w;
}

static int compile_enum(cctx *c, const json_t *list, const char *path, uint8_t types, snode *tmp) {
    size_t i;
    const json_t *v;
    size_t e0 = c->s->n_enums;
    json_array_foreach(list, i, v) {
        char p[512];
        pathf(p, sizeof p, "%s[%zu]", path, i);
        if (!(value_types(v) & types)) return cfail(c, p, "the value is not of the schema's type");
        char *d = ds41_json_dump(v, NULL);
        if (!d) return cfail(c, p, "the value cannot be written as JSON (nested too deep?)");
        size_t dl = strlen(d);
        int bad = memmem(d, dl, DSML_MARK, strlen(DSML_MARK)) != NULL;
        int rc = bad ? 0 : add_enum(c, d, dl);
        free(d);
        if (bad) return cfail(c, p, "enum values may not contain the DSML marker");
        if (rc) return -1;
    }
    tmp->enum0 = (uint32_t)e0;
    tmp->nenum = (uint32_t)sort_unique(c->s, e0);
    /* raw forms of the string values */
    size_t r0 = c->s->n_enums;
    json_array_foreach(list, i, v) {
        if (!json_is_string(v)) continue;
        const char *sv = json_string_value(v);
        size_t sl = json_string_length(v);
        if (memchr(sv, 0, sl)) continue; /* not writable raw */
        if (add_enum(c, sv, sl)) return -1;
    }
    tmp->renum0 = (uint32_t)r0;
    tmp->nrenum = (uint32_t)sort_unique(c->s, r0);
    return 0;
}

static int compile_node(cctx *c, const json_t *j, const char *path, int depth, uint16_t *out) {
    if (!json_is_object(j)) return cfail(c, path, "a schema must be an object");
    if (depth > DS41_SCHEMA_MAX_DEPTH)
        return cfail(c, path, "schemas nested deeper than %d", DS41_SCHEMA_MAX_DEPTH);
    char p[512];
    for (int k = 0; UNSUPPORTED[k]; k++) {
        if (json_object_get(j, UNSUPPORTED[k])) {
            join(p, sizeof p, path, UNSUPPORTED[k]);
            return cfail(c, p,
                         "'%s' is not supported (supported: type, properties, required, enum, const, items, "
                         "additionalProperties, nullable)",
                         UNSUPPORTED[k]);
        }
    }
    snode tmp = {0};
    const json_t *type = json_object_get(j, "type"), *props = json_object_get(j, "properties"),
                 *req = json_object_get(j, "required"), *en = json_object_get(j, "enum"),
                 *cn = json_object_get(j, "const"), *items = json_object_get(j, "items"),
                 *addl = json_object_get(j, "additionalProperties"),
                 *nullable = json_object_get(j, "nullable");
    join(p, sizeof p, path, "type");
    if (type) {
        if (json_is_string(type)) {
            tmp.types = type_bit(json_string_value(type));
            if (!tmp.types) return cfail(c, p, "unknown type '%s'", json_string_value(type));
        } else if (json_is_array(type) && json_array_size(type) > 0) {
            size_t i;
            const json_t *t;
            json_array_foreach(type, i, t) {
                char pi[530];
                pathf(pi, sizeof pi, "%s[%zu]", p, i);
                uint8_t b = json_is_string(t) ? type_bit(json_string_value(t)) : 0;
                if (!b)
                    return cfail(c, pi,
                                 "not a type name (null, boolean, integer, number, string, array, object)");
                if (tmp.types & b) return cfail(c, pi, "type '%s' is repeated", json_string_value(t));
                tmp.types |= b;
            }
        } else {
            return cfail(c, p, "must be a type name or a non-empty array of them");
        }
    }
    if (nullable && !json_is_boolean(nullable)) {
        join(p, sizeof p, path, "nullable");
        return cfail(c, p, "must be true or false");
    }
    if (en && cn) {
        join(p, sizeof p, path, "const");
        return cfail(c, p, "'enum' and 'const' together are not supported");
    }
    if (en && (!json_is_array(en) || json_array_size(en) == 0)) {
        join(p, sizeof p, path, "enum");
        return cfail(c, p, "must be a non-empty array");
    }
    if (!tmp.types) {
        if (props)
            tmp.types = T_OBJ;
        else if (items)
            tmp.types = T_ARR;
        else if (en || cn) {
            size_t i;
            const json_t *v;
            if (cn)
                tmp.types = value_types(cn);
            else
                json_array_foreach(en, i, v) tmp.types |= value_types(v);
        } else
            tmp.types = T_ALL;
    }
    if (nullable && json_is_true(nullable)) tmp.types |= T_NULL;
    if (tmp.types & T_INT && tmp.types & T_NUM) tmp.types &= (uint8_t)~T_INT;
    uint8_t vtypes = tmp.types & T_NUM ? (uint8_t)(tmp.types | T_INT) : tmp.types;
    if (en || cn) {
        join(p, sizeof p, path, en ? "enum" : "const");
        json_t *list = en ? json_incref((json_t *)en) : json_pack("[O]", cn);
        if (!list) return ds41_fail(c->err, "out of memory");
        int rc = cn && !(value_types(cn) & vtypes) ? cfail(c, p, "the value is not of the schema's type")
                                                   : compile_enum(c, list, p, vtypes, &tmp);
        json_decref(list);
        if (rc) return -1;
    }
    if (addl && !json_is_boolean(addl)) {
        join(p, sizeof p, path, "additionalProperties");
        return cfail(c, p, "only true or false is supported");
    }
    if (props && !json_is_object(props)) {
        join(p, sizeof p, path, "properties");
        return cfail(c, p, "must be an object");
    }
    if (props && json_object_size(props) > DS41_SCHEMA_MAX_PROPS) {
        join(p, sizeof p, path, "properties");
        return cfail(c, p, "more than %d properties", DS41_SCHEMA_MAX_PROPS);
    }
    if (req && !json_is_array(req)) {
        join(p, sizeof p, path, "required");
        return cfail(c, p, "must be an array of property names");
    }
    if (items && !json_is_object(items)) {
        join(p, sizeof p, path, "items");
        return cfail(c, p,
                     json_is_array(items) ? "tuple 'items' (an array) is not supported"
                                          : "must be a schema (an object)");
    }
    uint16_t me;
    if (new_node(c, path, &me)) return -1;
    /* children */
    tmp.items = ANY;
    if (items) {
        join(p, sizeof p, path, "items");
        if (compile_node(c, items, p, depth + 1, &tmp.items)) return -1;
    }
    size_t np = props ? json_object_size(props) : 0;
    tmp.free_keys = np == 0 && !json_is_false(addl);
    if (np) {
        /* children first (they append props of their own), then this object's block */
        uint16_t kids[DS41_SCHEMA_MAX_PROPS];
        const char *names[DS41_SCHEMA_MAX_PROPS];
        size_t k = 0;
        const char *key;
        const json_t *sub;
        char pp[512];
        join(pp, sizeof pp, path, "properties");
        json_object_foreach((json_t *)props, key, sub) {
            pathf(p, sizeof p, "%s.%s", pp, key);
            if (!name_ok(key, strlen(key)))
                return cfail(c, p,
                             "property names must be 1..256 bytes without '\"', '\\\\', '<', '>', control "
                             "characters or the DSML marker");
            if (compile_node(c, sub, p, depth + 1, &kids[k])) return -1;
            names[k++] = key;
        }
        ds41_schema *s = c->s;
        sprop *pr = grow(s->props, &s->cap_props, s->n_props + np, sizeof *pr);
        if (!pr) return ds41_fail(c->err, "out of memory");
        s->props = pr;
        tmp.prop0 = (uint32_t)s->n_props;
        tmp.nprops = (uint32_t)np;
        for (size_t i = 0; i < np; i++) {
            size_t l = strlen(names[i]);
            char *d = malloc(l + 1);
            if (!d) return ds41_fail(c->err, "out of memory");
            memcpy(d, names[i], l + 1);
            s->props[s->n_props++] = (sprop){.name = {d, l}, .node = kids[i]};
        }
    }
    if (req) {
        size_t i;
        const json_t *r;
        json_array_foreach(req, i, r) {
            pathf(p, sizeof p, "%s.required[%zu]", path, i);
            if (!json_is_string(r)) return cfail(c, p, "must be a property name");
            const char *rn = json_string_value(r);
            sprop *hit = NULL;
            for (uint32_t q = 0; q < tmp.nprops; q++)
                if (strcmp(c->s->props[tmp.prop0 + q].name.s, rn) == 0) hit = &c->s->props[tmp.prop0 + q];
            if (!hit) return cfail(c, p, "'%s' is not one of the properties", rn);
            if (hit->required) return cfail(c, p, "'%s' is listed twice", rn);
            hit->required = true;
        }
        if (json_array_size(req) && !(tmp.types & T_OBJ)) {
            pathf(p, sizeof p, "%s.required", path);
            return cfail(c, p, "'required' on a schema that does not allow objects");
        }
    }
    c->s->nodes[me] = tmp;
    *out = me;
    return 0;
}

/* Shortest instances, bottom up (children have higher indexes than their parent). */
static void compute_min(ds41_schema *s) {
    for (size_t i = s->n_nodes; i-- > 0;) {
        snode *n = &s->nodes[i];
        size_t m = SIZE_MAX;
        if (n->nenum) {
            for (uint32_t k = 0; k < n->nenum; k++) m = minz(m, s->enums[n->enum0 + k].len);
        } else {
            if (n->types & (T_INT | T_NUM)) m = minz(m, 1);
            if (n->types & T_STR) m = minz(m, 2);
            if (n->types & T_ARR) m = minz(m, 2);
            if (n->types & T_NULL) m = minz(m, 4);
            if (n->types & T_BOOL) m = minz(m, 4);
            if (n->types & T_OBJ) {
                size_t o = 2, nr = 0;
                for (uint32_t k = 0; k < n->nprops; k++) {
                    const sprop *pr = &s->props[n->prop0 + k];
                    if (!pr->required) continue;
                    o += (nr++ ? 1 : 0) + pr->name.len + 3 + s->nodes[pr->node].min_len;
                }
                m = minz(m, o);
            }
        }
        n->min_len = m;
        n->min_raw = SIZE_MAX;
        if (n->types & T_STR) {
            if (n->nenum) {
                for (uint32_t k = 0; k < n->nrenum; k++)
                    n->min_raw = minz(n->min_raw, s->enums[n->renum0 + k].len);
            } else {
                n->min_raw = 0;
            }
        }
    }
}

static int compile_root(const json_t *params, const char *path, bool object_root, ds41_schema **out,
                        char *err_path, size_t err_path_cap, ds41_error *err) {
    *out = NULL;
    if (err_path && err_path_cap) err_path[0] = 0;
    ds41_schema *s = calloc(1, sizeof *s);
    if (!s) return ds41_fail(err, "out of memory");
    cctx c = {s, err, err_path, err_path_cap};
    uint16_t any;
    if (new_node(&c, path, &any)) goto fail;
    s->nodes[any] = (snode){.types = T_ALL, .free_keys = true, .items = ANY};
    json_t *empty = NULL;
    if (!params) params = empty = json_pack("{s:s}", "type", "object");
    if (!params) {
        ds41_fail(err, "out of memory");
        goto fail;
    }
    int rc = compile_node(&c, params, path, 1, &s->root);
    json_decref(empty);
    if (rc) goto fail;
    snode *r = &s->nodes[s->root];
    if (object_root && (r->types != T_OBJ || r->nenum)) {
        char p[512];
        join(p, sizeof p, path, r->nenum ? "enum" : "type");
        cfail(&c, p, "the parameters must be an object schema (\"type\": \"object\")");
        goto fail;
    }
    /* the root's parameters in schema order, then every object's properties sorted by name */
    s->order = malloc((r->nprops + 1) * sizeof *s->order);
    if (!s->order) {
        ds41_fail(err, "out of memory");
        goto fail;
    }
    for (size_t n = 0; n < s->n_nodes; n++) {
        snode *nd = &s->nodes[n];
        if (nd->nprops) qsort(s->props + nd->prop0, nd->nprops, sizeof *s->props, prop_cmp);
    }
    /* schema order of the root: by the parameters object's iteration order */
    const json_t *props = json_object_get(params ? params : NULL, "properties");
    const char *key;
    const json_t *sub;
    if (json_is_object(props) && r->nprops) {
        json_object_foreach((json_t *)props, key, sub) {
            for (uint32_t k = 0; k < r->nprops; k++)
                if (strcmp(s->props[r->prop0 + k].name.s, key) == 0) s->order[s->n_order++] = r->prop0 + k;
        }
    }
    compute_min(s);
    *out = s;
    return 0;
fail:
    ds41_schema_free(s);
    return -1;
}

int ds41_schema_compile(const json_t *params, const char *path, ds41_schema **out, char *err_path,
                        size_t err_path_cap, ds41_error *err) {
    return compile_root(params, path, true, out, err_path, err_path_cap, err);
}

int ds41_schema_compile_value(const json_t *schema, const char *path, ds41_schema **out, char *err_path,
                              size_t err_path_cap, ds41_error *err) {
    return compile_root(schema, path, false, out, err_path, err_path_cap, err);
}

int ds41_schema_compile_format(const json_t *format, const char *path, ds41_schema **out, char *err_path,
                               size_t err_path_cap, ds41_error *err) {
    *out = NULL;
    if (err_path && err_path_cap) err_path[0] = 0;
    if (!format || json_is_null(format)) return 0;
    const char *type = json_string_value(json_object_get(format, "type"));
    if (!json_is_object(format) || !type) {
        if (err_path && err_path_cap) snprintf(err_path, err_path_cap, "%s.type", path);
        return ds41_fail(err, "%s.type: must be 'text', 'json_object' or 'json_schema'", path);
    }
    if (strcmp(type, "text") == 0) return 0;
    char p[512];
    if (strcmp(type, "json_object") == 0) {
        json_t *obj = json_pack("{s:s}", "type", "object");
        if (!obj) return ds41_fail(err, "out of memory");
        int rc = compile_root(obj, path, false, out, err_path, err_path_cap, err);
        json_decref(obj);
        return rc;
    }
    if (strcmp(type, "json_schema") == 0) {
        /* chat completions nest it ({"json_schema": {"schema": ...}}); the Responses API's
         * text.format has it at the top ({"type": "json_schema", "schema": ...}) */
        const json_t *schema = json_object_get(format, "schema");
        join(p, sizeof p, path, "schema");
        const json_t *js = json_object_get(format, "json_schema");
        if (json_is_object(js)) {
            schema = json_object_get(js, "schema");
            join(p, sizeof p, path, "json_schema.schema");
        }
        json_t *any = NULL;
        if (!schema) schema = any = json_object(); /* no schema: any JSON value */
        if (!schema) return ds41_fail(err, "out of memory");
        int rc = compile_root(schema, p, false, out, err_path, err_path_cap, err);
        json_decref(any);
        return rc;
    }
    if (err_path && err_path_cap) snprintf(err_path, err_path_cap, "%s.type", path);
    return ds41_fail(err, "%s.type: must be 'text', 'json_object' or 'json_schema', not '%s'", path, type);
}

/* The most one byte fed to a matcher can lengthen its shortest completion: opening a value's
 * object (its required properties), a key (the property's name and shortest value), an array
 * item, and a few bytes for escapes, UTF-8 sequences and numbers. */
size_t ds41_schema_step_growth(const ds41_schema *s) {
    size_t d = 8, name = 0;
    for (size_t i = 0; i < s->n_props; i++)
        if (s->props[i].name.len > name) name = s->props[i].name.len;
    for (size_t i = 0; i < s->n_nodes; i++) {
        const snode *n = &s->nodes[i];
        size_t b = 5; /* "false" */
        for (uint32_t k = 0; k < n->nenum; k++)
            if (s->enums[n->enum0 + k].len > b) b = s->enums[n->enum0 + k].len;
        if (n->types & T_OBJ) {
            size_t o = 2;
            for (uint32_t k = 0; k < n->nprops; k++) {
                const sprop *pr = &s->props[n->prop0 + k];
                if (pr->required) o += 1 + pr->name.len + 3 + s->nodes[pr->node].min_len;
            }
            if (o > b) b = o;
        }
        if (b + name + 8 > d) d = b + name + 8;
    }
    return d;
}

void ds41_schema_free(ds41_schema *s) {
    if (!s) return;
    for (size_t i = 0; i < s->n_props; i++) free(s->props[i].name.s);
    for (size_t i = 0; i < s->n_enums; i++) free(s->enums[i].s);
    free(s->props);
    free(s->enums);
    free(s->nodes);
    free(s->order);
    free(s);
}

size_t ds41_schema_n_params(const ds41_schema *s) {
    return s->n_order;
}
const char *ds41_schema_param_name(const ds41_schema *s, size_t i) {
    return s->props[s->order[i]].name.s;
}
bool ds41_schema_param_required(const ds41_schema *s, size_t i) {
    return s->props[s->order[i]].required;
}
static const snode *param_node(const ds41_schema *s, size_t i) {
    return &s->nodes[s->props[s->order[i]].node];
}
bool ds41_schema_param_raw_ok(const ds41_schema *s, size_t i) {
    return param_node(s, i)->min_raw != SIZE_MAX;
}
bool ds41_schema_param_json_ok(const ds41_schema *s, size_t i) {
    const snode *n = param_node(s, i);
    if (n->nenum) return n->nrenum < n->nenum;
    return (n->types & (uint8_t)~T_STR) != 0;
}

/* ---- matching --------------------------------------------------------------------------------- */

enum { L_NONE = 0, L_STR, L_FKEY, L_KEY, L_NUM, L_LIT, L_ENUM, L_RAW, L_RAWENUM };
enum { K_OBJ = 1, K_ARR };
enum { O_FIRST = 0, O_INKEY, O_COLON, O_VAL, O_NEXT, O_KEY, A_FIRST, A_NEXT, A_VAL };
enum { N_SIGN = 0, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };

static const char *const LITS[3] = {"true", "false", "null"};

void ds41_json_match_init(ds41_json_match *m, const ds41_schema *s, size_t param, bool raw) {
    memset(m, 0, offsetof(ds41_json_match, f));
    m->s = s;
    m->root = s->props[s->order[param]].node;
    m->raw = raw;
    m->ws_max = WS_MAX;
    if (raw) {
        const snode *n = &s->nodes[m->root];
        m->lnode = m->root;
        if (n->nenum) {
            m->lex = L_RAWENUM;
            m->lo = n->renum0;
            m->hi = n->renum0 + n->nrenum;
        } else {
            m->lex = L_RAW;
        }
    }
}

void ds41_json_match_init_value(ds41_json_match *m, const ds41_schema *s, unsigned ws_max, unsigned str_max) {
    memset(m, 0, offsetof(ds41_json_match, f));
    m->s = s;
    m->root = s->root;
    m->ws_max = (uint8_t)(ws_max < WS_MAX ? ws_max : WS_MAX);
    m->str_max = (uint16_t)(str_max < UINT16_MAX ? str_max : UINT16_MAX);
}

void ds41_json_match_copy(ds41_json_match *dst, const ds41_json_match *src) {
    memcpy(dst, src, offsetof(ds41_json_match, f) + src->depth * sizeof src->f[0]);
}

static bool is_ws(unsigned char c) {
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

static const snode *N(const ds41_json_match *m, uint16_t i) {
    return &m->s->nodes[i];
}

/* UTF-8 inside a string: false when c cannot continue well-formed UTF-8. */
static bool utf8_byte(ds41_json_match *m, unsigned char c) {
    if (m->u8need) {
        if (c < m->u8lo || c > m->u8hi) return false;
        m->u8need--;
        m->u8lo = 0x80;
        m->u8hi = 0xBF;
        return true;
    }
    if (c < 0x80) return true;
    m->u8lo = 0x80;
    m->u8hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
        m->u8need = 1;
    else if (c >= 0xE0 && c <= 0xEF) {
        m->u8need = 2;
        if (c == 0xE0) m->u8lo = 0xA0;
        if (c == 0xED) m->u8hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        m->u8need = 3;
        if (c == 0xF0) m->u8lo = 0x90;
        if (c == 0xF4) m->u8hi = 0x8F;
    } else {
        return false;
    }
    return true;
}

static int hexv(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A JSON string's content byte (after the opening quote).  1: consumed, 0: rejected, 2: the
 * closing quote. */
static int string_byte(ds41_json_match *m, unsigned char c) {
    if (m->esc == 1) {
        if (c == 'u') {
            m->esc = 2;
            m->hexval = 0;
            return 1;
        }
        if (!strchr("\"\\/bfnrt", c) || !c) return 0;
        m->esc = 0;
        return 1;
    }
    if (m->esc >= 2) {
        int h = hexv(c);
        if (h < 0) return 0;
        m->hexval = (uint16_t)(m->hexval * 16 + h);
        m->esc++;
        if (m->esc == 4 && m->hexval >= 0xD8 && m->hexval <= 0xDF) return 0; /* a surrogate */
        if (m->esc == 6) {
            if (m->hexval == 0) return 0;
            m->esc = 0;
        }
        return 1;
    }
    if (m->u8need) return utf8_byte(m, c);
    if (c == '"') return 2;
    if (c == '\\') {
        m->esc = 1;
        return 1;
    }
    if (c < 0x20) return 0;
    return utf8_byte(m, c);
}

/* Narrow an enum / key range [lo, hi) to the texts whose byte pos is c. */
static bool narrow(const text *t, size_t stride_unused, uint32_t *lo, uint32_t *hi, uint32_t pos,
                   unsigned char c) {
    (void)stride_unused;
    uint32_t a = *lo, b = *hi;
    while (a < b && !(t[a].len > pos && (unsigned char)t[a].s[pos] == c)) a++;
    uint32_t e = a;
    while (e < b && t[e].len > pos && (unsigned char)t[e].s[pos] == c) e++;
    *lo = a;
    *hi = e;
    return a < e;
}

static const text *prop_name(const ds41_json_match *m, uint32_t i) {
    return &m->s->props[i].name;
}

/* The open object frame can still take a key (a declared property not present yet). */
static bool obj_key_left(const ds41_json_match *m, const ds41_json_frame *f) {
    const snode *n = N(m, f->node);
    if (n->free_keys) return true;
    for (uint32_t k = 0; k < n->nprops; k++)
        if (!(f->seen >> k & 1)) return true;
    return false;
}

static bool obj_req_done(const ds41_json_match *m, const ds41_json_frame *f) {
    const snode *n = N(m, f->node);
    for (uint32_t k = 0; k < n->nprops; k++)
        if (m->s->props[n->prop0 + k].required && !(f->seen >> k & 1)) return false;
    return true;
}

static void value_done(ds41_json_match *m) {
    m->lex = L_NONE;
    if (!m->depth) {
        m->done = 1;
        return;
    }
    ds41_json_frame *f = &m->f[m->depth - 1];
    if (f->kind == K_OBJ) {
        if (f->key != NO_KEY) f->seen |= (uint64_t)1 << (f->key - N(m, f->node)->prop0);
        f->st = O_NEXT;
    } else {
        f->st = A_NEXT;
    }
}

/* The start of a value of node n with byte c (not whitespace). */
static bool value_start(ds41_json_match *m, uint16_t ni, unsigned char c) {
    const snode *n = N(m, ni);
    m->lnode = ni;
    if (n->nenum) {
        m->lo = n->enum0;
        m->hi = n->enum0 + n->nenum;
        if (!narrow(m->s->enums, 0, &m->lo, &m->hi, 0, c)) return false;
        m->lex = L_ENUM;
        m->pos = 1;
        return true;
    }
    if ((c == '{' && n->types & T_OBJ) || (c == '[' && n->types & T_ARR)) {
        if (m->depth >= DS41_JSON_MATCH_DEPTH) return false;
        ds41_json_frame *f = &m->f[m->depth++];
        *f = (ds41_json_frame){
            .node = ni, .kind = c == '{' ? K_OBJ : K_ARR, .st = c == '{' ? O_FIRST : A_FIRST, .key = NO_KEY};
        return true;
    }
    if (c == '"' && n->types & T_STR) {
        m->lex = L_STR;
        m->esc = m->u8need = 0;
        m->slen = 0;
        return true;
    }
    if ((c == '-' || (c >= '0' && c <= '9')) && n->types & (T_INT | T_NUM)) {
        m->lex = L_NUM;
        m->int_only = !(n->types & T_NUM);
        m->numst = c == '-' ? N_SIGN : c == '0' ? N_ZERO : N_INT;
        m->ndig = c >= '1' && c <= '9';
        return true;
    }
    int li = c == 't' ? 0 : c == 'f' ? 1 : c == 'n' ? 2 : -1;
    if (li >= 0 && n->types & (li == 2 ? T_NULL : T_BOOL)) {
        m->lex = L_LIT;
        m->lo = (uint32_t)li;
        m->pos = 1;
        return true;
    }
    return false;
}

/* A number continues with c (1), ends before c (0, when complete) or is broken (-1). */
static int number_byte(ds41_json_match *m, unsigned char c) {
    bool dig = c >= '0' && c <= '9';
    switch (m->numst) {
    case N_SIGN:
        if (!dig) return -1;
        m->numst = c == '0' ? N_ZERO : N_INT;
        m->ndig = c != '0';
        return 1;
    case N_ZERO:
    case N_INT:
        if (dig && m->numst == N_INT) {
            if (m->ndig >= INT_DIGITS) return -1;
            m->ndig++;
            return 1;
        }
        if (dig) return -1; /* a leading zero */
        if (!m->int_only && c == '.') {
            m->numst = N_DOT;
            return 1;
        }
        if (!m->int_only && (c == 'e' || c == 'E')) {
            m->numst = N_E;
            return 1;
        }
        return 0;
    case N_DOT:
        if (!dig) return -1;
        m->numst = N_FRAC;
        m->ndig = 1;
        return 1;
    case N_FRAC:
        if (dig) {
            if (m->ndig >= FRAC_DIGITS) return -1;
            m->ndig++;
            return 1;
        }
        if (c == 'e' || c == 'E') {
            m->numst = N_E;
            return 1;
        }
        return 0;
    case N_E:
        if (c == '+' || c == '-') {
            m->numst = N_ESIGN;
            return 1;
        }
        /* fall through */
    case N_ESIGN:
        if (!dig) return -1;
        m->numst = N_EXP;
        m->ndig = 1;
        return 1;
    case N_EXP:
        if (dig) {
            if (m->ndig >= EXP_DIGITS) return -1;
            m->ndig++;
            return 1;
        }
        return 0;
    }
    return -1;
}

static bool number_final(const ds41_json_match *m) {
    return m->numst == N_ZERO || m->numst == N_INT || m->numst == N_FRAC || m->numst == N_EXP;
}

/* An enum value at lo of exactly pos bytes is complete. */
static bool enum_final(const ds41_json_match *m, const text *t) {
    return m->lo < m->hi && t[m->lo].len == m->pos;
}

static bool ws_byte(ds41_json_match *m) {
    if (m->ws >= m->ws_max) return false;
    m->ws++;
    return true;
}

static bool feed(ds41_json_match *m, unsigned char c) {
    const text *en = m->s->enums;
    switch (m->lex) {
    case L_RAW:
        if (!c) return false;
        return utf8_byte(m, c);
    case L_RAWENUM:
        if (!narrow(en, 0, &m->lo, &m->hi, m->pos, c)) return false;
        m->pos++;
        return true;
    case L_STR:
    case L_FKEY: {
        /* a bounded string ends once str_max bytes are written (an open escape or UTF-8
         * sequence may finish) */
        if (m->str_max && m->slen >= m->str_max && !m->esc && !m->u8need && c != '"') return false;
        int r = string_byte(m, c);
        if (r == 0) return false;
        m->slen++;
        if (r == 2) {
            if (m->lex == L_FKEY) {
                m->lex = L_NONE;
                m->f[m->depth - 1].st = O_COLON;
            } else {
                value_done(m);
            }
        }
        m->ws = 0;
        return true;
    }
    case L_KEY: {
        ds41_json_frame *f = &m->f[m->depth - 1];
        const snode *n = N(m, f->node);
        if (c == '"') {
            const text *t = prop_name(m, m->lo);
            if (m->lo >= m->hi || t->len != m->pos || (f->seen >> (m->lo - n->prop0) & 1)) return false;
            f->key = (uint16_t)m->lo;
            f->st = O_COLON;
            m->lex = L_NONE;
            return true;
        }
        uint32_t a = m->lo, b = m->hi;
        while (a < b && !(prop_name(m, a)->len > m->pos && (unsigned char)prop_name(m, a)->s[m->pos] == c))
            a++;
        uint32_t e = a;
        while (e < b && prop_name(m, e)->len > m->pos && (unsigned char)prop_name(m, e)->s[m->pos] == c) e++;
        bool alive = false;
        for (uint32_t k = a; k < e && !alive; k++) alive = !(f->seen >> (k - n->prop0) & 1);
        if (!alive) return false;
        m->lo = a;
        m->hi = e;
        m->pos++;
        return true;
    }
    case L_LIT: {
        const char *l = LITS[m->lo];
        if ((unsigned char)l[m->pos] != c) return false;
        m->pos++;
        if (!l[m->pos]) value_done(m);
        m->ws = 0;
        return true;
    }
    case L_NUM: {
        int r = number_byte(m, c);
        if (r < 0) return false;
        if (r == 1) return true;
        value_done(m); /* the number ended before c: c is structural */
        break;
    }
    case L_ENUM: {
        uint32_t lo = m->lo, hi = m->hi;
        if (narrow(en, 0, &lo, &hi, m->pos, c)) {
            m->lo = lo;
            m->hi = hi;
            m->pos++;
            return true;
        }
        if (!enum_final(m, en)) return false;
        value_done(m);
        break;
    }
    default:
        break;
    }
    /* structural */
    if (!m->depth) {
        if (is_ws(c)) return ws_byte(m);
        if (m->done) return false;
        m->ws = 0;
        return value_start(m, m->root, c);
    }
    if (is_ws(c)) return ws_byte(m);
    ds41_json_frame *f = &m->f[m->depth - 1];
    const snode *n = N(m, f->node);
    m->ws = 0;
    switch (f->st) {
    case O_FIRST:
    case O_KEY:
        if (c == '}' && f->st == O_FIRST) {
            if (!obj_req_done(m, f)) return false;
            m->depth--;
            value_done(m);
            return true;
        }
        if (c != '"') return false;
        f->st = O_INKEY;
        if (n->free_keys) {
            m->lex = L_FKEY;
            m->esc = m->u8need = 0;
            m->slen = 0;
        } else {
            m->lex = L_KEY;
            m->lo = n->prop0;
            m->hi = n->prop0 + n->nprops;
            m->pos = 0;
        }
        f->key = NO_KEY;
        return obj_key_left(m, f);
    case O_COLON:
        if (c != ':') return false;
        f->st = O_VAL;
        return true;
    case O_VAL:
        return value_start(m, f->key == NO_KEY ? ANY : m->s->props[f->key].node, c);
    case O_NEXT:
        if (c == ',') {
            if (!obj_key_left(m, f)) return false;
            f->st = O_KEY;
            return true;
        }
        if (c == '}' && obj_req_done(m, f)) {
            m->depth--;
            value_done(m);
            return true;
        }
        return false;
    case A_FIRST:
        if (c == ']') {
            m->depth--;
            value_done(m);
            return true;
        }
        return value_start(m, n->items, c);
    case A_VAL:
        return value_start(m, n->items, c);
    case A_NEXT:
        if (c == ',') {
            f->st = A_VAL;
            return true;
        }
        if (c == ']') {
            m->depth--;
            value_done(m);
            return true;
        }
        return false;
    default:
        return false;
    }
}

bool ds41_json_match_byte(ds41_json_match *m, unsigned char c) {
    if (m->dead) return false;
    if (!feed(m, c)) {
        m->dead = 1;
        return false;
    }
    return true;
}

bool ds41_json_match_in_string(const ds41_json_match *m) {
    return !m->dead && (m->lex == L_STR || m->lex == L_FKEY);
}

bool ds41_json_match_complete(const ds41_json_match *m) {
    if (m->dead) return false;
    if (m->lex == L_RAW) return m->u8need == 0;
    if (m->lex == L_RAWENUM) return enum_final(m, m->s->enums);
    if (m->depth) return false;
    if (m->done) return true;
    if (m->lex == L_NUM) return number_final(m);
    if (m->lex == L_ENUM) return enum_final(m, m->s->enums);
    return false;
}

/* ---- completion ------------------------------------------------------------------------------- */

typedef struct emit {
    char *out;
    size_t cap, n;
} emit;

static void put(emit *e, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++, e->n++)
        if (e->n < e->cap) e->out[e->n] = s[i];
}
static void putc1(emit *e, char c) {
    put(e, &c, 1);
}

static void min_text(const ds41_schema *s, uint16_t ni, emit *e);

static void min_object_rest(const ds41_schema *s, const snode *n, uint64_t seen, bool comma, emit *e) {
    for (uint32_t k = 0; k < n->nprops; k++) {
        const sprop *pr = &s->props[n->prop0 + k];
        if (!pr->required || (seen >> k & 1)) continue;
        if (comma) putc1(e, ',');
        comma = true;
        putc1(e, '"');
        put(e, pr->name.s, pr->name.len);
        put(e, "\":", 2);
        min_text(s, pr->node, e);
    }
    putc1(e, '}');
}

static void min_text(const ds41_schema *s, uint16_t ni, emit *e) {
    const snode *n = &s->nodes[ni];
    if (n->nenum) {
        const text *best = NULL;
        for (uint32_t k = 0; k < n->nenum; k++)
            if (!best || s->enums[n->enum0 + k].len < best->len) best = &s->enums[n->enum0 + k];
        put(e, best->s, best->len);
        return;
    }
    /* the same choice as compute_min, in its order of preference */
    if (n->types & (T_INT | T_NUM)) return putc1(e, '0');
    if (n->types & T_STR) return put(e, "\"\"", 2);
    if (n->types & T_ARR) return put(e, "[]", 2);
    size_t obj = SIZE_MAX;
    if (n->types & T_OBJ) {
        obj = 2;
        size_t nr = 0;
        for (uint32_t k = 0; k < n->nprops; k++) {
            const sprop *pr = &s->props[n->prop0 + k];
            if (pr->required) obj += (nr++ ? 1 : 0) + pr->name.len + 3 + s->nodes[pr->node].min_len;
        }
    }
    if (obj <= 4 || !(n->types & (T_NULL | T_BOOL))) {
        putc1(e, '{');
        return min_object_rest(s, n, 0, false, e);
    }
    if (n->types & T_NULL) return put(e, "null", 4);
    put(e, "true", 4);
}

/* The shortest text in [lo, hi) of texts longer than or as long as pos: its bytes from pos. */
static void enum_rest(const text *t, uint32_t lo, uint32_t hi, uint32_t pos, emit *e) {
    const text *best = NULL;
    for (uint32_t k = lo; k < hi; k++)
        if (t[k].len >= pos && (!best || t[k].len < best->len)) best = &t[k];
    if (best) put(e, best->s + pos, best->len - pos);
}

static void string_rest(const ds41_json_match *m, emit *e) {
    for (int k = 0; k < m->u8need; k++) putc1(e, (char)(k == 0 ? m->u8lo : 0x80));
    if (m->esc == 1) putc1(e, 'n');
    if (m->esc >= 2) {
        for (int k = m->esc; k < 6; k++) putc1(e, k == 5 && m->hexval == 0 ? '1' : '0');
    }
}

size_t ds41_json_match_completion(const ds41_json_match *m, char *out, size_t cap) {
    emit e = {out, cap, 0};
    const ds41_schema *s = m->s;
    if (m->dead) return SIZE_MAX;
    if (m->lex == L_RAW) {
        string_rest(m, &e);
        return e.n;
    }
    if (m->lex == L_RAWENUM) {
        enum_rest(s->enums, m->lo, m->hi, m->pos, &e);
        return e.n;
    }
    /* finish the open token; `closed` says the innermost frame's value (or key + value) is done */
    uint64_t extra_seen = 0;
    switch (m->lex) {
    case L_STR:
        string_rest(m, &e);
        putc1(&e, '"');
        break;
    case L_FKEY:
        string_rest(m, &e);
        put(&e, "\":0", 3);
        break;
    case L_KEY: {
        const ds41_json_frame *f = &m->f[m->depth - 1];
        const snode *n = &s->nodes[f->node];
        const sprop *best = NULL;
        size_t bl = SIZE_MAX;
        for (uint32_t k = m->lo; k < m->hi; k++) {
            const sprop *pr = &s->props[k];
            if (f->seen >> (k - n->prop0) & 1) continue;
            size_t l = pr->name.len + s->nodes[pr->node].min_len + (pr->required ? 0 : 1000000);
            if (l < bl) best = pr, bl = l;
        }
        if (!best) return SIZE_MAX;
        put(&e, best->name.s + m->pos, best->name.len - m->pos);
        put(&e, "\":", 2);
        min_text(s, best->node, &e);
        extra_seen = (uint64_t)1 << (best - s->props - n->prop0);
        break;
    }
    case L_NUM:
        if (!number_final(m)) putc1(&e, '0');
        break;
    case L_LIT:
        put(&e, LITS[m->lo] + m->pos, strlen(LITS[m->lo]) - m->pos);
        break;
    case L_ENUM:
        enum_rest(s->enums, m->lo, m->hi, m->pos, &e);
        break;
    default:
        break;
    }
    bool token_open = m->lex != L_NONE;
    if (!m->depth) {
        if (!m->done && !token_open) min_text(s, m->root, &e);
        return e.n;
    }
    for (int d = m->depth - 1; d >= 0; d--) {
        const ds41_json_frame *f = &m->f[d];
        const snode *n = &s->nodes[f->node];
        uint8_t st = f->st;
        uint64_t seen = f->seen;
        if (d == m->depth - 1 && token_open) {
            /* the open token finished this frame's pending value (or key + value) */
            if (f->kind == K_OBJ) {
                if (f->key != NO_KEY && st == O_VAL) seen |= (uint64_t)1 << (f->key - n->prop0);
                seen |= extra_seen;
                st = O_NEXT;
            } else {
                st = A_NEXT;
            }
        }
        if (d < m->depth - 1) {
            /* the inner frame closed this frame's value */
            if (f->kind == K_OBJ) {
                if (f->key != NO_KEY) seen |= (uint64_t)1 << (f->key - n->prop0);
                st = O_NEXT;
            } else {
                st = A_NEXT;
            }
        }
        switch (st) {
        case O_FIRST:
            min_object_rest(s, n, seen, false, &e);
            break;
        case O_NEXT:
            min_object_rest(s, n, seen, true, &e);
            break;
        case O_KEY: {
            /* after a comma: a required property if one is missing, else the cheapest */
            const sprop *best = NULL;
            size_t bl = SIZE_MAX;
            for (uint32_t k = 0; k < n->nprops; k++) {
                const sprop *pr = &s->props[n->prop0 + k];
                if (seen >> k & 1) continue;
                size_t l = pr->name.len + s->nodes[pr->node].min_len + (pr->required ? 0 : 1000000);
                if (l < bl) best = pr, bl = l;
            }
            if (best) {
                putc1(&e, '"');
                put(&e, best->name.s, best->name.len);
                put(&e, "\":", 2);
                min_text(s, best->node, &e);
                seen |= (uint64_t)1 << (best - s->props - n->prop0);
            } else {
                put(&e, "\"\":0", 4); /* free keys */
            }
            min_object_rest(s, n, seen, true, &e);
            break;
        }
        case O_COLON:
        case O_VAL:
            if (st == O_COLON) putc1(&e, ':');
            min_text(s, f->key == NO_KEY ? ANY : s->props[f->key].node, &e);
            if (f->key != NO_KEY) seen |= (uint64_t)1 << (f->key - n->prop0);
            min_object_rest(s, n, seen, true, &e);
            break;
        case A_FIRST:
        case A_NEXT:
            putc1(&e, ']');
            break;
        case A_VAL:
            min_text(s, n->items, &e);
            putc1(&e, ']');
            break;
        default:
            break;
        }
    }
    return e.n;
}

size_t ds41_schema_param_min(const ds41_schema *s, size_t param, bool raw, char *out, size_t cap) {
    ds41_json_match m;
    ds41_json_match_init(&m, s, param, raw);
    return ds41_json_match_completion(&m, out, cap);
}
