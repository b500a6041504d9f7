/* Python-compatible JSON for the V4.1 chat encoding (REFERENCE.md §11, notation).
 *
 * The official encoder (encoding/encoding.py) is Python: it writes JSON with
 * json.dumps(x, ensure_ascii=False), reads tool-call argument strings with json.loads, and
 * formats odd message fields with str().  A prompt that differs by one byte is a different
 * prompt, so this module reproduces those three functions exactly:
 *
 *   json.dumps(ensure_ascii=False): separators ", " and ": ", no indent, keys in input order
 *     (never sorted); strings escape only '"', '\\' and U+0000..U+001F (\b \f \n \r \t short
 *     forms, else \u00xx with lowercase hex); everything else, non-ASCII included, is written
 *     raw; ints exactly; floats by Python repr (shortest round-trip digits; exponent form when
 *     the decimal exponent is < -4 or >= 16, written e+16 / e-05; fixed form gets ".0" when it
 *     has no point: 1e2 -> 100.0); NaN / Infinity / -Infinity for the non-finite floats.
 *   json.loads: Python's grammar (NaN, Infinity and -Infinity accepted, numbers with a fraction
 *     or exponent are floats, others ints of any size; duplicate keys keep the first key's
 *     position and the last value; only ASCII space, tab, CR and LF are whitespace).
 *   str(): strings as they are, None / True / False, float repr, and Python repr for lists and
 *     dicts ('single' quotes unless the text holds ' and no ", non-printable characters
 *     escaped; printability from utf8proc's Unicode tables).
 *
 * Values (ds41_py) are a Python-side view of JSON: ints are kept as canonical decimal text, so
 * integers beyond 64 bits survive json.loads -> json.dumps unchanged; strings are bytes in
 * WTF-8 (UTF-8 that may also carry the 3-byte form of a lone UTF-16 surrogate, which Python
 * strings can hold after json.loads of "\ud800").  Such a surrogate cannot reach a UTF-8 prompt;
 * the chat renderer rejects output that contains one (Python would fail when tokenizing it).
 *
 * Python >= 3.11 limits int <-> str conversion to 4300 digits; json.loads of a longer integer
 * raises, and ds41_py_loads reports it as not JSON in the same way.
 *
 * The float formatting switches the calling thread to the "C" numeric locale for its duration,
 * so it is correct whatever locale the program set. */
#ifndef DS41_ENGINE_PYJSON_H
#define DS41_ENGINE_PYJSON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "config/error.h"
#include "config/buf.h"
#include "config/utf8.h"

/* ---- Python values ---- */

typedef enum ds41_py_kind {
    DS41_PY_NONE,
    DS41_PY_BOOL,
    DS41_PY_INT,   /* text: canonical decimal ("-12", never "-0") */
    DS41_PY_FLOAT, /* number */
    DS41_PY_STR,   /* text: WTF-8 bytes, may contain NUL */
    DS41_PY_LIST,  /* items[n] */
    DS41_PY_DICT,  /* entries[n], insertion order, keys unique */
} ds41_py_kind;

typedef struct ds41_py ds41_py;

typedef struct ds41_py_entry {
    char *key; /* WTF-8, NUL-terminated, key_len bytes */
    size_t key_len;
    ds41_py *value;
} ds41_py_entry;

struct ds41_py {
    ds41_py_kind kind;
    bool boolean;
    double number;
    char *text; /* INT and STR: NUL-terminated, text_len bytes */
    size_t text_len;
    size_t n;
    ds41_py **items;
    ds41_py_entry *entries;
};

void ds41_py_free(ds41_py *v);

/* Deepest nesting ds41_py_loads and ds41_py_from_json accept.  Python's own limit is its
 * recursion limit (about 1000 frames, minus the caller's depth); deeper input is reported as an
 * error rather than guessed. */
#define DS41_PY_MAX_DEPTH 512

/* json.loads(text[len]).  On success returns 0 with *out a new value (ds41_py_free) and
 * *is_json = true.  When Python's json.loads would raise (malformed JSON, an integer of more than
 * 4300 digits) returns 0 with *out = NULL and *is_json = false.  Returns -1 with err filled only
 * for what ds41 does not reproduce: nesting deeper than DS41_PY_MAX_DEPTH, or out of memory.
 * text is WTF-8 (see above); it need not be NUL-terminated. */
int ds41_py_loads(const char *text, size_t len, ds41_py **out, bool *is_json, ds41_error *err);

/* A ds41_py copy of a jansson value (integers become decimal text, reals floats).  Returns NULL
 * with err filled on out of memory or nesting deeper than DS41_PY_MAX_DEPTH. */
ds41_py *ds41_py_from_json(const json_t *value, ds41_error *err);

/* Appends json.dumps(v, ensure_ascii=False) to out. */
void ds41_py_dumps(const ds41_py *v, ds41_buf *out);

/* Appends str(v) (strings raw, containers by repr) / repr(v) to out. */
void ds41_py_str(const ds41_py *v, ds41_buf *out);
void ds41_py_repr(const ds41_py *v, ds41_buf *out);

/* Appends Python's repr of a float (finite: "0.1", "100.0", "1e+16", "1e-05", "-0.0"; else
 * "nan", "inf", "-inf").  json.dumps writes the finite ones the same way. */
void ds41_py_float_repr(double x, ds41_buf *out);

/* json.dumps(ensure_ascii=False) of a jansson value, as a new NUL-terminated heap string
 * (free()) of *len bytes (len may be NULL).  Returns NULL with err filled on out of memory or
 * nesting deeper than DS41_PY_MAX_DEPTH. */
char *ds41_json_dumps_py(const json_t *value, size_t *len, ds41_error *err);

/* Appends json.dumps of a string (quotes and escapes) to out. */
void ds41_py_dumps_string(const char *s, size_t len, ds41_buf *out);
/* The same without the quotes: the escaped characters only (to build one string of parts). */
void ds41_py_dumps_chars(const char *s, size_t len, ds41_buf *out);

/* ---- UTF-8 ---- */

/* Appends s[len] to out with every ill-formed sequence replaced by U+FFFD (one per maximal
 * ill-formed subpart, as Python's bytes.decode(errors="replace") does). */
void ds41_utf8_sanitize(const char *s, size_t len, ds41_buf *out);

/* Length in bytes of the first max_chars code points of s[len] (s well-formed or WTF-8). */
size_t ds41_utf8_prefix(const char *s, size_t len, size_t max_chars);

#endif
