/* Small helpers shared by every module that reads JSON with jansson. */
#ifndef DS41_CONFIG_JSON_UTIL_H
#define DS41_CONFIG_JSON_UTIL_H

#include <jansson.h>

/* "an object", "a list", "a string", "an integer", "a real number",
 * "a boolean", "null": for messages like "key 'x': expected a string, got
 * an integer". */
const char *ds41_json_type_name(const json_t *v);

#endif
