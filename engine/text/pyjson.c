#include "engine/text/pyjson.h"

#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

/* ---- the "C" numeric locale, for strtod and printf of doubles ---- */

static locale_t c_locale;
static pthread_once_t c_locale_once = PTHREAD_ONCE_INIT;

static void c_locale_init(void) {
    c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0);
}

static locale_t get_c_locale(void) {
    pthread_once(&c_locale_once, c_locale_init);
    return c_locale;
}

static double parse_double(const char *s) {
    locale_t loc = get_c_locale();
    if (loc) return strtod_l(s, NULL, loc);
    return strtod(s, NULL);
}

/* ---- Python float repr ---- */

/* Decimal digits of a candidate: value = 0.d[0]d[1]...d[n-1] x 10^decpt. */
typedef struct decimal {
    char d[24];
    int n;
    int decpt;
} decimal;

static bool decimal_round_trips(const decimal *c, double x) {
    char s[64];
    int k = 0;
    s[k++] = c->d[0];
    s[k++] = '.';
    for (int i = 1; i < c->n; i++) s[k++] = c->d[i];
    if (c->n == 1) s[k++] = '0';
    snprintf(s + k, sizeof s - (size_t)k, "e%d", c->decpt - 1);
    return parse_double(s) == x;
}

/* The n-digit decimal one unit (in its last place) above (+1) or below (-1) c.  Returns false when
 * the result has fewer digits (that length was already tried). */
static bool decimal_step(const decimal *c, int dir, decimal *out) {
    *out = *c;
    int i = out->n - 1;
    if (dir > 0) {
        while (i >= 0 && out->d[i] == '9') out->d[i--] = '0';
        if (i < 0) {
            out->d[0] = '1';
            for (int j = 1; j < out->n; j++) out->d[j] = '0';
            out->decpt++;
        } else {
            out->d[i]++;
        }
    } else {
        while (i >= 0 && out->d[i] == '0') out->d[i--] = '9';
        if (i < 0) return false;
        out->d[i]--;
        if (out->d[0] == '0') return false;
    }
    while (out->n > 1 && out->d[out->n - 1] == '0') out->n--;
    return true;
}

/* Shortest digits that read back as x (x finite, > 0), the closest to x among those: what
 * Python's repr (David Gay's dtoa, mode 0) produces.  For each length the correctly rounded
 * decimal (glibc's printf is exact) is tried, then its two neighbours, which can round-trip when
 * the closest does not (x at a power of two has a narrower interval below than above). */
static void shortest_decimal(double x, decimal *out) {
    for (int prec = 1; prec <= 17; prec++) {
        char s[48];
        snprintf(s, sizeof s, "%.*e", prec - 1, x);
        decimal c = {.n = 0};
        const char *p = s;
        for (; *p && *p != 'e'; p++)
            if (*p >= '0' && *p <= '9') c.d[c.n++] = *p;
        int e = (*p == 'e') ? atoi(p + 1) : 0;
        c.decpt = e + 1;
        decimal trimmed = c;
        while (trimmed.n > 1 && trimmed.d[trimmed.n - 1] == '0') trimmed.n--;
        if (decimal_round_trips(&trimmed, x)) {
            *out = trimmed;
            return;
        }
        for (int dir = -1; dir <= 1; dir += 2) {
            decimal nb;
            if (decimal_step(&c, dir, &nb) && nb.n == c.n && decimal_round_trips(&nb, x)) {
                *out = nb;
                return;
            }
        }
    }
    /* 17 significant digits always round-trip; not reached. */
    char s[48];
    snprintf(s, sizeof s, "%.16e", x);
    decimal c = {.n = 0};
    const char *p = s;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9') c.d[c.n++] = *p;
    c.decpt = atoi(p + 1) + 1;
    while (c.n > 1 && c.d[c.n - 1] == '0') c.n--;
    *out = c;
}

