/* Byte-level BPE encoding and decoding with Hugging Face tokenizers'
 * semantics; see engine/text/tokenizer.h for the contract. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "engine/text/tokenizer.h"

#include "config/buf.h"
#include "config/utf8.h"

#include "engine/text/unicode_tables.h"

#include <jansson.h>
#include <pcre2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ======================================================================
 * UTF-8
 * ====================================================================== */

/* Code point at S (valid UTF-8, N > 0 bytes left); *len gets its length. */
static uint32_t utf8_get(const uint8_t *s, size_t n, size_t *len) {
    uint8_t b = s[0];
    if (b < 0x80 || n < 2) {
        *len = 1;
        return b;
    }
    if (b < 0xE0) {
        *len = 2;
        return ((uint32_t)(b & 0x1F) << 6) | (s[1] & 0x3F);
    }
    if (b < 0xF0 || n < 4) {
        *len = 3;
        return ((uint32_t)(b & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    }
    *len = 4;
    return ((uint32_t)(b & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) | ((uint32_t)(s[2] & 0x3F) << 6) |
           (s[3] & 0x3F);
}

/* Code point ending at S[end-1] (valid UTF-8, end > 0). */
static uint32_t utf8_get_before(const uint8_t *s, size_t end) {
    size_t st = end - 1;
    while (st > 0 && (s[st] & 0xC0) == 0x80 && end - st < 4) st--;
    size_t len;
    return utf8_get(s + st, end - st, &len);
}

/* ======================================================================
 * Unicode classes (Unicode 16.0, engine/text/unicode_tables.h)
 * ====================================================================== */

#define CP_LIMIT 0x110000u

static bool is_white_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
           c == 0x3000;
}

static bool in_ranges(const ds41_unicode_range *r, size_t n, uint32_t c, uint32_t *value) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (c < r[mid].first)
            hi = mid;
        else if (c > r[mid].last)
            lo = mid + 1;
        else {
            if (value) *value = r[mid].value;
            return true;
        }
    }
    return false;
}

static ds41_gc gc_of(uint32_t c) {
    uint32_t v;
    return in_ranges(ds41_unicode_gc_ranges, ds41_unicode_gc_n_ranges, c, &v) ? (ds41_gc)v : DS41_GC_CN;
}

#define GC_BIT(g) (1u << (g))
#define GC_L (GC_BIT(DS41_GC_LU) | GC_BIT(DS41_GC_LL) | GC_BIT(DS41_GC_LT) | GC_BIT(DS41_GC_LM) | GC_BIT(DS41_GC_LO))
#define GC_M (GC_BIT(DS41_GC_MN) | GC_BIT(DS41_GC_MC) | GC_BIT(DS41_GC_ME))

/* Rust regex's Unicode \w (what AddedVocabulary's single_word checks). */
static bool rust_is_word(uint32_t c) {
    if (c == 0x200C || c == 0x200D) return true; /* Join_Control */
    if (in_ranges(ds41_unicode_alphabetic_ranges, ds41_unicode_alphabetic_n_ranges, c, NULL)) return true;
    ds41_gc g = gc_of(c);
    return (GC_BIT(g) & (GC_M | GC_BIT(DS41_GC_ND) | GC_BIT(DS41_GC_PC))) != 0;
}

/* A set of code points as a bitmap (surrogates never set). */
typedef struct cpset {
    uint64_t w[CP_LIMIT / 64];
} cpset;

static void set_add(cpset *s, uint32_t a, uint32_t b) {
    for (uint32_t c = a; c <= b && c < CP_LIMIT; c++)
        if (c < 0xD800 || c > 0xDFFF) s->w[c >> 6] |= 1ull << (c & 63);
}

static void set_add_gc(cpset *s, uint32_t mask) {
    if (mask & GC_BIT(DS41_GC_CN)) { /* unassigned: the gaps between ranges */
        uint32_t next = 0;
        for (size_t i = 0; i < ds41_unicode_gc_n_ranges; i++) {
            if (ds41_unicode_gc_ranges[i].first > next) set_add(s, next, ds41_unicode_gc_ranges[i].first - 1);
            next = ds41_unicode_gc_ranges[i].last + 1;
        }
        if (next < CP_LIMIT) set_add(s, next, CP_LIMIT - 1);
    }
    for (size_t i = 0; i < ds41_unicode_gc_n_ranges; i++)
        if (mask & GC_BIT(ds41_unicode_gc_ranges[i].value))
            set_add(s, ds41_unicode_gc_ranges[i].first, ds41_unicode_gc_ranges[i].last);
}

static void set_add_alphabetic(cpset *s) {
    for (size_t i = 0; i < ds41_unicode_alphabetic_n_ranges; i++)
        set_add(s, ds41_unicode_alphabetic_ranges[i].first, ds41_unicode_alphabetic_ranges[i].last);
}

static void set_add_white_space(cpset *s) {
    static const uint32_t r[][2] = {{0x09, 0x0D}, {0x20, 0x20},     {0x85, 0x85},     {0xA0, 0xA0},
                                    {0x1680, 0x1680}, {0x2000, 0x200A}, {0x2028, 0x2029}, {0x202F, 0x202F},
                                    {0x205F, 0x205F}, {0x3000, 0x3000}};
    for (size_t i = 0; i < sizeof r / sizeof r[0]; i++) set_add(s, r[i][0], r[i][1]);
}

/* Oniguruma's \w: Alphabetic | M | Nd | Pc; outside brackets also the
 * Latin-1 number signs its single-byte table calls word characters. */
static void set_add_word(cpset *s, bool outside_class) {
    set_add_alphabetic(s);
    set_add_gc(s, GC_M | GC_BIT(DS41_GC_ND) | GC_BIT(DS41_GC_PC));
    if (outside_class) {
        set_add(s, 0xB2, 0xB3);
        set_add(s, 0xB9, 0xB9);
        set_add(s, 0xBC, 0xBE);
    }
}

static void set_invert(cpset *s) {
    for (size_t i = 0; i < CP_LIMIT / 64; i++) s->w[i] = ~s->w[i];
    for (uint32_t c = 0xD800; c <= 0xDFFF; c++) s->w[c >> 6] &= ~(1ull << (c & 63));
}

/* ======================================================================
 * A growable string
 * ====================================================================== */

typedef struct class_defs class_defs;

typedef struct strbuf {
    ds41_buf out;
    class_defs *defs; /* not NULL: classes outside brackets become subroutine calls */
} strbuf;

/* Classes outside brackets defined once at the end of the pattern,
 * (?(DEFINE)(?<ds41cN>[...])), and called as (?&ds41cN): used when the
 * inline form exceeds PCRE2's compiled-size limit. */
struct class_defs {
    char **text;
    size_t n;
};

typedef struct cprange {
    uint32_t first, last;
} cprange;

static int by_size_desc(const void *a, const void *b) {
    const cprange *x = a, *y = b;
    uint32_t lx = x->last - x->first, ly = y->last - y->first;
    if (lx != ly) return lx < ly ? 1 : -1;
    return x->first < y->first ? -1 : 1;
}

/* Append the set's ranges as PCRE2 class items ("\x{A}-\x{B}...").  Big
 * ranges first: PCRE2 tests class ranges in order, so common scripts (CJK,
 * Hangul, Latin) are found early. */
static void sb_set_items(strbuf *b, const cpset *s) {
    size_t n = 0, cap = 256;
    cprange *r = malloc(cap * sizeof *r);
    if (!r) {
        b->out.oom = true;
        return;
    }
    uint32_t c = 0;
    while (c < CP_LIMIT) {
        if (!(s->w[c >> 6] >> (c & 63) & 1)) {
            c++;
            continue;
        }
        uint32_t a = c;
        while (c < CP_LIMIT && (s->w[c >> 6] >> (c & 63) & 1)) c++;
        if (n == cap) {
            cprange *p = realloc(r, 2 * cap * sizeof *r);
            if (!p) {
                free(r);
                b->out.oom = true;
                return;
            }
            r = p;
            cap *= 2;
        }
        r[n++] = (cprange){a, c - 1};
    }
    qsort(r, n, sizeof *r, by_size_desc);
    for (size_t i = 0; i < n; i++) {
        if (r[i].first == r[i].last)
            ds41_buf_printf(&b->out, "\\x{%X}", r[i].first);
        else
            ds41_buf_printf(&b->out, "\\x{%X}-\\x{%X}", r[i].first, r[i].last);
    }
    free(r);
}

/* ======================================================================
 * Oniguruma -> PCRE2 translation
 * ====================================================================== */

typedef enum { PROP_NONE, PROP_GC, PROP_ALPHA, PROP_SPACE } prop_kind;

