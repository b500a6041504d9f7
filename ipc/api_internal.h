/* Helpers shared by ipc/api.c and ipc/api_request.c (not a public contract).
 * All of them fill err as a 400 naming the field (see ipc/api.h) and return
 * -1 on a bad value; 0 otherwise.  A null JSON value counts as absent. */
#ifndef DS41_IPC_API_INTERNAL_H
#define DS41_IPC_API_INTERNAL_H

#include <jansson.h>
#include <stdbool.h>

#include "ipc/service.h"

/* "object", "array", "string", "integer", "number", "boolean", "null". */
const char *ds41_api_json_type_name(const json_t *v);

/* Parse body as a JSON object (duplicate keys refused). *out: new reference. */
int ds41_api_parse_json(const char *body, size_t len, json_t **out, ds41_svc_error *err);

/* Refuse a key of obj not in the NULL-terminated allowed list.  prefix is the
 * object's own path ("" or NULL at the top level). */
int ds41_api_check_keys(const json_t *obj, const char *prefix, const char *const *allowed,
                        ds41_svc_error *err);

/* Typed getters: *out untouched-or-NULL when absent; required -> missing_field. */
int ds41_api_get_string(const json_t *obj, const char *prefix, const char *key, bool required,
                        const char **out, ds41_svc_error *err);
int ds41_api_get_bool(const json_t *obj, const char *prefix, const char *key, bool *has, bool *out,
                      ds41_svc_error *err);
int ds41_api_get_int(const json_t *obj, const char *prefix, const char *key, long long lo, long long hi,
                     bool *has, long long *out, ds41_svc_error *err);

/* Validate "messages" and produce the normalized compact JSON (malloc()ed). */
int ds41_api_parse_messages(const json_t *messages, char **out_json, ds41_svc_error *err);

/* Validate "tools" (NULL/null/[] -> *out_json NULL).  *names (if names is
 * not NULL) gets a new array of the function names. */
int ds41_api_parse_tools(const json_t *tools, char **out_json, json_t **names, ds41_svc_error *err);

/* thinking / chat_template_kwargs / reasoning_effort -> mode and effort. */
int ds41_api_parse_thinking(const json_t *root, ds41_thinking *mode, int *effort, ds41_svc_error *err);

#endif
