/* What ds41ctl's files share: the global options, the daemon calls, the JSON and table output
 * helpers (daemon/ctl_main.c) and the doctor command (daemon/ctl_doctor.c). */
#ifndef DS41_DAEMON_CTL_INTERNAL_H
#define DS41_DAEMON_CTL_INTERNAL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

extern const char *g_socket; /* --socket */
extern bool g_json;          /* --json */

/* "ds41ctl: " + the message on stderr; returns 1 (the failure exit status). */
int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* A malloc()ed printf. */
char *fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));

/* A request to the daemon whose answer is JSON (NULL when unreachable or not JSON; quiet: no
 * message); *status_out gets the HTTP status. */
json_t *call_json(const char *method, const char *path, const char *body, int *status_out, bool quiet);
void print_json(const json_t *j);
const char *jstr(const json_t *o, const char *k);
long long jint(const json_t *o, const char *k);
void human_bytes(double b, char *out, size_t n);

/* A text table: the header row first, then table_row(t, cell, ..., NULL); printed aligned. */
typedef struct table {
    size_t cols, rows, cap;
    char **cells; /* rows x cols, row 0 = header */
} table;
void table_row(table *t, ...);
void table_free(table *t);
void table_print(table *t);

/* ds41ctl doctor [--model DIR] (ctl_doctor.c). */
int cmd_doctor(int argc, char **argv);

#endif