/* Resolve a property name the way Oniguruma compares them (case, spaces,
 * underscores and hyphens ignored). */
static prop_kind resolve_property(const char *name, size_t n, uint32_t *mask) {
    char k[48];
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (c == ' ' || c == '_' || c == '-') continue;
        if (m + 1 >= sizeof k) return PROP_NONE;
        k[m++] = (char)(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    }
    k[m] = 0;
    static const struct {
        const char *a, *b;
        uint32_t mask;
    } names[] = {
        {"l", "letter", GC_L},
        {"lu", "uppercaseletter", GC_BIT(DS41_GC_LU)},
        {"ll", "lowercaseletter", GC_BIT(DS41_GC_LL)},
        {"lt", "titlecaseletter", GC_BIT(DS41_GC_LT)},
        {"lm", "modifierletter", GC_BIT(DS41_GC_LM)},
        {"lo", "otherletter", GC_BIT(DS41_GC_LO)},
        {"lc", "casedletter", GC_BIT(DS41_GC_LU) | GC_BIT(DS41_GC_LL) | GC_BIT(DS41_GC_LT)},
        {"m", "mark", GC_M},
        {"mn", "nonspacingmark", GC_BIT(DS41_GC_MN)},
        {"mc", "spacingmark", GC_BIT(DS41_GC_MC)},
        {"me", "enclosingmark", GC_BIT(DS41_GC_ME)},
        {"n", "number", GC_BIT(DS41_GC_ND) | GC_BIT(DS41_GC_NL) | GC_BIT(DS41_GC_NO)},
        {"nd", "decimalnumber", GC_BIT(DS41_GC_ND)},
        {"nl", "letternumber", GC_BIT(DS41_GC_NL)},
        {"no", "othernumber", GC_BIT(DS41_GC_NO)},
        {"p", "punctuation",
         GC_BIT(DS41_GC_PC) | GC_BIT(DS41_GC_PD) | GC_BIT(DS41_GC_PS) | GC_BIT(DS41_GC_PE) | GC_BIT(DS41_GC_PI) |
             GC_BIT(DS41_GC_PF) | GC_BIT(DS41_GC_PO)},
        {"pc", "connectorpunctuation", GC_BIT(DS41_GC_PC)},
        {"pd", "dashpunctuation", GC_BIT(DS41_GC_PD)},
        {"ps", "openpunctuation", GC_BIT(DS41_GC_PS)},
        {"pe", "closepunctuation", GC_BIT(DS41_GC_PE)},
        {"pi", "initialpunctuation", GC_BIT(DS41_GC_PI)},
        {"pf", "finalpunctuation", GC_BIT(DS41_GC_PF)},
        {"po", "otherpunctuation", GC_BIT(DS41_GC_PO)},
        {"s", "symbol", GC_BIT(DS41_GC_SM) | GC_BIT(DS41_GC_SC) | GC_BIT(DS41_GC_SK) | GC_BIT(DS41_GC_SO)},
        {"sm", "mathsymbol", GC_BIT(DS41_GC_SM)},
        {"sc", "currencysymbol", GC_BIT(DS41_GC_SC)},
        {"sk", "modifiersymbol", GC_BIT(DS41_GC_SK)},
        {"so", "othersymbol", GC_BIT(DS41_GC_SO)},
        {"z", "separator", GC_BIT(DS41_GC_ZS) | GC_BIT(DS41_GC_ZL) | GC_BIT(DS41_GC_ZP)},
        {"zs", "spaceseparator", GC_BIT(DS41_GC_ZS)},
        {"zl", "lineseparator", GC_BIT(DS41_GC_ZL)},
        {"zp", "paragraphseparator", GC_BIT(DS41_GC_ZP)},
        {"c", "other",
         GC_BIT(DS41_GC_CC) | GC_BIT(DS41_GC_CF) | GC_BIT(DS41_GC_CS) | GC_BIT(DS41_GC_CO) | GC_BIT(DS41_GC_CN)},
        {"cc", "control", GC_BIT(DS41_GC_CC)},
        {"cf", "format", GC_BIT(DS41_GC_CF)},
        {"cs", "surrogate", GC_BIT(DS41_GC_CS)},
        {"co", "privateuse", GC_BIT(DS41_GC_CO)},
        {"cn", "unassigned", GC_BIT(DS41_GC_CN)},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(k, names[i].a) || !strcmp(k, names[i].b)) {
            *mask = names[i].mask;
            return PROP_GC;
        }
    if (!strcmp(k, "alphabetic")) return PROP_ALPHA;
    if (!strcmp(k, "whitespace")) return PROP_SPACE;
    return PROP_NONE;
}

typedef enum { CLS_SPACE, CLS_WORD, CLS_DIGIT, CLS_HEX, CLS_PROP } cls_kind;

/* Emit a class: as a bracket expression outside brackets, as bare items
 * inside one (a negation inside brackets becomes the complement's items). */
static void emit_class(strbuf *b, cls_kind kind, prop_kind pk, uint32_t mask, bool negate, bool in_class) {
    if (kind == CLS_HEX && !(in_class && negate)) {
        ds41_buf_puts(&b->out, in_class ? "0-9A-Fa-f" : negate ? "[^0-9A-Fa-f]" : "[0-9A-Fa-f]");
        return;
    }
    cpset *s = calloc(1, sizeof *s);
    if (!s) {
        b->out.oom = true;
        return;
    }
    switch (kind) {
    case CLS_SPACE: set_add_white_space(s); break;
    case CLS_WORD: set_add_word(s, !in_class); break;
    case CLS_DIGIT: set_add_gc(s, GC_BIT(DS41_GC_ND)); break;
    case CLS_HEX:
        set_add(s, '0', '9');
        set_add(s, 'A', 'F');
        set_add(s, 'a', 'f');
        break;
    case CLS_PROP:
        if (pk == PROP_GC) set_add_gc(s, mask);
        if (pk == PROP_ALPHA) set_add_alphabetic(s);
        if (pk == PROP_SPACE) set_add_white_space(s);
        break;
    }
    if (in_class) {
        if (negate) set_invert(s);
        sb_set_items(b, s);
    } else if (!b->defs) {
        ds41_buf_puts(&b->out, negate ? "[^" : "[");
        sb_set_items(b, s);
        ds41_buf_puts(&b->out, "]");
    } else {
        strbuf c = {0};
        ds41_buf_puts(&c.out, negate ? "[^" : "[");
        sb_set_items(&c, s);
        ds41_buf_puts(&c.out, "]");
        class_defs *d = b->defs;
        size_t k = 0;
        while (!c.out.oom && k < d->n && strcmp(d->text[k], c.out.data)) k++;
        if (!c.out.oom && k == d->n) {
            char **p = realloc(d->text, (d->n + 1) * sizeof *p);
            if (!p) c.out.oom = true;
            else {
                d->text = p;
                d->text[d->n++] = c.out.data;
                c.out.data = NULL;
            }
        }
        if (c.out.oom) b->out.oom = true;
        ds41_buf_free(&c.out);
        ds41_buf_printf(&b->out, "(?&ds41c%zu)", k);
    }
    free(s);
}

