/* Fuzz target 'safetensors_index': arbitrary bytes as the contents of
 * model.safetensors.index.json given to ds41_checkpoint_parse_index.  It must never
 * crash or leak; what it accepts must keep the header's promises (checked
 * here; a broken promise traps). */
#include "storage/safetensors.h"

#include <stdint.h>
#include <string.h>

#define PROMISE(c)                                                                                 \
    do {                                                                                           \
        if (!(c)) __builtin_trap();                                                                \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds41_st_index idx;
    ds41_error err;
    if (ds41_checkpoint_parse_index(data, size, "fuzz.index.json", &idx, &err) == 0) {
        PROMISE(idx.shard_count >= 1 && idx.entry_count >= idx.shard_count);
        for (size_t i = 0; i < idx.shard_count; i++) {
            const char *s = idx.shard_names[i];
            PROMISE(s[0] && !strchr(s, '/') && !strstr(s, ".."));
            PROMISE(i == 0 || strcmp(idx.shard_names[i - 1], s) < 0);
            PROMISE(idx.shard_first_tensor[i] != NULL);
        }
        for (size_t i = 0; i < idx.entry_count; i++)
            PROMISE(idx.entries[i].tensor[0] && idx.entries[i].shard < idx.shard_count);
    } else {
        PROMISE(idx.entries == NULL && strstr(err.msg, "fuzz.index.json") != NULL);
    }
    ds41_checkpoint_index_free(&idx);
    return 0;
}