static void float_repr_locked(double x, ds41_buf *out) {
    if (isnan(x)) {
        ds41_buf_puts(out, "nan");
        return;
    }
    if (signbit(x)) ds41_buf_putc(out, '-');
    x = fabs(x);
    if (isinf(x)) {
        ds41_buf_puts(out, "inf");
        return;
    }
    if (x == 0) {
        ds41_buf_puts(out, "0.0");
        return;
    }
    decimal c;
    shortest_decimal(x, &c);
    if (c.decpt <= -4 || c.decpt > 16) {
        ds41_buf_putc(out, c.d[0]);
        if (c.n > 1) {
            ds41_buf_putc(out, '.');
            ds41_buf_put(out, c.d + 1, (size_t)c.n - 1);
        }
        int e = c.decpt - 1;
        ds41_buf_printf(out, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    } else if (c.decpt <= 0) {
        ds41_buf_puts(out, "0.");
        for (int i = 0; i < -c.decpt; i++) ds41_buf_putc(out, '0');
        ds41_buf_put(out, c.d, (size_t)c.n);
    } else if (c.decpt >= c.n) {
        ds41_buf_put(out, c.d, (size_t)c.n);
        for (int i = c.n; i < c.decpt; i++) ds41_buf_putc(out, '0');
        ds41_buf_puts(out, ".0");
    } else {
        ds41_buf_put(out, c.d, (size_t)c.decpt);
        ds41_buf_putc(out, '.');
        ds41_buf_put(out, c.d + c.decpt, (size_t)(c.n - c.decpt));
    }
}

void ds41_py_float_repr(double x, ds41_buf *out) {
    /* printf's decimal point follows LC_NUMERIC: format under "C". */
    locale_t loc = get_c_locale();
    locale_t old = loc ? uselocale(loc) : (locale_t)0;
    float_repr_locked(x, out);
    if (loc) uselocale(old);
}

/* ---- values ---- */

void ds41_py_free(ds41_py *v) {
    if (!v) return;
    free(v->text);
    for (size_t i = 0; v->items && i < v->n; i++) ds41_py_free(v->items[i]);
    free(v->items);
    for (size_t i = 0; v->entries && i < v->n; i++) {
        free(v->entries[i].key);
        ds41_py_free(v->entries[i].value);
    }
    free(v->entries);
    free(v);
}

static ds41_py *py_new(ds41_py_kind kind) {
    ds41_py *v = calloc(1, sizeof *v);
    if (v) v->kind = kind;
    return v;
}

static char *dup_bytes(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (!p) return NULL;
    if (n) memcpy(p, s, n);
    p[n] = 0;
    return p;
}

/* Appends to a list; takes ownership of item (freed on failure). */
static bool list_append(ds41_py *list, size_t *cap, ds41_py *item) {
    if (list->n == *cap) {
        size_t nc = *cap ? *cap * 2 : 4;
        ds41_py **p = realloc(list->items, nc * sizeof *p);
        if (!p) {
            ds41_py_free(item);
            return false;
        }
        list->items = p;
        *cap = nc;
    }
    list->items[list->n++] = item;
    return true;
}

/* dict[key] = value with Python's semantics: an existing key keeps its position and gets the new
 * value.  Takes ownership of key and value (freed on failure). */
static bool dict_set(ds41_py *dict, size_t *cap, char *key, size_t key_len, ds41_py *value) {
    for (size_t i = 0; i < dict->n; i++) {
        if (dict->entries[i].key_len == key_len && memcmp(dict->entries[i].key, key, key_len) == 0) {
            ds41_py_free(dict->entries[i].value);
            dict->entries[i].value = value;
            free(key);
            return true;
        }
    }
    if (dict->n == *cap) {
        size_t nc = *cap ? *cap * 2 : 4;
        ds41_py_entry *p = realloc(dict->entries, nc * sizeof *p);
        if (!p) {
            free(key);
            ds41_py_free(value);
            return false;
        }
        dict->entries = p;
        *cap = nc;
    }
    dict->entries[dict->n++] = (ds41_py_entry){key, key_len, value};
    return true;
}

/* ---- json.loads ---- */

typedef struct parser {
    const char *s;
    size_t len;
    size_t pos;
    int depth;
    bool hard;     /* an error Python would not raise (err filled) */
    ds41_error *err;
} parser;

static void skip_ws(parser *p) {
    while (p->pos < p->len) {
        char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static bool has(parser *p, const char *lit) {
    size_t n = strlen(lit);
    return p->len - p->pos >= n && memcmp(p->s + p->pos, lit, n) == 0;
}

static ds41_py *oom(parser *p) {
    p->hard = true;
    ds41_fail(p->err, "out of memory");
    return NULL;
}

static int hex4(const char *s) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= c - '0';
        else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
        else return -1;
    }
    return v;
}

/* UTF-8 bytes of a code point; surrogates get their 3-byte (WTF-8) form. */
static void put_code_point(ds41_buf *b, uint32_t c) {
    char u[4];
    if (c < 0x80) {
        u[0] = (char)c;
        ds41_buf_put(b, u, 1);
    } else if (c < 0x800) {
        u[0] = (char)(0xC0 | (c >> 6));
        u[1] = (char)(0x80 | (c & 0x3F));
        ds41_buf_put(b, u, 2);
    } else if (c < 0x10000) {
        u[0] = (char)(0xE0 | (c >> 12));
        u[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        u[2] = (char)(0x80 | (c & 0x3F));
        ds41_buf_put(b, u, 3);
    } else {
        u[0] = (char)(0xF0 | (c >> 18));
        u[1] = (char)(0x80 | ((c >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((c >> 6) & 0x3F));
        u[3] = (char)(0x80 | (c & 0x3F));
        ds41_buf_put(b, u, 4);
    }
}

/* A string literal at p->pos ('"'); returns false if Python would reject it. */
static bool parse_string(parser *p, ds41_buf *out) {
    p->pos++;
    for (;;) {
        if (p->pos >= p->len) return false;
        size_t run = p->pos;
        while (run < p->len && p->s[run] != '"' && p->s[run] != '\\' && (unsigned char)p->s[run] >= 0x20) run++;
        ds41_buf_put(out, p->s + p->pos, run - p->pos);
        p->pos = run;
        if (p->pos >= p->len) return false;
        unsigned char c = (unsigned char)p->s[p->pos];
        if (c == '"') {
            p->pos++;
            return true;
        }
        if (c < 0x20) return false; /* strict: no raw control characters */
        /* backslash */
        if (p->pos + 1 >= p->len) return false;
        char e = p->s[p->pos + 1];
        p->pos += 2;
        switch (e) {
        case '"': ds41_buf_putc(out, '"'); break;
        case '\\': ds41_buf_putc(out, '\\'); break;
        case '/': ds41_buf_putc(out, '/'); break;
        case 'b': ds41_buf_putc(out, '\b'); break;
        case 'f': ds41_buf_putc(out, '\f'); break;
        case 'n': ds41_buf_putc(out, '\n'); break;
        case 'r': ds41_buf_putc(out, '\r'); break;
        case 't': ds41_buf_putc(out, '\t'); break;
        case 'u': {
            if (p->len - p->pos < 4) return false;
            int c1 = hex4(p->s + p->pos);
            if (c1 < 0) return false;
            p->pos += 4;
            uint32_t cp = (uint32_t)c1;
            /* A high surrogate escape directly followed by a low surrogate escape is one
             * character; any other surrogate stays alone (as in Python). */
            if (cp >= 0xD800 && cp <= 0xDBFF && p->len - p->pos >= 6 && p->s[p->pos] == '\\' &&
                p->s[p->pos + 1] == 'u') {
                int c2 = hex4(p->s + p->pos + 2);
                if (c2 < 0) return false;
                if (c2 >= 0xDC00 && c2 <= 0xDFFF) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + ((uint32_t)c2 - 0xDC00);
                    p->pos += 6;
                }
            }
            put_code_point(out, cp);
            break;
        }
        default: return false;
        }
    }
}

static ds41_py *parse_value(parser *p);

static ds41_py *parse_number(parser *p) {
    size_t start = p->pos, i = p->pos;
    if (i < p->len && p->s[i] == '-') i++;
    if (i < p->len && p->s[i] >= '1' && p->s[i] <= '9') {
        while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') i++;
    } else if (i < p->len && p->s[i] == '0') {
        i++;
    } else {
        return NULL;
    }
    size_t int_end = i;
    bool is_float = false;
    if (i + 1 < p->len && p->s[i] == '.' && p->s[i + 1] >= '0' && p->s[i + 1] <= '9') {
        i += 2;
        while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') i++;
        is_float = true;
    }
    if (i < p->len && (p->s[i] == 'e' || p->s[i] == 'E')) {
        size_t j = i + 1;
        if (j < p->len && (p->s[j] == '+' || p->s[j] == '-')) j++;
        size_t digits = j;
        while (j < p->len && p->s[j] >= '0' && p->s[j] <= '9') j++;
        if (j > digits) {
            i = j;
            is_float = true;
        }
    }
    p->pos = i;
    if (is_float) {
        char *tmp = dup_bytes(p->s + start, i - start);
        if (!tmp) return oom(p);
        ds41_py *v = py_new(DS41_PY_FLOAT);
        if (!v) {
            free(tmp);
            return oom(p);
        }
        v->number = parse_double(tmp);
        free(tmp);
        return v;
    }
    size_t ndigits = int_end - start - (p->s[start] == '-');
    if (ndigits > 4300) return NULL; /* int(): "Exceeds the limit (4300 digits)" */
    ds41_py *v = py_new(DS41_PY_INT);
    if (!v) return oom(p);
    bool neg_zero = ndigits == 1 && p->s[start] == '-' && p->s[start + 1] == '0';
    v->text = neg_zero ? dup_bytes("0", 1) : dup_bytes(p->s + start, int_end - start);
    if (!v->text) {
        free(v);
        return oom(p);
    }
    v->text_len = strlen(v->text);
    return v;
}

static ds41_py *parse_container(parser *p, bool is_dict) {
    if (++p->depth > DS41_PY_MAX_DEPTH) {
        p->hard = true;
        ds41_fail(p->err, "JSON nested deeper than %d levels", DS41_PY_MAX_DEPTH);
        return NULL;
    }
    p->pos++;
    ds41_py *v = py_new(is_dict ? DS41_PY_DICT : DS41_PY_LIST);
    if (!v) return oom(p);
    size_t cap = 0;
    char close = is_dict ? '}' : ']';
    skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == close) {
        p->pos++;
        p->depth--;
        return v;
    }
    for (;;) {
        if (is_dict) {
            if (p->pos >= p->len || p->s[p->pos] != '"') goto fail;
            ds41_buf key = {0};
            if (!parse_string(p, &key)) {
                ds41_buf_free(&key);
                goto fail;
            }
            size_t key_len = key.len;
            char *k = ds41_buf_take(&key, NULL);
            if (!k) {
                oom(p);
                goto fail;
            }
            skip_ws(p);
            if (p->pos >= p->len || p->s[p->pos] != ':') {
                free(k);
                goto fail;
            }
            p->pos++;
            skip_ws(p);
            ds41_py *item = parse_value(p);
            if (!item) {
                free(k);
                goto fail;
            }
            if (!dict_set(v, &cap, k, key_len, item)) {
                oom(p);
                goto fail;
            }
        } else {
            ds41_py *item = parse_value(p);
            if (!item) goto fail;
            if (!list_append(v, &cap, item)) {
                oom(p);
                goto fail;
            }
        }
        skip_ws(p);
        if (p->pos >= p->len) goto fail;
        char c = p->s[p->pos++];
        if (c == close) break;
        if (c != ',') goto fail;
        skip_ws(p);
    }
    p->depth--;
    return v;
fail:
    ds41_py_free(v);
    return NULL;
}

static ds41_py *constant(parser *p, const char *lit, ds41_py_kind kind, bool b, double x) {
    p->pos += strlen(lit);
    ds41_py *v = py_new(kind);
    if (!v) return oom(p);
    v->boolean = b;
    v->number = x;
    return v;
}

/* One value at p->pos; NULL when Python would raise (p->hard false) or on a hard error. */
static ds41_py *parse_value(parser *p) {
    if (p->pos >= p->len) return NULL;
    switch (p->s[p->pos]) {
    case '"': {
        ds41_buf b = {0};
        if (!parse_string(p, &b)) {
            ds41_buf_free(&b);
            return NULL;
        }
        ds41_py *v = py_new(DS41_PY_STR);
        if (!v) {
            ds41_buf_free(&b);
            return oom(p);
        }
        v->text = ds41_buf_take(&b, &v->text_len);
        if (!v->text) {
            free(v);
            return oom(p);
        }
        return v;
    }
    case '{': return parse_container(p, true);
    case '[': return parse_container(p, false);
    case 'n': return has(p, "null") ? constant(p, "null", DS41_PY_NONE, false, 0) : NULL;
    case 't': return has(p, "true") ? constant(p, "true", DS41_PY_BOOL, true, 0) : NULL;
    case 'f': return has(p, "false") ? constant(p, "false", DS41_PY_BOOL, false, 0) : NULL;
    case 'N': return has(p, "NaN") ? constant(p, "NaN", DS41_PY_FLOAT, false, NAN) : NULL;
    case 'I': return has(p, "Infinity") ? constant(p, "Infinity", DS41_PY_FLOAT, false, INFINITY) : NULL;
    case '-':
        if (has(p, "-Infinity")) return constant(p, "-Infinity", DS41_PY_FLOAT, false, -INFINITY);
        return parse_number(p);
    default: return parse_number(p);
    }
}

int ds41_py_loads(const char *text, size_t len, ds41_py **out, bool *is_json, ds41_error *err) {
    *out = NULL;
    *is_json = false;
    if (!text && len) return ds41_fail(err, "json.loads: no text");
    parser p = {.s = text ? text : "", .len = len, .err = err};
    skip_ws(&p);
    ds41_py *v = parse_value(&p);
    if (!v) return p.hard ? -1 : 0;
    skip_ws(&p);
    if (p.pos != p.len) { /* "Extra data" */
        ds41_py_free(v);
        return 0;
    }
    *out = v;
    *is_json = true;
    return 0;
}

/* ---- jansson -> ds41_py ---- */

static ds41_py *from_json(const json_t *j, int depth, ds41_error *err) {
    if (depth > DS41_PY_MAX_DEPTH) {
        ds41_fail(err, "JSON nested deeper than %d levels", DS41_PY_MAX_DEPTH);
        return NULL;
    }
    ds41_py *v = NULL;
    switch (json_typeof(j)) {
    case JSON_NULL: v = py_new(DS41_PY_NONE); break;
    case JSON_TRUE:
    case JSON_FALSE:
        v = py_new(DS41_PY_BOOL);
        if (v) v->boolean = json_is_true(j);
        break;
    case JSON_INTEGER: {
        v = py_new(DS41_PY_INT);
        if (!v) break;
        char tmp[32];
        int n = snprintf(tmp, sizeof tmp, "%" JSON_INTEGER_FORMAT, json_integer_value(j));
        v->text = dup_bytes(tmp, (size_t)n);
        v->text_len = (size_t)n;
        if (!v->text) {
            free(v);
            v = NULL;
        }
        break;
    }
    case JSON_REAL:
        v = py_new(DS41_PY_FLOAT);
        if (v) v->number = json_real_value(j);
        break;
    case JSON_STRING:
        v = py_new(DS41_PY_STR);
        if (!v) break;
        v->text_len = json_string_length(j);
        v->text = dup_bytes(json_string_value(j), v->text_len);
        if (!v->text) {
            free(v);
            v = NULL;
        }
        break;
    case JSON_ARRAY: {
        v = py_new(DS41_PY_LIST);
        if (!v) break;
        size_t n = json_array_size(j);
        v->items = n ? calloc(n, sizeof *v->items) : NULL;
        if (n && !v->items) {
            free(v);
            v = NULL;
            break;
        }
        for (size_t i = 0; i < n; i++) {
            ds41_py *item = from_json(json_array_get(j, i), depth + 1, err);
            if (!item) {
                ds41_py_free(v);
                return NULL;
            }
            v->items[v->n++] = item;
        }
        break;
    }
    case JSON_OBJECT: {
        v = py_new(DS41_PY_DICT);
        if (!v) break;
        size_t n = json_object_size(j);
        v->entries = n ? calloc(n, sizeof *v->entries) : NULL;
        if (n && !v->entries) {
            free(v);
            v = NULL;
            break;
        }
        const char *key;
        size_t key_len;
        json_t *val;
        json_object_keylen_foreach((json_t *)j, key, key_len, val) {
            if (v->n == n) break; /* the object cannot grow while we read it; be safe anyway */
            char *k = dup_bytes(key, key_len);
            ds41_py *item = k ? from_json(val, depth + 1, err) : NULL;
            if (!item) {
                if (!k) ds41_fail(err, "out of memory");
                free(k);
                ds41_py_free(v);
                return NULL;
            }
            v->entries[v->n++] = (ds41_py_entry){k, key_len, item};
        }
        break;
    }
    }
    if (!v) ds41_fail(err, "out of memory");
    return v;
}

ds41_py *ds41_py_from_json(const json_t *value, ds41_error *err) {
    if (!value) {
        ds41_fail(err, "no JSON value");
        return NULL;
    }
    return from_json(value, 0, err);
}

/* ---- json.dumps ---- */

void ds41_py_dumps_string(const char *s, size_t len, ds41_buf *out) {
    ds41_buf_putc(out, '"');
    ds41_py_dumps_chars(s, len, out);
    ds41_buf_putc(out, '"');
}

void ds41_py_dumps_chars(const char *s, size_t len, ds41_buf *out) {
    size_t run = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        ds41_buf_put(out, s + run, i - run);
        run = i + 1;
        switch (c) {
        case '"': ds41_buf_puts(out, "\\\""); break;
        case '\\': ds41_buf_puts(out, "\\\\"); break;
        case '\n': ds41_buf_puts(out, "\\n"); break;
        case '\r': ds41_buf_puts(out, "\\r"); break;
        case '\t': ds41_buf_puts(out, "\\t"); break;
        case '\b': ds41_buf_puts(out, "\\b"); break;
        case '\f': ds41_buf_puts(out, "\\f"); break;
        default: ds41_buf_printf(out, "\\u%04x", c); break;
        }
    }
    ds41_buf_put(out, s + run, len - run);
}

void ds41_py_dumps(const ds41_py *v, ds41_buf *out) {
    switch (v->kind) {
    case DS41_PY_NONE: ds41_buf_puts(out, "null"); break;
    case DS41_PY_BOOL: ds41_buf_puts(out, v->boolean ? "true" : "false"); break;
    case DS41_PY_INT: ds41_buf_put(out, v->text, v->text_len); break;
    case DS41_PY_FLOAT:
        if (isnan(v->number)) ds41_buf_puts(out, "NaN");
        else if (isinf(v->number)) ds41_buf_puts(out, v->number > 0 ? "Infinity" : "-Infinity");
        else ds41_py_float_repr(v->number, out);
        break;
    case DS41_PY_STR: ds41_py_dumps_string(v->text, v->text_len, out); break;
    case DS41_PY_LIST:
        ds41_buf_putc(out, '[');
        for (size_t i = 0; i < v->n; i++) {
            if (i) ds41_buf_puts(out, ", ");
            ds41_py_dumps(v->items[i], out);
        }
        ds41_buf_putc(out, ']');
        break;
    case DS41_PY_DICT:
        ds41_buf_putc(out, '{');
        for (size_t i = 0; i < v->n; i++) {
            if (i) ds41_buf_puts(out, ", ");
            ds41_py_dumps_string(v->entries[i].key, v->entries[i].key_len, out);
            ds41_buf_puts(out, ": ");
            ds41_py_dumps(v->entries[i].value, out);
        }
        ds41_buf_putc(out, '}');
        break;
    }
}

char *ds41_json_dumps_py(const json_t *value, size_t *len, ds41_error *err) {
    ds41_py *v = ds41_py_from_json(value, err);
    if (!v) return NULL;
    ds41_buf b = {0};
    ds41_py_dumps(v, &b);
    ds41_py_free(v);
    char *s = ds41_buf_take(&b, len);
    if (!s) ds41_fail(err, "out of memory");
    return s;
}

/* ---- str() / repr() ---- */

/* Decodes one code point of WTF-8 at s[*i]; an ill-formed byte comes back as -1 - byte. */
static int32_t next_code_point(const char *s, size_t len, size_t *i) {
    const unsigned char *u = (const unsigned char *)s;
    unsigned char b = u[*i];
    int n = b < 0x80 ? 1 : (b & 0xE0) == 0xC0 ? 2 : (b & 0xF0) == 0xE0 ? 3 : (b & 0xF8) == 0xF0 ? 4 : 0;
    if (n == 0 || *i + (size_t)n > len) {
        (*i)++;
        return -1 - (int32_t)b;
    }
    int32_t c = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
    for (int k = 1; k < n; k++) {
        if ((u[*i + (size_t)k] & 0xC0) != 0x80) {
            (*i)++;
            return -1 - (int32_t)b;
        }
        c = (c << 6) | (u[*i + (size_t)k] & 0x3F);
    }
    *i += (size_t)n;
    return c;
}

/* Python's str.isprintable() for one non-ASCII character. */
static bool is_printable(int32_t c) {
    if (c > 0x10FFFF) return false;
    switch (utf8proc_category(c)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS: return false;
    default: return true;
    }
}

static void repr_string(const char *s, size_t len, ds41_buf *out) {
    bool single = memchr(s, '\'', len) != NULL, dbl = memchr(s, '"', len) != NULL;
    char quote = (single && !dbl) ? '"' : '\'';
    ds41_buf_putc(out, quote);
    size_t i = 0;
    while (i < len) {
        size_t at = i;
        int32_t c = next_code_point(s, len, &i);
        if (c < 0) {
            ds41_buf_printf(out, "\\x%02x", (unsigned)(-1 - c));
        } else if (c == quote || c == '\\') {
            ds41_buf_putc(out, '\\');
            ds41_buf_putc(out, (char)c);
        } else if (c == '\t') {
            ds41_buf_puts(out, "\\t");
        } else if (c == '\n') {
            ds41_buf_puts(out, "\\n");
        } else if (c == '\r') {
            ds41_buf_puts(out, "\\r");
        } else if (c < 0x20 || c == 0x7F) {
            ds41_buf_printf(out, "\\x%02x", (unsigned)c);
        } else if (c < 0x7F || is_printable(c)) {
            ds41_buf_put(out, s + at, i - at);
        } else if (c <= 0xFF) {
            ds41_buf_printf(out, "\\x%02x", (unsigned)c);
        } else if (c <= 0xFFFF) {
            ds41_buf_printf(out, "\\u%04x", (unsigned)c);
        } else {
            ds41_buf_printf(out, "\\U%08x", (unsigned)c);
        }
    }
    ds41_buf_putc(out, quote);
}

void ds41_py_repr(const ds41_py *v, ds41_buf *out) {
    switch (v->kind) {
    case DS41_PY_NONE: ds41_buf_puts(out, "None"); break;
    case DS41_PY_BOOL: ds41_buf_puts(out, v->boolean ? "True" : "False"); break;
    case DS41_PY_INT: ds41_buf_put(out, v->text, v->text_len); break;
    case DS41_PY_FLOAT: ds41_py_float_repr(v->number, out); break;
    case DS41_PY_STR: repr_string(v->text, v->text_len, out); break;
    case DS41_PY_LIST:
        ds41_buf_putc(out, '[');
        for (size_t i = 0; i < v->n; i++) {
            if (i) ds41_buf_puts(out, ", ");
            ds41_py_repr(v->items[i], out);
        }
        ds41_buf_putc(out, ']');
        break;
    case DS41_PY_DICT:
        ds41_buf_putc(out, '{');
        for (size_t i = 0; i < v->n; i++) {
            if (i) ds41_buf_puts(out, ", ");
            repr_string(v->entries[i].key, v->entries[i].key_len, out);
            ds41_buf_puts(out, ": ");
            ds41_py_repr(v->entries[i].value, out);
        }
        ds41_buf_putc(out, '}');
        break;
    }
}

void ds41_py_str(const ds41_py *v, ds41_buf *out) {
    if (v->kind == DS41_PY_STR) ds41_buf_put(out, v->text, v->text_len);
    else ds41_py_repr(v, out);
}

/* ---- UTF-8 ---- */



void ds41_utf8_sanitize(const char *s, size_t len, ds41_buf *out) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, run = 0;
    while (i < len) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        size_t sub = 0;
        size_t n = ds41_utf8_sequence(u + i, len - i, &sub);
        if (n) {
            i += n;
            continue;
        }
        ds41_buf_put(out, s + run, i - run);
        ds41_buf_puts(out, "\xEF\xBF\xBD");
        i += sub;
        run = i;
    }
    ds41_buf_put(out, s + run, len - run);
}

size_t ds41_utf8_prefix(const char *s, size_t len, size_t max_chars) {
    size_t i = 0, chars = 0;
    while (i < len) {
        if (((unsigned char)s[i] & 0xC0) != 0x80) {
            if (chars == max_chars) return i;
            chars++;
        }
        i++;
    }
    return len;
}