static bool is_hex(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

static bool is_digit(char c) {
    return c >= '0' && c <= '9';
}

/* One escape at P[i] == '\\'; returns the index after it, or 0 with err. */
static size_t translate_escape(const char *p, size_t n, size_t i, bool in_class, strbuf *b, ds41_error *err) {
    if (i + 1 >= n) {
        ds41_fail(err, "a trailing backslash");
        return 0;
    }
    char e = p[i + 1];
    size_t j = i + 2;
    switch (e) {
    case 's':
    case 'S': emit_class(b, CLS_SPACE, PROP_NONE, 0, e == 'S', in_class); return j;
    case 'w':
    case 'W': emit_class(b, CLS_WORD, PROP_NONE, 0, e == 'W', in_class); return j;
    case 'd':
    case 'D': emit_class(b, CLS_DIGIT, PROP_NONE, 0, e == 'D', in_class); return j;
    case 'h':
    case 'H': emit_class(b, CLS_HEX, PROP_NONE, 0, e == 'H', in_class); return j;
    case 'v': ds41_buf_puts(&b->out, "\\x{0B}"); return j; /* Oniguruma: the vertical tab, not a class */
    case 'b':
    case 'B':
        if (in_class) {
            if (e == 'B') break;
            ds41_buf_puts(&b->out, "\\x{08}");
            return j;
        }
        {
            strbuf w = {.defs = b->defs};
            emit_class(&w, CLS_WORD, PROP_NONE, 0, false, false);
            if (w.out.oom) {
                ds41_buf_free(&w.out);
                b->out.oom = true;
                return j;
            }
            if (e == 'b') {
                ds41_buf_puts(&b->out, "(?:(?<=");
                ds41_buf_puts(&b->out, w.out.data);
                ds41_buf_puts(&b->out, ")(?!");
                ds41_buf_puts(&b->out, w.out.data);
                ds41_buf_puts(&b->out, ")|(?<!");
                ds41_buf_puts(&b->out, w.out.data);
                ds41_buf_puts(&b->out, ")(?=");
                ds41_buf_puts(&b->out, w.out.data);
                ds41_buf_puts(&b->out, "))");
            } else {
                ds41_buf_puts(&b->out, "(?:(?<=");
                ds41_buf_puts(&b->out, w.out.data);
                ds41_buf_puts(&b->out, ")(?=");
                ds41_buf_puts(&b->out, w.out.data);
                ds41_buf_puts(&b->out, ")|(?<!");
                ds41_buf_puts(&b->out, w.out.data);
                ds41_buf_puts(&b->out, ")(?!");
                ds41_buf_puts(&b->out, w.out.data);
                ds41_buf_puts(&b->out, "))");
            }
            ds41_buf_free(&w.out);
        }
        return j;
    case 'u':
        if (j + 4 > n || !is_hex(p[j]) || !is_hex(p[j + 1]) || !is_hex(p[j + 2]) || !is_hex(p[j + 3])) break;
        ds41_buf_puts(&b->out, "\\x{");
        ds41_buf_put(&b->out, p + j, 4);
        ds41_buf_puts(&b->out, "}");
        return j + 4;
    case 'p':
    case 'P': {
        if (j >= n || p[j] != '{') break;
        size_t close = j + 1;
        while (close < n && p[close] != '}') close++;
        if (close >= n) break;
        const char *name = p + j + 1;
        size_t len = close - j - 1;
        bool neg = e == 'P';
        if (len && name[0] == '^') {
            neg = !neg;
            name++;
            len--;
        }
        uint32_t mask = 0;
        prop_kind pk = resolve_property(name, len, &mask);
        if (pk == PROP_NONE) /* a script or another property: PCRE2's tables */
            ds41_buf_put(&b->out, p + i, close + 1 - i);
        else
            emit_class(b, CLS_PROP, pk, mask, neg, in_class);
        return close + 1;
    }
    case 'x':
    case 'o':
        if (j < n && p[j] == '{') { /* \x{...}, \o{...}: copied whole so '{' is not read as a repeat */
            size_t close = j;
            while (close < n && p[close] != '}') close++;
            if (close >= n) break;
            ds41_buf_put(&b->out, p + i, close + 1 - i);
            return close + 1;
        }
        if (e == 'o') break;
        ds41_buf_put(&b->out, p + i, 2);
        return j;
    case 'c':
        if (j >= n) break;
        ds41_buf_put(&b->out, p + i, 3);
        return j + 1;
    case 'k':
    case 'g':
        if (in_class) break;
        ds41_buf_put(&b->out, p + i, 2);
        return j;
    case 'A':
    case 'z':
    case 'Z':
    case 'G':
    case 'K':
    case 'R':
    case 'X':
    case 'N':
        if (in_class) break;
        ds41_buf_put(&b->out, p + i, 2);
        return j;
    case 'n':
    case 't':
    case 'r':
    case 'f':
    case 'e':
    case 'a':
        ds41_buf_put(&b->out, p + i, 2);
        return j;
    default:
        if (is_digit(e)) { /* backreference or octal escape: same in both */
            ds41_buf_put(&b->out, p + i, 2);
            return j;
        }
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) break;
        /* an escaped punctuation or non-ASCII character: a literal */
        {
            size_t k = 1;
            if ((uint8_t)e >= 0x80) utf8_get((const uint8_t *)p + i + 1, n - i - 1, &k);
            ds41_buf_put(&b->out, p + i, 1 + k);
            return i + 1 + k;
        }
    }
    ds41_fail(err, "the escape '\\%c'%s is not supported (Oniguruma and PCRE2 read it differently)", e,
              in_class ? " inside brackets" : "");
    return 0;
}

static char *translate(const char *p, size_t n, class_defs *defs, ds41_error *err) {
    strbuf b = {.defs = defs};
    size_t i = 0;
    bool in_class = false, class_first = false;
    while (i < n && !b.out.oom) {
        char c = p[i];
        if (c == '\\') {
            size_t next = translate_escape(p, n, i, in_class, &b, err);
            if (!next) goto fail;
            i = next;
            class_first = false;
            continue;
        }
        if (in_class) {
            if (c == ']' && !class_first) {
                in_class = false;
                ds41_buf_put(&b.out, "]", 1);
                i++;
                continue;
            }
            if (c == '[') {
                ds41_fail(err, i + 1 < n && p[i + 1] == ':' ? "POSIX bracket classes ([:name:]) are not supported"
                                                            : "nested character classes are not supported");
                goto fail;
            }
            if (c == '&' && i + 1 < n && p[i + 1] == '&') {
                ds41_fail(err, "character class set operations (&&) are not supported");
                goto fail;
            }
            class_first = false;
            ds41_buf_put(&b.out, p + i, 1);
            i++;
            continue;
        }
        if (c == '[') {
            in_class = true;
            class_first = true;
            ds41_buf_put(&b.out, "[", 1);
            i++;
            if (i < n && p[i] == '^') {
                ds41_buf_put(&b.out, "^", 1);
                i++;
            }
            continue;
        }
        if (c == '(') {
            if (i + 1 < n && p[i + 1] == '*') {
                ds41_fail(err, "'(*' (callouts / verbs) is not supported");
                goto fail;
            }
            if (i + 2 < n && p[i + 1] == '?') {
                char d = p[i + 2];
                if (d == '~') {
                    ds41_fail(err, "absent groups (?~...) are not supported");
                    goto fail;
                }
                if (d == '{') {
                    ds41_fail(err, "callouts (?{...}) are not supported");
                    goto fail;
                }
                if ((d >= 'a' && d <= 'z') || (d >= 'A' && d <= 'Z') || d == '-') {
                    /* an option group: Oniguruma's m is PCRE2's s (dot-all) */
                    size_t k = i + 2;
                    ds41_buf_put(&b.out, "(?", 2);
                    while (k < n && p[k] != ':' && p[k] != ')') {
                        char o = p[k];
                        if (o == 'i' || o == 'x' || o == '-')
                            ds41_buf_put(&b.out, &o, 1);
                        else if (o == 'm')
                            ds41_buf_put(&b.out, "s", 1);
                        else {
                            ds41_fail(err, "the option (?%c) is not supported", o);
                            goto fail;
                        }
                        k++;
                    }
                    if (k >= n) {
                        ds41_fail(err, "an unterminated option group");
                        goto fail;
                    }
                    ds41_buf_put(&b.out, p + k, 1);
                    i = k + 1;
                    continue;
                }
            }
            ds41_buf_put(&b.out, "(", 1);
            i++;
            continue;
        }
        if (c == '{') {
            /* {n}, {n,}, {n,m} as in PCRE2; {,m} = {0,m}; {n}? is Oniguruma's
             * optional fixed repeat; anything else is a literal brace. */
            size_t k = i + 1, a0 = k;
            while (k < n && is_digit(p[k])) k++;
            size_t a_len = k - a0;
            bool comma = k < n && p[k] == ',';
            size_t b0 = comma ? k + 1 : k, kk = b0;
            while (comma && kk < n && is_digit(p[kk])) kk++;
            size_t b_len = comma ? kk - b0 : 0;
            size_t close = comma ? kk : k;
            if (close < n && p[close] == '}' && (a_len || b_len)) {
                if (!comma && close + 1 < n && p[close + 1] == '?') {
                    ds41_fail(err, "'{n}?' (Oniguruma: an optional fixed repeat) is not supported");
                    goto fail;
                }
                if (!a_len) ds41_buf_put(&b.out, "{0", 2), ds41_buf_put(&b.out, p + b0 - 1, close + 1 - (b0 - 1));
                else
                    ds41_buf_put(&b.out, p + i, close + 1 - i);
                i = close + 1;
                continue;
            }
            ds41_buf_put(&b.out, "\\{", 2);
            i++;
            continue;
        }
        ds41_buf_put(&b.out, p + i, 1);
        i++;
    }
    if (in_class && !b.out.oom) {
        ds41_fail(err, "an unterminated character class");
        goto fail;
    }
    if (b.out.oom) {
        ds41_fail(err, "out of memory translating a regex");
        goto fail;
    }
    if (defs && defs->n) {
        ds41_buf_puts(&b.out, "(?(DEFINE)");
        for (size_t k = 0; k < defs->n; k++) {
            ds41_buf_printf(&b.out, "(?<ds41c%zu>", k);
            ds41_buf_puts(&b.out, defs->text[k]);
            ds41_buf_puts(&b.out, ")");
        }
        ds41_buf_puts(&b.out, ")");
    }
    char *text = ds41_buf_take(&b.out, NULL);
    if (!text) ds41_fail(err, "out of memory translating a regex");
    return text;
fail:
    ds41_buf_free(&b.out);
    return NULL;
}

