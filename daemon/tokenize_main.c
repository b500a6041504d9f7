/* ds41-tokenize: encode or decode with a tokenizer.json, one JSON value per
 * line (see usage()).  Other checks drive it: keep the interface stable. */
#include "ds41_version.h"
#include "engine/text/tokenizer.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: ds41-tokenize TOKENIZER_JSON [--decode] [--skip-special]\n"
            "       ds41-tokenize --version\n"
            "\n"
            "Encode: reads one JSON string per line on stdin and writes one JSON array\n"
            "of token ids per line (Hugging Face encode(text, add_special_tokens=false):\n"
            "no BOS is added; added tokens in the text are matched).\n"
            "Decode (--decode): reads one JSON array of ids per line and writes one JSON\n"
            "string per line (Hugging Face decode; --skip-special drops added tokens\n"
            "marked special; ids the vocabulary does not have are skipped, as HF does).\n"
            "\n"
            "A line that cannot be read (not JSON, wrong type, an id that is not an\n"
            "integer in [0, 2^32)) gives 'null' on stdout, so output line N still answers\n"
            "input line N, and a message naming the line on stderr; the tool goes on and\n"
            "exits 1 at the end.  Exit 0: every line answered; 2: bad arguments or the\n"
            "tokenizer cannot be loaded.\n");
}

static int encode_line(const ds41_tokenizer *t, const char *line, size_t len, ds41_token_ids *ids, FILE *out,
                       char *why, size_t why_len) {
    json_error_t je;
    json_t *v = json_loadb(line, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!v) {
        snprintf(why, why_len, "not JSON: %s", je.text);
        return -1;
    }
    if (!json_is_string(v)) {
        json_decref(v);
        snprintf(why, why_len, "expected a JSON string");
        return -1;
    }
    ds41_error err = {{0}};
    ids->n = 0;
    int rc = ds41_tokenizer_encode(t, json_string_value(v), json_string_length(v), ids, &err);
    json_decref(v);
    if (rc < 0) {
        snprintf(why, why_len, "%s", err.msg);
        return -1;
    }
    fputc('[', out);
    for (size_t i = 0; i < ids->n; i++) fprintf(out, i ? ",%u" : "%u", ids->ids[i]);
    fputs("]\n", out);
    return 0;
}

static int decode_line(const ds41_tokenizer *t, const char *line, size_t len, bool skip, ds41_token_ids *ids,
                       FILE *out, char *why, size_t why_len) {
    json_error_t je;
    json_t *v = json_loadb(line, len, JSON_DECODE_ANY, &je);
    if (!v) {
        snprintf(why, why_len, "not JSON: %s", je.text);
        return -1;
    }
    if (!json_is_array(v)) {
        json_decref(v);
        snprintf(why, why_len, "expected a JSON array of ids");
        return -1;
    }
    ids->n = 0;
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > (json_int_t)UINT32_MAX) {
            json_decref(v);
            snprintf(why, why_len, "element %zu is not an integer id in [0, 2^32)", i);
            return -1;
        }
        if (ids->n == ids->cap) {
            size_t cap = ids->cap ? 2 * ids->cap : 64;
            uint32_t *p = realloc(ids->ids, cap * sizeof *p);
            if (!p) {
                json_decref(v);
                snprintf(why, why_len, "out of memory");
                return -1;
            }
            ids->ids = p;
            ids->cap = cap;
        }
        ids->ids[ids->n++] = (uint32_t)json_integer_value(x);
    }
    json_decref(v);
    size_t n;
    char *text = ds41_tokenizer_decode(t, ids->ids, ids->n, skip, &n);
    if (!text) {
        snprintf(why, why_len, "out of memory");
        return -1;
    }
    json_t *s = json_stringn_nocheck(text, n);
    free(text);
    char *js = s ? json_dumps(s, JSON_ENCODE_ANY) : NULL;
    json_decref(s);
    if (!js) {
        snprintf(why, why_len, "out of memory");
        return -1;
    }
    fputs(js, out);
    fputc('\n', out);
    free(js);
    return 0;
}

int main(int argc, char **argv) {
    const char *path = NULL;
    bool decode = false, skip = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--decode"))
            decode = true;
        else if (!strcmp(argv[i], "--skip-special"))
            skip = true;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--version")) {
            puts("ds41-tokenize " DS41_VERSION);
            return 0;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "ds41-tokenize: unknown option '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        } else if (path) {
            fprintf(stderr, "ds41-tokenize: more than one TOKENIZER_JSON\n");
            return 2;
        } else
            path = argv[i];
    }
    if (!path) {
        usage(stderr);
        return 2;
    }
    if (skip && !decode) {
        fprintf(stderr, "ds41-tokenize: --skip-special only applies with --decode\n");
        return 2;
    }
    ds41_error err = {{0}};
    ds41_tokenizer *t = ds41_tokenizer_load(path, &err);
    if (!t) {
        fprintf(stderr, "ds41-tokenize: %s\n", err.msg);
        return 2;
    }
    char *line = NULL;
    size_t cap = 0, lineno = 0;
    ssize_t got;
    int status = 0;
    ds41_token_ids ids = {0};
    char why[DS41_ERROR_MAX + 64];
    while ((got = getline(&line, &cap, stdin)) >= 0) {
        lineno++;
        size_t len = (size_t)got;
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r')) len--;
        int rc = decode ? decode_line(t, line, len, skip, &ids, stdout, why, sizeof why)
                        : encode_line(t, line, len, &ids, stdout, why, sizeof why);
        if (rc < 0) {
            fprintf(stderr, "ds41-tokenize: line %zu: %s\n", lineno, why);
            fputs("null\n", stdout);
            status = 1;
        }
    }
    free(line);
    ds41_token_ids_free(&ids);
    ds41_tokenizer_free(t);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "ds41-tokenize: cannot write stdout\n");
        return 1;
    }
    return status;
}
