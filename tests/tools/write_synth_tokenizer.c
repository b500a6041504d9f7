/* Test helper: write a synthetic tokenizer (engine/text/synth_tokenizer.h).
 * usage: write_synth_tokenizer DIR VOCAB_SIZE SEED */
#include "engine/text/synth_tokenizer.h"

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s DIR VOCAB_SIZE SEED\n", argv[0]);
        return 2;
    }
    ds41_error err = {{0}};
    if (ds41_synth_tokenizer_write(argv[1], (uint32_t)strtoul(argv[2], NULL, 10), strtoull(argv[3], NULL, 10), &err) <
        0) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    return 0;
}
