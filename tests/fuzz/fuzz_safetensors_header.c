/* Fuzz target 'safetensors_header': arbitrary bytes are a whole safetensors
 * file (file_size = input size) given to ds41_checkpoint_parse_header.  It must
 * never crash or leak, and whatever it accepts must satisfy the promises of
 * storage/safetensors.h (checked here; a broken promise traps). */
#include "storage/safetensors.h"

#include <stdint.h>
#include <string.h>

#define PROMISE(c)                                                                                 \
    do {                                                                                           \
        if (!(c)) __builtin_trap();                                                                \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds41_st_header h;
    ds41_error err;
    if (ds41_checkpoint_parse_header(data, size, size, "fuzz.safetensors", &h, &err) == 0) {
        PROMISE(h.data_start == 8 + h.header_len && h.data_start <= size);
        PROMISE(h.data_size == size - h.data_start);
        uint64_t sum = 0;
        for (size_t i = 0; i < h.tensor_count; i++) {
            const ds41_tensor *t = &h.tensors[i];
            PROMISE(t->name && t->name[0]);
            PROMISE(i == 0 || strcmp(h.tensors[i - 1].name, t->name) < 0);
            PROMISE((unsigned)t->dtype < DS41_DTYPE_COUNT && t->ndim >= 0 && t->ndim <= DS41_MAX_DIMS);
            unsigned __int128 bytes = ds41_dtype_size(t->dtype);
            for (int d = 0; d < t->ndim; d++) {
                PROMISE(t->shape[d] >= 0);
                bytes *= (unsigned __int128)t->shape[d];
                if (bytes > UINT64_MAX) bytes = (unsigned __int128)UINT64_MAX + 1;
            }
            PROMISE(bytes == t->nbytes);
            PROMISE(t->file_offset >= h.data_start && t->file_offset <= size && t->nbytes <= size - t->file_offset);
            PROMISE(t->shard == 0 && t->data == NULL);
            sum += t->nbytes;
        }
        PROMISE(sum == h.payload_bytes && sum <= h.data_size);
        for (size_t i = 0; i < h.metadata_count; i++) PROMISE(h.metadata[i].key && h.metadata[i].value);
    } else {
        PROMISE(h.tensors == NULL && h.tensor_count == 0 && err.msg[0]);
        PROMISE(strstr(err.msg, "fuzz.safetensors") != NULL);
    }
    ds41_checkpoint_header_free(&h);

    /* The dtype lookup takes an unterminated span. */
    ds41_dtype d;
    if (ds41_dtype_from_name((const char *)data, size < 12 ? size : 12, &d) == 0)
        PROMISE(strlen(ds41_dtype_name(d)) == (size < 12 ? size : 12));
    return 0;
}