char *ds41_tokenizer_translate_regex(const char *p, size_t n, ds41_error *err) {
    return translate(p, n, NULL, err);
}

static void defs_free(class_defs *d) {
    for (size_t k = 0; k < d->n; k++) free(d->text[k]);
    free(d->text);
}

static pcre2_code *compile_translated(const char *src, size_t src_len, bool literal, int *code) {
    pcre2_compile_context *cc = pcre2_compile_context_create(NULL);
    if (!cc) {
        *code = PCRE2_ERROR_NOMEMORY;
        return NULL;
    }
    pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
    pcre2_set_bsr(cc, PCRE2_BSR_UNICODE);
    PCRE2_SIZE off;
    uint32_t opts = literal ? PCRE2_UTF | PCRE2_LITERAL : PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)src, src_len, opts, code, &off, cc);
    pcre2_compile_context_free(cc);
    return re;
}

/* Compile PATTERN (Oniguruma syntax, or a literal) for matching: classes
 * inline (fastest), or, when that is too large for PCRE2, defined once and
 * called. */
static pcre2_code *compile_regex(const char *pattern, size_t len, bool literal, ds41_error *err) {
    int code = 0;
    pcre2_code *re = NULL;
    if (literal) {
        re = compile_translated(pattern, len, true, &code);
    } else {
        for (int attempt = 0; attempt < 2 && !re; attempt++) {
            class_defs defs = {0};
            char *src = translate(pattern, len, attempt ? &defs : NULL, err);
            if (!src) {
                defs_free(&defs);
                return NULL;
            }
            re = compile_translated(src, strlen(src), false, &code);
            free(src);
            defs_free(&defs);
            if (!re && code != PCRE2_ERROR_PATTERN_TOO_LARGE) break;
        }
    }
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        ds41_fail(err, "PCRE2 cannot compile it: %s", (const char *)msg);
        return NULL;
    }
    /* JIT when available; pcre2_match falls back to the interpreter. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    return re;
}

/* ======================================================================
 * Added tokens: a byte trie
 * ====================================================================== */

typedef struct trie_node {
    int32_t child, sibling; /* -1: none */
    int32_t token;          /* index into tokenizer.added, -1: none */
    uint8_t byte;
} trie_node;

typedef struct trie {
    trie_node *nodes;
    size_t n, cap;
    bool first[256];
    bool empty;
} trie;

static int32_t trie_new_node(trie *t, uint8_t byte) {
    if (t->n == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 64;
        trie_node *p = realloc(t->nodes, cap * sizeof *p);
        if (!p) return -1;
        t->nodes = p;
        t->cap = cap;
    }
    t->nodes[t->n] = (trie_node){-1, -1, -1, byte};
    return (int32_t)t->n++;
}

static int trie_insert(trie *t, const uint8_t *s, size_t n, int32_t token) {
    if (!t->n && trie_new_node(t, 0) < 0) return -1;
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t c = t->nodes[node].child;
        while (c >= 0 && t->nodes[c].byte != s[i]) c = t->nodes[c].sibling;
        if (c < 0) {
            c = trie_new_node(t, s[i]);
            if (c < 0) return -1;
            t->nodes[c].sibling = t->nodes[node].child;
            t->nodes[node].child = c;
        }
        node = c;
    }
    t->nodes[node].token = token;
    t->first[s[0]] = true;
    t->empty = false;
    return 0;
}

/* Leftmost-longest match in S[from..n): true, with the match in *start, *end, *token. */
static bool trie_find(const trie *t, const uint8_t *s, size_t n, size_t from, size_t *start, size_t *end,
                      int32_t *token) {
    if (t->empty) return false;
    for (size_t i = from; i < n; i++) {
        if (!t->first[s[i]]) continue;
        int32_t node = 0, best = -1;
        size_t best_end = 0;
        for (size_t k = i; k < n; k++) {
            int32_t c = t->nodes[node].child;
            while (c >= 0 && t->nodes[c].byte != s[k]) c = t->nodes[c].sibling;
            if (c < 0) break;
            node = c;
            if (t->nodes[c].token >= 0) {
                best = t->nodes[c].token;
                best_end = k + 1;
            }
        }
        if (best >= 0) {
            *start = i;
            *end = best_end;
            *token = best;
            return true;
        }
    }
    return false;
}

/* ======================================================================
 * The tokenizer
 * ====================================================================== */

/* Split steps at most (each level of pieces has its own buffer). */
#define MAX_DEPTH 64

typedef enum { BEH_REMOVED, BEH_ISOLATED, BEH_MERGED_PREV, BEH_MERGED_NEXT, BEH_CONTIGUOUS } split_behavior;

typedef struct split_step {
    pcre2_code *re;
    split_behavior behavior;
    bool invert;
    char *label; /* "pre_tokenizer.pretokenizers[i]" for messages */
} split_step;

typedef struct added_entry {
    uint32_t id;
    bool single_word, lstrip, rstrip;
} added_entry;

typedef struct merge_slot {
    uint64_t key; /* left << 32 | right; UINT64_MAX: empty */
    uint32_t rank, merged;
} merge_slot;

struct ds41_tokenizer {
    const ds41_vocab *vocab;
    ds41_vocab *owned;

    added_entry *added;
    trie tries[2]; /* [0]: normalized=false, [1]: normalized=true */

    split_step *steps;
    size_t n_steps;
    bool add_prefix_space;
    pcre2_code *gpt2; /* ByteLevel use_regex, else NULL */

    uint32_t byte_id[256];
    bool ignore_merges;
    merge_slot *merges;
    uint64_t merge_mask;

    uint32_t size;
    uint32_t *dec_off; /* [size + 1]; dec_off[i] == dec_off[i+1] with !exists: none */
    uint8_t *dec_bytes;
    uint8_t *flags; /* [size]: bit 0 exists, bit 1 special */
    uint32_t *byte_order, *byte_lcp; /* ds41_tokenizer_byte_order */
    size_t n_byte_order;
};

#define F_EXISTS 1
#define F_SPECIAL 2

static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static const merge_slot *merge_find(const ds41_tokenizer *t, uint32_t left, uint32_t right) {
    uint64_t key = (uint64_t)left << 32 | right;
    uint64_t i = mix64(key) & t->merge_mask;
    for (;;) {
        const merge_slot *s = &t->merges[i];
        if (s->key == key) return s;
        if (s->key == UINT64_MAX) return NULL;
        i = (i + 1) & t->merge_mask;
    }
}

void ds41_token_ids_free(ds41_token_ids *ids) {
    if (!ids) return;
    free(ids->ids);
    ids->ids = NULL;
    ids->n = ids->cap = 0;
}

static bool ids_push(ds41_token_ids *o, uint32_t id) {
    if (o->n == o->cap) {
        size_t cap = o->cap ? 2 * o->cap : 64;
        uint32_t *p = realloc(o->ids, cap * sizeof *p);
        if (!p) return false;
        o->ids = p;
        o->cap = cap;
    }
    o->ids[o->n++] = id;
    return true;
}

void ds41_tokenizer_free(ds41_tokenizer *t) {
    if (!t) return;
    free(t->added);
    for (int i = 0; i < 2; i++) free(t->tries[i].nodes);
    for (size_t i = 0; i < t->n_steps; i++) {
        pcre2_code_free(t->steps[i].re);
        free(t->steps[i].label);
    }
    free(t->steps);
    pcre2_code_free(t->gpt2);
    free(t->merges);
    free(t->dec_off);
    free(t->dec_bytes);
    free(t->flags);
    free(t->byte_order);
    free(t->byte_lcp);
    ds41_vocab_free(t->owned);
    free(t);
}

const ds41_vocab *ds41_tokenizer_vocab(const ds41_tokenizer *t) {
    return t->vocab;
}

