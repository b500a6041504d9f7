#include "config/error.h"
#include "tests/tap.h"

#include <string.h>

int main(void) {
    ds41_error e;
    TAP_CHECK(ds41_fail(&e, "tensor '%s': bad", "x") == -1, "ds41_fail returns -1");
    TAP_CHECK(strcmp(e.msg, "tensor 'x': bad") == 0, "ds41_fail formats");
    ds41_error_prefix(&e, "%s", "a.safetensors");
    TAP_CHECK(strcmp(e.msg, "a.safetensors: tensor 'x': bad") == 0, "prefix prepends context");
    TAP_CHECK(ds41_fail(NULL, "ignored") == -1, "NULL error is allowed");
    char big[3000];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = 0;
    ds41_fail(&e, "%s", big);
    TAP_CHECK(strlen(e.msg) == DS41_ERROR_MAX - 1, "long messages are truncated, not overflowed");
    return tap_done();
}
