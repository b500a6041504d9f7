/* ds41d's log (see log.h). */
#include "daemon/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static _Atomic int current_level = DS41_LOG_INFO;

void ds41_log_set_level(ds41_log_level level) { atomic_store(&current_level, (int)level); }
ds41_log_level ds41_log_get_level(void) { return (ds41_log_level)atomic_load(&current_level); }

void ds41_log(ds41_log_level level, const char *fmt, ...) {
    if ((int)level > atomic_load(&current_level)) return;
    static const int syslog_prio[] = {3, 4, 6, 7}; /* err, warning, info, debug */
    static const char *const words[] = {"error", "warning", "info", "debug"};
    char line[2048];
    int n;
    if (getenv("JOURNAL_STREAM"))
        n = snprintf(line, sizeof line, "<%d>", syslog_prio[level]);
    else
        n = snprintf(line, sizeof line, "ds41d: %s: ", words[level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m < sizeof line - (size_t)n - 1 ? (size_t)m : sizeof line - (size_t)n - 2);
    /* one line: control characters (a newline in a message) become spaces */
    for (size_t i = (size_t)n; i < len; i++)
        if ((unsigned char)line[i] < 0x20) line[i] = ' ';
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}