/* The pre_tokenizer: Split steps then exactly one ByteLevel. */
static int add_pretok(ds41_tokenizer *t, json_t *node, const char *path, bool *seen_byte_level, ds41_error *err) {
    if (json_is_null(node)) return 0;
    if (!json_is_object(node)) return ds41_fail(err, "%s: must be an object", path);
    const char *type = json_string_value(json_object_get(node, "type"));
    if (!type) return ds41_fail(err, "%s.type: missing", path);
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(node, "pretokenizers");
        if (!json_is_array(list)) return ds41_fail(err, "%s.pretokenizers: must be an array", path);
        for (size_t i = 0; i < json_array_size(list); i++) {
            char sub[512];
            snprintf(sub, sizeof sub, "%s.pretokenizers[%zu]", path, i);
            if (add_pretok(t, json_array_get(list, i), sub, seen_byte_level, err) < 0) return -1;
        }
        return 0;
    }
    if (!strcmp(type, "ByteLevel")) {
        if (*seen_byte_level) return ds41_fail(err, "%s: a second ByteLevel step is not supported", path);
        *seen_byte_level = true;
        json_t *aps = json_object_get(node, "add_prefix_space"), *ur = json_object_get(node, "use_regex");
        t->add_prefix_space = aps ? json_is_true(aps) : true;
        bool use_regex = ur ? json_is_true(ur) : true;
        if (use_regex) {
            static const char gpt2[] =
                "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
            t->gpt2 = compile_regex(gpt2, sizeof gpt2 - 1, false, err);
            if (!t->gpt2) return ds41_error_prefix(err, "%s (use_regex)", path);
        }
        return 0;
    }
    if (!strcmp(type, "Split")) {
        if (*seen_byte_level) return ds41_fail(err, "%s: a Split after ByteLevel is not supported", path);
        if (t->n_steps >= MAX_DEPTH) return ds41_fail(err, "%s: more than %d Split steps", path, MAX_DEPTH);
        json_t *pat = json_object_get(node, "pattern");
        json_t *rx = json_object_get(pat, "Regex"), *str = json_object_get(pat, "String");
        if (!json_is_string(rx) && !json_is_string(str))
            return ds41_fail(err, "%s.pattern: must be {\"Regex\": ...} or {\"String\": ...}", path);
        const char *beh = json_string_value(json_object_get(node, "behavior"));
        static const char *const names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext",
                                            "Contiguous"};
        int b = -1;
        for (int i = 0; i < 5 && beh; i++)
            if (!strcmp(beh, names[i])) b = i;
        if (b < 0) return ds41_fail(err, "%s.behavior: '%s' is not a Split behavior", path, beh ? beh : "(missing)");
        json_t *inv = json_object_get(node, "invert");
        if (inv && !json_is_boolean(inv)) return ds41_fail(err, "%s.invert: must be true or false", path);
        json_t *p = rx ? rx : str;
        if (!rx && json_string_length(str) == 0)
            return ds41_fail(err, "%s.pattern: an empty String pattern is not supported", path);
        split_step *steps = realloc(t->steps, (t->n_steps + 1) * sizeof *steps);
        if (!steps) return ds41_fail(err, "out of memory");
        t->steps = steps;
        split_step *s = &t->steps[t->n_steps];
        memset(s, 0, sizeof *s);
        s->label = strdup(path);
        if (!s->label) return ds41_fail(err, "out of memory");
        t->n_steps++;
        s->behavior = (split_behavior)b;
        s->invert = json_is_true(inv);
        s->re = compile_regex(json_string_value(p), json_string_length(p), !rx, err);
        if (!s->re) return ds41_error_prefix(err, "%s.pattern", path);
        return 0;
    }
    return ds41_fail(err, "%s: pre-tokenizer type '%s' is not supported (only Split, ByteLevel, Sequence)", path,
                     type);
}

static int build_pretokenizer(ds41_tokenizer *t, ds41_error *err) {
    const char *js = ds41_vocab_component_json(t->vocab, DS41_VOCAB_PRE_TOKENIZER);
    json_error_t je;
    json_t *root = json_loads(js ? js : "null", JSON_DECODE_ANY, &je);
    if (!root) return ds41_fail(err, "pre_tokenizer: unreadable JSON: %s", je.text);
    bool seen = false;
    int rc = add_pretok(t, root, "pre_tokenizer", &seen, err);
    json_decref(root);
    if (rc < 0) return -1;
    if (!seen) return ds41_fail(err, "pre_tokenizer: no ByteLevel step (a byte-level BPE model needs one)");
    return 0;
}

static int build_added(ds41_tokenizer *t, ds41_error *err) {
    size_t n = ds41_vocab_n_added(t->vocab);
    t->added = calloc(n ? n : 1, sizeof *t->added);
    if (!t->added) return ds41_fail(err, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const ds41_added_token *a = ds41_vocab_added_at(t->vocab, i);
        t->added[i] = (added_entry){a->id, a->single_word, a->lstrip, a->rstrip};
        trie *tr = &t->tries[a->normalized ? 1 : 0];
        if (trie_insert(tr, (const uint8_t *)a->content, a->content_len, (int32_t)i) < 0)
            return ds41_fail(err, "out of memory");
    }
    return 0;
}

static int build_bpe(ds41_tokenizer *t, ds41_error *err) {
    for (int b = 0; b < 256; b++) {
        uint32_t cp = ds41_byte_level_char((uint8_t)b);
        char s[4];
        size_t n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : 3;
        if (n == 1)
            s[0] = (char)cp;
        else if (n == 2) {
            s[0] = (char)(0xC0 | cp >> 6);
            s[1] = (char)(0x80 | (cp & 0x3F));
        } else {
            s[0] = (char)(0xE0 | cp >> 12);
            s[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
            s[2] = (char)(0x80 | (cp & 0x3F));
        }
        int32_t id = ds41_vocab_find_model(t->vocab, s, n);
        if (id < 0)
            return ds41_fail(err,
                             "model.vocab: the byte-level token for byte 0x%02X (U+%04X) is missing (not supported: "
                             "Hugging Face would need unk_token or drop the byte)",
                             b, cp);
        t->byte_id[b] = (uint32_t)id;
    }
    t->ignore_merges = ds41_vocab_ignore_merges(t->vocab);
    size_t nm = ds41_vocab_n_merges(t->vocab);
    size_t cap = 16;
    while (cap < 2 * nm + 1) cap <<= 1;
    t->merges = malloc(cap * sizeof *t->merges);
    if (!t->merges) return ds41_fail(err, "out of memory");
    for (size_t i = 0; i < cap; i++) t->merges[i].key = UINT64_MAX;
    t->merge_mask = cap - 1;
    const ds41_merge *m = ds41_vocab_merges(t->vocab);
    for (size_t r = 0; r < nm; r++) {
        uint64_t key = (uint64_t)m[r].left << 32 | m[r].right;
        uint64_t i = mix64(key) & t->merge_mask;
        while (t->merges[i].key != UINT64_MAX && t->merges[i].key != key) i = (i + 1) & t->merge_mask;
        if (t->merges[i].key == key) continue; /* the vocabulary rejects duplicates; keep the first */
        t->merges[i] = (merge_slot){key, (uint32_t)r, m[r].merged};
    }
    return 0;
}

typedef struct byte_key {
    const uint8_t *b;
    uint32_t len, id;
} byte_key;

static int byte_key_cmp(const void *a, const void *b) {
    const byte_key *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int r = memcmp(x->b, y->b, n);
    if (r) return r;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The ordinary tokens sorted by their bytes, with each one's common prefix with the one before:
 * a walk in this order is a walk of the vocabulary's byte trie (constrained decoding tests each
 * shared prefix once). */
static int build_byte_order(ds41_tokenizer *t, ds41_error *err) {
    byte_key *k = malloc((t->size ? t->size : 1) * sizeof *k);
    if (!k) return ds41_fail(err, "out of memory");
    size_t n = 0;
    for (uint32_t id = 0; id < t->size; id++) {
        uint32_t len = t->dec_off[id + 1] - t->dec_off[id];
        if ((t->flags[id] & F_EXISTS) && !(t->flags[id] & F_SPECIAL) && len)
            k[n++] = (byte_key){t->dec_bytes + t->dec_off[id], len, id};
    }
    qsort(k, n, sizeof *k, byte_key_cmp);
    t->byte_order = malloc((n ? n : 1) * sizeof *t->byte_order);
    t->byte_lcp = malloc((n ? n : 1) * sizeof *t->byte_lcp);
    if (!t->byte_order || !t->byte_lcp) {
        free(k);
        return ds41_fail(err, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t l = 0;
        if (i)
            while (l < k[i].len && l < k[i - 1].len && k[i].b[l] == k[i - 1].b[l]) l++;
        t->byte_order[i] = k[i].id;
        t->byte_lcp[i] = l;
    }
    t->n_byte_order = n;
    free(k);
    return 0;
}

const uint32_t *ds41_tokenizer_byte_order(const ds41_tokenizer *t, const uint32_t **lcp, size_t *n) {
    *lcp = t->byte_lcp;
    *n = t->n_byte_order;
    return t->byte_order;
}

static int build_decode(ds41_tokenizer *t, ds41_error *err) {
    t->size = ds41_vocab_size(t->vocab);
    t->dec_off = calloc((size_t)t->size + 1, sizeof *t->dec_off);
    t->flags = calloc(t->size ? t->size : 1, 1);
    size_t total = 0;
    for (uint32_t id = 0; id < t->size; id++) {
        size_t len = 0;
        if (ds41_vocab_token_string(t->vocab, id, &len)) total += len;
    }
    if (total > UINT32_MAX) return ds41_fail(err, "the decoded tokens exceed 4 GiB");
    t->dec_bytes = malloc(total ? total : 1);
    if (!t->dec_off || !t->flags || !t->dec_bytes) return ds41_fail(err, "out of memory");
    size_t off = 0;
    for (uint32_t id = 0; id < t->size; id++) {
        t->dec_off[id] = (uint32_t)off;
        size_t len = 0;
        if (ds41_vocab_decode_id(t->vocab, id, t->dec_bytes + off, total - off, &len) == 0) {
            off += len;
            t->flags[id] |= F_EXISTS;
            const ds41_added_token *a = ds41_vocab_added_token(t->vocab, id);
            if (a && a->special) t->flags[id] |= F_SPECIAL;
        }
    }
    t->dec_off[t->size] = (uint32_t)off;
    return build_byte_order(t, err);
}

ds41_tokenizer *ds41_tokenizer_new(const ds41_vocab *vocab, ds41_error *err) {
    ds41_tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        ds41_fail(err, "out of memory");
        return NULL;
    }
    t->vocab = vocab;
    t->tries[0].empty = t->tries[1].empty = true;
    if (!ds41_vocab_normalizer_is_identity(vocab)) {
        const char *js = ds41_vocab_component_json(vocab, DS41_VOCAB_NORMALIZER);
        ds41_fail(err, "normalizer: %.200s is not supported (only none or an empty Sequence)", js ? js : "?");
        goto fail;
    }
    if (build_pretokenizer(t, err) < 0 || build_added(t, err) < 0 || build_bpe(t, err) < 0 ||
        build_decode(t, err) < 0)
        goto fail;
    return t;
fail:
    ds41_tokenizer_free(t);
    return NULL;
}

ds41_tokenizer *ds41_tokenizer_load(const char *path, ds41_error *err) {
    ds41_vocab *v = ds41_vocab_load(path, err);
    if (!v) return NULL;
    ds41_tokenizer *t = ds41_tokenizer_new(v, err);
    if (!t) {
        ds41_error_prefix(err, "%s", path);
        ds41_vocab_free(v);
        return NULL;
    }
    t->owned = v;
    return t;
}

/* ======================================================================
 * Encoding
 * ====================================================================== */

typedef struct seg {
    size_t start, end;
    int64_t token; /* added-token index, -1: text */
} seg;

typedef struct seg_vec {
    seg *v;
    size_t n, cap;
} seg_vec;

static bool seg_push(seg_vec *s, size_t start, size_t end, int64_t token) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 16;
        seg *p = realloc(s->v, cap * sizeof *p);
        if (!p) return false;
        s->v = p;
        s->cap = cap;
    }
    s->v[s->n++] = (seg){start, end, token};
    return true;
}

