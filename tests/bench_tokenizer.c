/* Tokenizer throughput: MB/s of ds41_tokenizer_encode and _decode on a large
 * mixed text (built, not run as a test).
 *
 * usage: bench_tokenizer TOKENIZER_JSON [--mb N] [--save FILE] [--text FILE]
 *   --mb N       size of the generated text in MB (default 8)
 *   --save FILE  also write the generated text there (for the HF side,
 *                tests/tools/bench_tokenizer.sh)
 *   --text FILE  use this text instead of generating one
 * The text is deterministic: English prose, code, Chinese and Japanese,
 * Greek and Cyrillic, digits, emoji, whitespace runs and chat-template
 * special tokens, in paragraphs of ~1 KB.  Encode runs on the whole text in
 * one call; decode on the resulting ids.  Each is run 3 times, best kept. */
#include "engine/text/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t state = 12345;
static uint64_t rnd(void) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static const char *const pieces[] = {
    "The quick brown fox jumps over the lazy dog. ",
    "In 2024, the model processed 1,234,567 tokens at 89.5% accuracy; ",
    "def tokenize(text):\n    return [vocab[w] for w in text.split()]\n\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n",
    "人工智能正在改变世界，大语言模型的发展速度令人惊叹。",
    "日本語のテキストとカタカナ、ひらがなの混在した文章です。",
    "Καλημέρα κόσμε, η γλώσσα είναι όμορφη. ",
    "Привет, мир! Это тестовый текст на русском языке. ",
    "Emoji time 🤖🚀🌍 and accents: naïve café résumé. ",
    "    \n\t  \n\n   ",
    "<｜User｜>What is 2+2?<｜Assistant｜><think>Simple arithmetic.</think>4<｜end▁of▁sentence｜>",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}\n",
};

int main(int argc, char **argv) {
    const char *path = NULL, *save = NULL, *text_path = NULL;
    double mb = 8;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mb") && i + 1 < argc)
            mb = atof(argv[++i]);
        else if (!strcmp(argv[i], "--save") && i + 1 < argc)
            save = argv[++i];
        else if (!strcmp(argv[i], "--text") && i + 1 < argc)
            text_path = argv[++i];
        else
            path = argv[i];
    }
    if (!path || mb <= 0) {
        fprintf(stderr, "usage: bench_tokenizer TOKENIZER_JSON [--mb N] [--save FILE] [--text FILE]\n");
        return 2;
    }
    ds41_error err = {{0}};
    double t0 = now();
    ds41_tokenizer *t = ds41_tokenizer_load(path, &err);
    if (!t) {
        fprintf(stderr, "bench_tokenizer: %s\n", err.msg);
        return 1;
    }
    printf("load: %.3f s\n", now() - t0);
    char *text;
    size_t n = 0;
    if (text_path) {
        FILE *f = fopen(text_path, "rb");
        if (!f) {
            perror(text_path);
            return 1;
        }
        fseek(f, 0, SEEK_END);
        n = (size_t)ftell(f);
        fseek(f, 0, SEEK_SET);
        text = malloc(n + 1);
        if (!text || fread(text, 1, n, f) != n) return 1;
        fclose(f);
    } else {
        size_t want = (size_t)(mb * 1e6);
        text = malloc(want + 512);
        if (!text) return 1;
        while (n < want) {
            const char *p = pieces[rnd() % (sizeof pieces / sizeof pieces[0])];
            size_t l = strlen(p);
            memcpy(text + n, p, l);
            n += l;
        }
    }
    if (save) {
        FILE *f = fopen(save, "wb");
        if (!f || fwrite(text, 1, n, f) != n || fclose(f)) {
            perror(save);
            return 1;
        }
    }
    ds41_token_ids ids = {0};
    double best_enc = 1e9, best_dec = 1e9;
    size_t dec_len = 0;
    for (int r = 0; r < 3; r++) {
        ids.n = 0;
        t0 = now();
        if (ds41_tokenizer_encode(t, text, n, &ids, &err) < 0) {
            fprintf(stderr, "bench_tokenizer: %s\n", err.msg);
            return 1;
        }
        double dt = now() - t0;
        if (dt < best_enc) best_enc = dt;
        t0 = now();
        char *d = ds41_tokenizer_decode(t, ids.ids, ids.n, false, &dec_len);
        dt = now() - t0;
        if (dt < best_dec) best_dec = dt;
        if (!d || dec_len != n || memcmp(d, text, n)) printf("note: decode(encode(text)) != text\n");
        free(d);
    }
    printf("text: %.2f MB, %zu ids (%.2f bytes/id)\n", (double)n / 1e6, ids.n, (double)n / (double)ids.n);
    printf("ds41 encode: %.2f MB/s (%.3f s)\n", (double)n / 1e6 / best_enc, best_enc);
    printf("ds41 decode: %.2f MB/s (%.3f s)\n", (double)n / 1e6 / best_dec, best_dec);
    ds41_token_ids_free(&ids);
    free(text);
    ds41_tokenizer_free(t);
    return 0;
}