typedef struct sym {
    uint32_t id;
    int32_t prev, next;
    bool alive;
} sym;

typedef struct heap_item {
    uint32_t rank, pos, merged;
} heap_item;

typedef struct cache_slot {
    uint64_t hash;
    uint32_t key_off, key_len, ids_off, ids_n; /* key_len == UINT32_MAX: empty */
} cache_slot;

#define CACHE_SLOTS 16384u
#define CACHE_MAX_KEY 96u

typedef struct enc {
    const ds41_tokenizer *t;
    ds41_token_ids *out;
    ds41_error *err;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit;
    seg_vec pieces[MAX_DEPTH + 1];
    seg_vec matches;
    seg_vec added1, added2;
    sym *syms;
    size_t syms_cap;
    heap_item *heap;
    size_t heap_cap;
    char *buf, *map;
    size_t buf_cap, map_cap;
    cache_slot *cache;
    uint8_t *cache_keys;
    uint32_t *cache_ids;
    size_t cache_used, keys_n, keys_cap, cids_n, cids_cap;
} enc;

static int oom(enc *e) {
    return ds41_fail(e->err, "out of memory while encoding");
}

static bool grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q) return false;
    *p = q;
    *cap = c;
    return true;
}

/* One regex search from START; 1 with (*ms, *me), 0 no match, -1 error. */
static int regex_search(enc *e, const pcre2_code *re, const char *s, size_t n, size_t start, size_t *ms, size_t *me,
                        const char *what) {
    for (int attempt = 0; attempt < 2; attempt++) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK, e->md, e->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) return 0;
        if (rc >= 0) {
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
            if (ov[0] < start || ov[1] < ov[0] || ov[1] > n)
                return ds41_fail(e->err, "%s: the regex gave an inconsistent match (\\K?)", what);
            *ms = ov[0];
            *me = ov[1];
            return 1;
        }
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !e->jit) {
            e->jit = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, NULL);
            if (!e->jit) return oom(e);
            pcre2_jit_stack_assign(e->mctx, NULL, e->jit);
            continue;
        }
        PCRE2_UCHAR msg[200];
        pcre2_get_error_message(rc, msg, sizeof msg);
        return ds41_fail(e->err, "%s: regex match failed: %s", what, (const char *)msg);
    }
    return ds41_fail(e->err, "%s: regex match failed: JIT stack limit", what);
}

/* Matches of RE over S[0..n) as the onig crate's find_iter enumerates them,
 * interleaved with the gaps (HF's Pattern::find_matches), into e->matches
 * (token field: 1 match, 0 gap). */
static int find_matches(enc *e, const pcre2_code *re, const char *s, size_t n, const char *what) {
    e->matches.n = 0;
    if (n == 0) return seg_push(&e->matches, 0, 0, 0) ? 0 : oom(e);
    size_t last_end = 0, prev = 0, last_match_end = 0;
    bool have_last = false;
    while (last_end <= n) {
        size_t ms = 0, me = 0;
        int rc = regex_search(e, re, s, n, last_end, &ms, &me, what);
        if (rc < 0) return -1;
        if (rc == 0) break;
        if (ms == me && have_last && last_match_end == me) {
            size_t k = 1;
            if (last_end < n) utf8_get((const uint8_t *)s + last_end, n - last_end, &k);
            last_end += k;
            continue;
        }
        last_end = me;
        last_match_end = me;
        have_last = true;
        if (prev != ms && !seg_push(&e->matches, prev, ms, 0)) return oom(e);
        if (!seg_push(&e->matches, ms, me, 1)) return oom(e);
        prev = me;
    }
    if (prev != n && !seg_push(&e->matches, prev, n, 0)) return oom(e);
    return 0;
}

/* e->matches -> OUT as HF's NormalizedString::split with BEHAVIOR (token
 * field of OUT: 1 = removed); then the empty and removed ones dropped. */
static int apply_behavior(enc *e, split_behavior behavior, bool invert, seg_vec *out) {
    out->n = 0;
    seg *m = e->matches.v;
    size_t n = e->matches.n;
    if (invert)
        for (size_t i = 0; i < n; i++) m[i].token = !m[i].token;
    bool prev = false;
    switch (behavior) {
    case BEH_ISOLATED:
        for (size_t i = 0; i < n; i++)
            if (!seg_push(out, m[i].start, m[i].end, 0)) return oom(e);
        break;
    case BEH_REMOVED:
        for (size_t i = 0; i < n; i++)
            if (!seg_push(out, m[i].start, m[i].end, m[i].token)) return oom(e);
        break;
    case BEH_CONTIGUOUS:
        for (size_t i = 0; i < n; i++) {
            bool is = m[i].token != 0;
            if (is == prev && out->n)
                out->v[out->n - 1].end = m[i].end;
            else if (!seg_push(out, m[i].start, m[i].end, 0))
                return oom(e);
            prev = is;
        }
        break;
    case BEH_MERGED_PREV:
        for (size_t i = 0; i < n; i++) {
            bool is = m[i].token != 0;
            if (is && !prev && out->n)
                out->v[out->n - 1].end = m[i].end;
            else if (!seg_push(out, m[i].start, m[i].end, 0))
                return oom(e);
            prev = is;
        }
        break;
    case BEH_MERGED_NEXT:
        for (size_t k = n; k-- > 0;) {
            bool is = m[k].token != 0;
            if (is && !prev && out->n)
                out->v[out->n - 1].start = m[k].start;
            else if (!seg_push(out, m[k].start, m[k].end, 0))
                return oom(e);
            prev = is;
        }
        for (size_t i = 0, j = out->n ? out->n - 1 : 0; i < j; i++, j--) {
            seg tmp = out->v[i];
            out->v[i] = out->v[j];
            out->v[j] = tmp;
        }
        break;
    }
    size_t w = 0;
    for (size_t i = 0; i < out->n; i++)
        if (!out->v[i].token && out->v[i].end > out->v[i].start) out->v[w++] = out->v[i];
    out->n = w;
    return 0;
}

static bool emit(enc *e, uint32_t id) {
    return ids_push(e->out, id);
}

static int cache_lookup(enc *e, const uint8_t *s, size_t n, uint64_t h) {
    if (!e->cache) return 0;
    uint32_t i = (uint32_t)h & (CACHE_SLOTS - 1);
    for (;;) {
        cache_slot *c = &e->cache[i];
        if (c->key_len == UINT32_MAX) return 0;
        if (c->hash == h && c->key_len == n && !memcmp(e->cache_keys + c->key_off, s, n)) {
            for (uint32_t k = 0; k < c->ids_n; k++)
                if (!emit(e, e->cache_ids[c->ids_off + k])) return oom(e);
            return 1;
        }
        i = (i + 1) & (CACHE_SLOTS - 1);
    }
}

static void cache_store(enc *e, const uint8_t *s, size_t n, uint64_t h, const uint32_t *ids, size_t n_ids) {
    if (e->cache_used >= CACHE_SLOTS / 2) return; /* full enough: stop caching */
    if (!e->cache) {
        e->cache = malloc(CACHE_SLOTS * sizeof *e->cache);
        if (!e->cache) return;
        for (uint32_t i = 0; i < CACHE_SLOTS; i++) e->cache[i].key_len = UINT32_MAX;
    }
    if (!grow((void **)&e->cache_keys, &e->keys_cap, e->keys_n + n, 1) ||
        !grow((void **)&e->cache_ids, &e->cids_cap, e->cids_n + n_ids, sizeof(uint32_t)))
        return;
    uint32_t i = (uint32_t)h & (CACHE_SLOTS - 1);
    while (e->cache[i].key_len != UINT32_MAX) i = (i + 1) & (CACHE_SLOTS - 1);
    memcpy(e->cache_keys + e->keys_n, s, n);
    memcpy(e->cache_ids + e->cids_n, ids, n_ids * sizeof *ids);
    e->cache[i] = (cache_slot){h, (uint32_t)e->keys_n, (uint32_t)n, (uint32_t)e->cids_n, (uint32_t)n_ids};
    e->keys_n += n;
    e->cids_n += n_ids;
    e->cache_used++;
}

static bool heap_less(const heap_item *a, const heap_item *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(heap_item *h, size_t *n, heap_item it) {
    size_t i = (*n)++;
    h[i] = it;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&h[i], &h[p])) break;
        heap_item tmp = h[i];
        h[i] = h[p];
        h[p] = tmp;
        i = p;
    }
}

static heap_item heap_pop(heap_item *h, size_t *n) {
    heap_item top = h[0];
    h[0] = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < *n && heap_less(&h[l], &h[m])) m = l;
        if (r < *n && heap_less(&h[r], &h[m])) m = r;
        if (m == i) break;
        heap_item tmp = h[i];
        h[i] = h[m];
        h[m] = tmp;
        i = m;
    }
    return top;
}

/* BPE on one piece (raw bytes; the byte-level alphabet is implied). */
static int bpe(enc *e, const uint8_t *s, size_t n) {
    const ds41_tokenizer *t = e->t;
    if (n == 0) return 0;
    if (n == 1) return emit(e, t->byte_id[s[0]]) ? 0 : oom(e);
    if (n > INT32_MAX) return ds41_fail(e->err, "a pre-tokenized piece of %zu bytes is too long", n);
    if (t->ignore_merges) {
        /* The piece in the byte alphabet, looked up whole in model.vocab. */
        if (!grow((void **)&e->map, &e->map_cap, 3 * n, 1)) return oom(e);
        size_t o = 0;
        for (size_t i = 0; i < n; i++) {
            uint32_t cp = ds41_byte_level_char(s[i]);
            if (cp < 0x80)
                e->map[o++] = (char)cp;
            else {
                e->map[o++] = (char)(0xC0 | cp >> 6);
                e->map[o++] = (char)(0x80 | (cp & 0x3F));
            }
        }
        int32_t id = ds41_vocab_find_model(t->vocab, e->map, o);
        if (id >= 0) return emit(e, (uint32_t)id) ? 0 : oom(e);
    }
    uint64_t h = 0;
    bool cacheable = n <= CACHE_MAX_KEY;
    if (cacheable) {
        h = 0xcbf29ce484222325ull;
        for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 0x100000001b3ull;
        h = mix64(h);
        int rc = cache_lookup(e, s, n, h);
        if (rc) return rc < 0 ? -1 : 0;
    }
    if (!grow((void **)&e->syms, &e->syms_cap, n, sizeof *e->syms) ||
        !grow((void **)&e->heap, &e->heap_cap, n, sizeof *e->heap))
        return oom(e);
    sym *y = e->syms;
    for (size_t i = 0; i < n; i++)
        y[i] = (sym){t->byte_id[s[i]], (int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1, true};
    size_t hn = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        const merge_slot *m = merge_find(t, y[i].id, y[i + 1].id);
        if (m) heap_push(e->heap, &hn, (heap_item){m->rank, (uint32_t)i, m->merged});
    }
    /* Each merge removes a symbol and pushes at most two entries, so the
     * heap never holds more than n - 1 + 2 (n - 1) entries... bounded below. */
    while (hn) {
        heap_item top = heap_pop(e->heap, &hn);
        sym *a = &y[top.pos];
        if (!a->alive || a->next < 0) continue;
        sym *b = &y[a->next];
        const merge_slot *m = merge_find(t, a->id, b->id);
        if (!m || m->merged != top.merged) continue; /* stale */
        a->id = top.merged;
        b->alive = false;
        a->next = b->next;
        if (b->next >= 0) y[b->next].prev = (int32_t)top.pos;
        if (hn + 2 > e->heap_cap &&
            !grow((void **)&e->heap, &e->heap_cap, hn + 2, sizeof *e->heap))
            return oom(e);
        if (a->prev >= 0) {
            const merge_slot *pm = merge_find(t, y[a->prev].id, a->id);
            if (pm) heap_push(e->heap, &hn, (heap_item){pm->rank, (uint32_t)a->prev, pm->merged});
        }
        if (a->next >= 0) {
            const merge_slot *nm = merge_find(t, a->id, y[a->next].id);
            if (nm) heap_push(e->heap, &hn, (heap_item){nm->rank, top.pos, nm->merged});
        }
    }
    size_t first = e->out->n;
    for (int32_t i = 0; i >= 0; i = y[i].next)
        if (!emit(e, y[i].id)) return oom(e);
    if (cacheable) cache_store(e, s, n, h, e->out->ids + first, e->out->n - first);
    return 0;
}

/* ByteLevel on one piece: prefix space, optional GPT-2 split, BPE. */
static int byte_level(enc *e, const char *s, size_t n) {
    const ds41_tokenizer *t = e->t;
    if (t->add_prefix_space && s[0] != ' ') {
        if (!grow((void **)&e->buf, &e->buf_cap, n + 1, 1)) return oom(e);
        e->buf[0] = ' ';
        memcpy(e->buf + 1, s, n);
        s = e->buf;
        n++;
    }
    if (!t->gpt2) return bpe(e, (const uint8_t *)s, n);
    if (find_matches(e, t->gpt2, s, n, "pre_tokenizer ByteLevel (use_regex)") < 0) return -1;
    seg_vec *pieces = &e->pieces[MAX_DEPTH];
    if (apply_behavior(e, BEH_ISOLATED, false, pieces) < 0) return -1;
    for (size_t i = 0; i < pieces->n; i++)
        if (bpe(e, (const uint8_t *)s + pieces->v[i].start, pieces->v[i].end - pieces->v[i].start) < 0) return -1;
    return 0;
}

static int pretokenize(enc *e, const char *s, size_t n, size_t depth) {
    const ds41_tokenizer *t = e->t;
    if (n == 0) return 0;
    if (depth == t->n_steps) return byte_level(e, s, n);
    const split_step *st = &t->steps[depth];
    if (find_matches(e, st->re, s, n, st->label) < 0) return -1;
    seg_vec *pieces = &e->pieces[depth];
    if (apply_behavior(e, st->behavior, st->invert, pieces) < 0) return -1;
    for (size_t i = 0; i < pieces->n; i++) {
        /* pieces[depth] stays untouched by deeper levels */
        const seg p = pieces->v[i];
        if (pretokenize(e, s + p.start, p.end - p.start, depth + 1) < 0) return -1;
    }
    return 0;
}

/* HF's AddedVocabulary::find_matches over S[0..n) with trie TR. */
static int added_split(enc *e, const trie *tr, const uint8_t *s, size_t n, seg_vec *out) {
    out->n = 0;
    size_t start_offset = 0, pos = 0;
    while (pos < n) {
        size_t ms, me;
        int32_t tok;
        if (!trie_find(tr, s, n, pos, &ms, &me, &tok)) break;
        pos = me;
        const added_entry *a = &e->t->added[tok];
        if (a->single_word) {
            bool start_space = ms == 0 || !rust_is_word(utf8_get_before(s, ms));
            size_t k;
            bool stop_space = me == n || !rust_is_word(utf8_get(s + me, n - me, &k));
            if (!start_space || !stop_space) continue;
        }
        size_t start = ms, stop = me;
        if (a->lstrip) {
            size_t ns = start;
            while (ns > 0) {
                size_t b = ns - 1;
                while (b > 0 && (s[b] & 0xC0) == 0x80) b--;
                size_t k;
                if (!is_white_space(utf8_get(s + b, ns - b, &k))) break;
                ns = b;
            }
            start = ns > start_offset ? ns : start_offset;
        }
        if (a->rstrip) {
            while (stop < n) {
                size_t k;
                if (!is_white_space(utf8_get(s + stop, n - stop, &k))) break;
                stop += k;
            }
        }
        if (start_offset < start && !seg_push(out, start_offset, start, -1)) return oom(e);
        if (!seg_push(out, start, stop, tok)) return oom(e);
        start_offset = stop;
    }
    if (start_offset != n && !seg_push(out, start_offset, n, -1)) return oom(e);
    return 0;
}

static int encode_text(enc *e, const char *s, size_t n) {
    const ds41_tokenizer *t = e->t;
    if (added_split(e, &t->tries[0], (const uint8_t *)s, n, &e->added1) < 0) return -1;
    for (size_t i = 0; i < e->added1.n; i++) {
        seg a = e->added1.v[i];
        if (a.token >= 0) {
            if (!emit(e, t->added[a.token].id)) return oom(e);
            continue;
        }
        if (a.end <= a.start) continue;
        /* the identity normalizer, then the normalized=true tokens */
        if (added_split(e, &t->tries[1], (const uint8_t *)s + a.start, a.end - a.start, &e->added2) < 0) return -1;
        for (size_t j = 0; j < e->added2.n; j++) {
            seg b = e->added2.v[j];
            if (b.token >= 0) {
                if (!emit(e, t->added[b.token].id)) return oom(e);
                continue;
            }
            if (b.end > b.start && pretokenize(e, s + a.start + b.start, b.end - b.start, 0) < 0) return -1;
        }
    }
    return 0;
}

int ds41_tokenizer_encode(const ds41_tokenizer *t, const char *text, size_t len, ds41_token_ids *out,
                          ds41_error *err) {
    if (!text && len) return ds41_fail(err, "encode: NULL text");
    if (len == 0) return 0;
    size_t n0 = out->n;
    char *fixed = NULL;
    if (!ds41_utf8_valid(text, len, NULL)) {
        fixed = ds41_utf8_lossy((const uint8_t *)text, len, &len);
        if (!fixed) return ds41_fail(err, "out of memory while encoding");
        text = fixed;
    }
    enc e = {.t = t, .out = out, .err = err};
    e.md = pcre2_match_data_create(1, NULL);
    e.mctx = pcre2_match_context_create(NULL);
    int rc;
    if (!e.md || !e.mctx)
        rc = oom(&e);
    else
        rc = encode_text(&e, text, len);
    pcre2_match_data_free(e.md);
    pcre2_match_context_free(e.mctx);
    pcre2_jit_stack_free(e.jit);
    for (size_t i = 0; i <= MAX_DEPTH; i++) free(e.pieces[i].v);
    free(e.matches.v);
    free(e.added1.v);
    free(e.added2.v);
    free(e.syms);
    free(e.heap);
    free(e.buf);
    free(e.map);
    free(e.cache);
    free(e.cache_keys);
    free(e.cache_ids);
    free(fixed);
    if (rc < 0) out->n = n0;
    return rc < 0 ? -1 : 0;
}

/* ======================================================================
 * Decoding
 * ====================================================================== */

const uint8_t *ds41_tokenizer_token_bytes(const ds41_tokenizer *t, uint32_t id, size_t *len) {
    if (id >= t->size || !(t->flags[id] & F_EXISTS)) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = t->dec_off[id + 1] - t->dec_off[id];
    return t->dec_bytes + t->dec_off[id];
}

bool ds41_tokenizer_is_special(const ds41_tokenizer *t, uint32_t id) {
    return id < t->size && (t->flags[id] & F_SPECIAL);
}

/* Whether decode keeps ID. */
static bool decoded(const ds41_tokenizer *t, uint32_t id, bool skip_special) {
    return id < t->size && (t->flags[id] & F_EXISTS) && !(skip_special && (t->flags[id] & F_SPECIAL));
}

char *ds41_tokenizer_decode(const ds41_tokenizer *t, const uint32_t *ids, size_t n, bool skip_special,
                            size_t *out_len) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        if (decoded(t, ids[i], skip_special)) total += t->dec_off[ids[i] + 1] - t->dec_off[ids[i]];
    uint8_t *bytes = malloc(total ? total : 1);
    if (!bytes) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (!decoded(t, ids[i], skip_special)) continue;
        size_t l = t->dec_off[ids[i] + 1] - t->dec_off[ids[i]];
        memcpy(bytes + o, t->dec_bytes + t->dec_off[ids[i]], l);
        o += l;
    }
    char *text = ds41_utf8_lossy(bytes, o, out_len);
    free(bytes);
    return text;
}

struct ds41_detok {
    const ds41_tokenizer *t;
    bool skip_special;
    uint8_t pending[4];
    size_t n_pending;
    uint8_t *in;
    size_t in_cap;
    char *out;
    size_t out_cap;
};

ds41_detok *ds41_detok_new(const ds41_tokenizer *t, bool skip_special) {
    ds41_detok *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->t = t;
    d->skip_special = skip_special;
    return d;
}

void ds41_detok_free(ds41_detok *d) {
    if (!d) return;
    free(d->in);
    free(d->out);
    free(d);
}

size_t ds41_detok_pending(const ds41_detok *d) {
    return d->n_pending;
}

int ds41_detok_push(ds41_detok *d, uint32_t id, const char **text, size_t *len) {
    *text = "";
    *len = 0;
    if (!decoded(d->t, id, d->skip_special)) return 0;
    size_t bl;
    const uint8_t *bytes = ds41_tokenizer_token_bytes(d->t, id, &bl);
    size_t m = d->n_pending + bl;
    /* every input byte becomes at most 3 output bytes (U+FFFD) */
    if (!grow((void **)&d->in, &d->in_cap, m + 1, 1) || !grow((void **)&d->out, &d->out_cap, 3 * m + 1, 1))
        return -1;
    memcpy(d->in, d->pending, d->n_pending);
    if (bl) memcpy(d->in + d->n_pending, bytes, bl);
    size_t i = 0, o = 0;
    d->n_pending = 0;
    while (i < m) {
        size_t sub = 1;
        size_t k = ds41_utf8_sequence(d->in + i, m - i, &sub);
        if (k) {
            memcpy(d->out + o, d->in + i, k);
            o += k;
            i += k;
            continue;
        }
        if (ds41_utf8_truncated(d->in + i, m - i)) { /* may still become a character: hold it */
            memcpy(d->pending, d->in + i, m - i);
            d->n_pending = m - i;
            break;
        }
        memcpy(d->out + o, "\xEF\xBF\xBD", 3);
        o += 3;
        i += sub;
    }
    *text = d->out;
    *len = o;
    return 0;
}

int ds41_detok_finish(ds41_detok *d, const char **text, size_t *len) {
    if (d->n_pending) {
        d->n_pending = 0;
        *text = "\xEF\xBF\xBD";
        *len = 3;
    } else {
        *text = "";
        *len = 0;
    }
    return 0;
}
