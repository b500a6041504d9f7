/* V4.1 chat encoding (engine/text/chat.h) and its Python-compatible JSON (engine/text/pyjson.h).
 *
 * Goldens: the 5 official encoding fixtures (tests/data/chat/, see its README.md), the worked
 * examples of REFERENCE §11.10 (derived by hand from the official encoder), and expectations
 * written from REFERENCE §4 / §11 for every rule.  Parser: every §11.7 error message, DSML corner
 * cases, the lenient salvage, and render -> parse round trips over generated tool-call sets. */
#include "engine/text/chat.h"
#include "engine/text/pyjson.h"
#include "tests/tap.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define DATA "tests/data/chat/"

#define BOS "<｜begin▁of▁sentence｜>"
#define EOS "<｜end▁of▁sentence｜>"
#define SYS "<｜System｜>"
#define USR "<｜User｜>"
#define AST "<｜Assistant｜>"
#define THINK "<think>"
#define ETHINK "</think>"
#define LR "<｜latest_reminder｜>"
#define IMG "<｜deepseek_image｜>"
#define E(n) "Reasoning Effort: " #n " (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

/* REFERENCE §11.1, typed from the spec: the tools block around {SCHEMAS}. */
#define T_HEAD                                                                                                 \
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools " \
    "by writing a \"<｜DSML｜ calls>\" block like the following:\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke "          \
    "name=\"$TOOL_NAME\">\n<｜DSML｜ parameter name=\"$PARAMETER_NAME\" "                                        \
    "string=\"true|false\">$PARAMETER_VALUE</｜DSML｜ parameter>\n...\n</｜DSML｜ invoke>\n<｜DSML｜ invoke "    \
    "name=\"$TOOL_NAME2\">\n...\n</｜DSML｜ invoke>\n</｜DSML｜ calls>\n\nString parameters should be "          \
    "specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), "    \
    "pass the value in JSON format and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by "  \
    "<think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or "     \
    "final response.\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n### " \
    "Available Tool Schemas\n\n"
#define T_TAIL "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
#define W_SCHEMA                                                                                               \
    "{\"name\": \"get_weather\", \"description\": \"Get weather\", \"parameters\": {\"type\": \"object\", "    \
    "\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}"
#define T_W T_HEAD W_SCHEMA T_TAIL
#define W_TOOL                                                                                                 \
    "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Get weather\","          \
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}}"

/* ---- helpers ---- */

static json_t *J(const char *text) {
    json_error_t je;
    json_t *j = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!j) {
        printf("# test bug: bad JSON (%s): %s\n", je.text, text);
        exit(2);
    }
    return j;
}

/* Prints a value with its control characters visible, for failure notes. */
static void show(const char *label, const char *s, size_t n) {
    printf("#   %s: \"", label);
    for (size_t i = 0; i < n && i < 3000; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') printf("\\n");
        else if (c < 0x20) printf("\\x%02x", c);
        else putchar(c);
    }
    printf("\"\n");
}

typedef struct rq {
    const char *messages;
    const char *tools;
    const char *response_format;
    const char *context;
    const char *effort;
    ds41_chat_mode mode;
    bool keep_thinking;
    bool no_bos;
} rq;

/* Renders; returns the prompt (caller frees) or NULL with err filled. */
static char *render(rq r, size_t *len, json_t **images, ds41_error *err) {
    ds41_chat_request req = ds41_chat_request_default();
    json_t *m = J(r.messages), *t = r.tools ? J(r.tools) : NULL, *f = r.response_format ? J(r.response_format) : NULL,
           *c = r.context ? J(r.context) : NULL, *e = r.effort ? J(r.effort) : NULL;
    req.messages = m;
    req.tools = t;
    req.response_format = f;
    req.context = c;
    req.reasoning_effort = e;
    req.mode = r.mode;
    req.drop_thinking = !r.keep_thinking;
    req.add_bos = !r.no_bos;
    ds41_chat_prompt p;
    char *out = NULL;
    if (ds41_chat_render(&req, &p, err) == 0) {
        out = p.text;
        if (len) *len = p.len;
        if (images) *images = json_incref(p.images);
        p.text = NULL;
        ds41_chat_prompt_free(&p);
    }
    json_decref(m);
    json_decref(t);
    json_decref(f);
    json_decref(c);
    json_decref(e);
    return out;
}

static void expect_render(rq r, const char *expected, const char *what) {
    ds41_error err = {{0}};
    size_t len = 0;
    char *got = render(r, &len, NULL, &err);
    bool ok = got && len == strlen(expected) && memcmp(got, expected, len) == 0;
    TAP_CHECK(ok, "%s", what);
    if (!ok) {
        show("expected", expected, strlen(expected));
        if (got) show("got     ", got, len);
        else printf("#   error: %s\n", err.msg);
    }
    free(got);
}

static void expect_render_error(rq r, const char *expected, const char *what) {
    ds41_error err = {{0}};
    char *got = render(r, NULL, NULL, &err);
    bool ok = !got && strcmp(err.msg, expected) == 0;
    TAP_CHECK(ok, "%s", what);
    if (!ok) {
        printf("#   expected error: %s\n", expected);
        if (got) show("rendered", got, strlen(got));
        else printf("#   got error:      %s\n", err.msg);
    }
    free(got);
}

/* An error whose message starts with prefix (ds41's own messages). */
static void expect_render_error_prefix(rq r, const char *prefix, const char *what) {
    ds41_error err = {{0}};
    char *got = render(r, NULL, NULL, &err);
    bool ok = !got && strncmp(err.msg, prefix, strlen(prefix)) == 0;
    TAP_CHECK(ok, "%s", what);
    if (!ok) printf("#   expected an error starting \"%s\", got: %s\n", prefix, got ? got : err.msg);
    free(got);
}

static char *dumps(const char *json) {
    json_t *j = J(json);
    ds41_error err;
    char *s = ds41_json_dumps_py(j, NULL, &err);
    json_decref(j);
    return s;
}

static void expect_dumps(const char *json, const char *expected) {
    char *got = dumps(json);
    bool ok = got && strcmp(got, expected) == 0;
    TAP_CHECK(ok, "json.dumps(%s) == %s", json, expected);
    if (!ok) printf("#   got %s\n", got ? got : "(null)");
    free(got);
}

/* ---- the official fixtures ---- */

static void test_fixtures(void) {
    json_error_t je;
    json_t *root = json_load_file(DATA "encoding-fixtures.json", 0, &je);
    if (!TAP_CHECK(root != NULL, "fixtures file loads")) return;
    json_t *fixtures = json_object_get(root, "fixtures");
    TAP_CHECK(json_array_size(fixtures) == 5, "5 official fixtures");
    size_t i;
    json_t *fx;
    json_array_foreach(fixtures, i, fx) {
        const char *name = json_string_value(json_object_get(fx, "name"));
        json_t *kwargs = json_object_get(fx, "kwargs");
        ds41_chat_request req = ds41_chat_request_default();
        ds41_error err = {{0}};
        if (json_is_false(json_object_get(fx, "accepted"))) {
            /* The rejected case records only the error: a literal marker in text content. */
            json_t *msgs = J("[{\"role\": \"user\", \"content\": \"describe <｜deepseek_image｜> please\"}]");
            req.messages = msgs;
            ds41_chat_prompt p;
            int rc = ds41_chat_render(&req, &p, &err);
            const char *want = json_string_value(json_object_get(fx, "error"));
            TAP_CHECK(rc != 0 && want && strcmp(err.msg, want) == 0, "fixture %s: rejected with the official message",
                      name);
            if (rc == 0) ds41_chat_prompt_free(&p);
            json_decref(msgs);
            continue;
        }
        req.messages = json_object_get(fx, "messages");
        const char *mode = json_string_value(json_object_get(kwargs, "thinking_mode"));
        if (ds41_chat_mode_parse(mode, &req.mode, &err) != 0) {
            TAP_CHECK(0, "fixture %s: mode %s", name, err.msg);
            continue;
        }
        req.reasoning_effort = json_object_get(kwargs, "reasoning_effort");
        ds41_chat_prompt p;
        if (ds41_chat_render(&req, &p, &err) != 0) {
            TAP_CHECK(0, "fixture %s renders: %s", name, err.msg);
            continue;
        }
        json_t *want = json_object_get(fx, "prompt");
        bool ok = p.len == json_string_length(want) && memcmp(p.text, json_string_value(want), p.len) == 0;
        TAP_CHECK(ok, "fixture %s renders byte for byte", name);
        if (!ok) {
            show("expected", json_string_value(want), json_string_length(want));
            show("got     ", p.text, p.len);
        }
        json_t *media = json_object_get(fx, "media");
        if (!json_is_null(media)) {
            TAP_CHECK(json_equal(p.images, json_object_get(media, "images")), "fixture %s: image records", name);
        } else {
            TAP_CHECK(json_array_size(p.images) == 0, "fixture %s: no image records", name);
        }
        ds41_chat_prompt_free(&p);
    }
    json_decref(root);
}

/* ---- REFERENCE §11.10 worked examples ---- */

#define EX2_CALLS                                                                                              \
    "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"city\" "            \
    "string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"get_weather\">\n"     \
    "<｜DSML｜ parameter name=\"city\" string=\"true\">Rome</｜DSML｜ parameter>\n<｜DSML｜ parameter "            \
    "name=\"days\" string=\"false\">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"
#define EX2_MESSAGES                                                                                           \
    "[{\"role\":\"system\",\"content\":\"You are helpful.\"},"                                                 \
    "{\"role\":\"user\",\"content\":\"Weather in Paris and Rome?\"},"                                          \
    "{\"role\":\"assistant\",\"reasoning_content\":\"Need both.\",\"content\":\"\",\"tool_calls\":["            \
    "{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","                         \
    "\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}},"                                                        \
    "{\"id\":\"call_2\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","                         \
    "\"arguments\":\"{\\\"city\\\":\\\"Rome\\\",\\\"days\\\":3}\"}}]},"                                         \
    "{\"role\":\"tool\",\"tool_call_id\":\"call_2\",\"content\":\"{\\\"temp\\\": 21}\"},"                       \
    "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"{\\\"temp\\\": 18}\"}]"
#define EX3_CALLS                                                                                              \
    "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"search\">\n<｜DSML｜ parameter name=\"q\" string=\"true\">café " \
    "\"best\"</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"opts\" string=\"false\">{\"limit\": 2, \"safe\": " \
    "true}</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"
#define EX3_MESSAGES(extra)                                                                                    \
    "[{\"role\":\"user\",\"content\":\"Find a café\"" extra "},"                                               \
    "{\"role\":\"assistant\",\"reasoning_content\":\"r1\",\"content\":\"\",\"tool_calls\":[{\"type\":"         \
    "\"function\",\"function\":{\"name\":\"search\",\"arguments\":{\"q\":\"café \\\"best\\\"\","               \
    "\"opts\":{\"limit\":2,\"safe\":true}}}}]},"                                                               \
    "{\"role\":\"tool\",\"content\":\"ok\"},"                                                                  \
    "{\"role\":\"assistant\",\"reasoning_content\":\"r2\",\"content\":\"Done.\"},"                              \
    "{\"role\":\"user\",\"content\":\"Thanks\"}]"

static void test_worked_examples(void) {
    expect_render((rq){.messages = "[{\"role\":\"system\",\"content\":\"You are helpful.\"},"
                                   "{\"role\":\"user\",\"content\":\"Weather in Paris?\"}]",
                       .tools = "[" W_TOOL "]",
                       .response_format = "{\"type\": \"json_object\"}"},
                  BOS SYS "You are helpful.\n\n" T_W "\n\n## Response Format:\n\nYou MUST strictly adhere to the "
                          "following schema to reply:\n{\"type\": \"json_object\"}" USR "Weather in Paris?" AST ETHINK,
                  "§11.10 Ex 1 (chat, tools + response_format on the system message)");
    expect_render((rq){.messages = EX2_MESSAGES, .tools = "[" W_TOOL "]", .mode = DS41_CHAT_MODE_THINKING},
                  BOS SYS E(75) "You are helpful.\n\n" T_W USR "Weather in Paris and Rome?" AST THINK
                                "Need both." ETHINK EX2_CALLS EOS USR "<tool_result>{\"temp\": 18}</tool_result>\n\n"
                                "<tool_result>{\"temp\": 21}</tool_result>" AST THINK,
                  "§11.10 Ex 2 (thinking, tools: reasoning kept, results sorted into call order)");
    expect_render((rq){.messages = EX3_MESSAGES(""), .mode = DS41_CHAT_MODE_THINKING, .effort = "20"},
                  BOS SYS E(20) USR "Find a café" AST ETHINK EX3_CALLS EOS USR "<tool_result>ok</tool_result>" AST
                      ETHINK "Done." EOS USR "Thanks" AST THINK,
                  "§11.10 Ex 3 (thinking, effort 20, no tools: earlier reasoning dropped)");
    /* The note under Ex 3: `tools` on any message turns drop_thinking off. */
    expect_render((rq){.messages = EX3_MESSAGES(",\"tools\":[" W_TOOL "]"), .mode = DS41_CHAT_MODE_THINKING,
                       .effort = "20"},
                  BOS SYS E(20) USR "Find a café" AST THINK "r1" ETHINK EX3_CALLS EOS USR
                                "<tool_result>ok</tool_result>" AST THINK "r2" ETHINK "Done." EOS USR "Thanks" AST THINK,
                  "§11.10 note: tools on a user message keep every turn's reasoning, all headers <think>");
    expect_render((rq){.messages = EX3_MESSAGES(""), .mode = DS41_CHAT_MODE_THINKING, .effort = "20",
                       .keep_thinking = true},
                  BOS SYS E(20) USR "Find a café" AST THINK "r1" ETHINK EX3_CALLS EOS USR
                                "<tool_result>ok</tool_result>" AST THINK "r2" ETHINK "Done." EOS USR "Thanks" AST THINK,
                  "drop_thinking=false keeps every turn's reasoning too");
    expect_render((rq){.messages = EX3_MESSAGES("")},
                  BOS USR "Find a café" AST ETHINK EX3_CALLS EOS USR "<tool_result>ok</tool_result>" AST ETHINK
                          "Done." EOS USR "Thanks" AST ETHINK,
                  "Ex 3 in chat mode: no reasoning, every header </think>, no effort prefix");
}

/* ---- effort, modes, system messages ---- */

static void test_effort(void) {
    static const struct {
        const char *json;
        const char *prefix;
    } ok[] = {{NULL, E(75)}, {"null", E(75)}, {"\"low\"", E(50)}, {"\"high\"", E(75)}, {"\"max\"", E(100)},
              {"1", E(1)},   {"42", E(42)},   {"100", E(100)}};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        char want[512];
        snprintf(want, sizeof want, BOS SYS "%s" USR "question" AST THINK, ok[i].prefix);
        char what[96];
        snprintf(what, sizeof what, "effort %s -> %s", ok[i].json ? ok[i].json : "(default)", ok[i].prefix + 18);
        what[strcspn(what, "(")] = 0;
        expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"question\"}]",
                           .mode = DS41_CHAT_MODE_THINKING, .effort = ok[i].json},
                      want, what);
    }
    static const struct {
        const char *json, *shown;
    } bad[] = {{"0", "0"},         {"101", "101"}, {"-1", "-1"},   {"\"medium\"", "medium"},
               {"true", "True"},   {"false", "False"}, {"1.5", "1.5"}, {"50.0", "50.0"},
               {"[1]", "[1]"},     {"\"\"", ""}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char want[256], what[96];
        snprintf(want, sizeof want,
                 "Invalid reasoning effort for deepseek_v41: %s, should be int within [1,100] or ['low', 'high', "
                 "'max']",
                 bad[i].shown);
        snprintf(what, sizeof what, "effort %s rejected with the official message", bad[i].json);
        expect_render_error((rq){.messages = "[{\"role\":\"user\",\"content\":\"question\"}]",
                                 .mode = DS41_CHAT_MODE_THINKING, .effort = bad[i].json},
                            want, what);
    }
    expect_render_error((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"}]", .effort = "\"medium\""},
                        "Invalid reasoning effort for deepseek_v41: medium, should be int within [1,100] or "
                        "['low', 'high', 'max']",
                        "effort is validated in chat mode too");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"hello\"}]", .effort = "\"max\""},
                  BOS USR "hello" AST ETHINK, "chat mode: no effort prefix and no <｜System｜>");
    expect_render((rq){.messages = "[]", .effort = "\"medium\""}, BOS,
                  "no message rendered: BOS only, effort not validated (as in the official encoder)");

    ds41_chat_mode mode;
    ds41_error err;
    TAP_CHECK(ds41_chat_mode_parse("thinking", &mode, &err) == 0 && mode == DS41_CHAT_MODE_THINKING &&
                  ds41_chat_mode_parse("chat", &mode, &err) == 0 && mode == DS41_CHAT_MODE_CHAT,
              "thinking_mode names parse");
    TAP_CHECK(ds41_chat_mode_parse("reasoning", &mode, &err) != 0 &&
                  strcmp(err.msg, "Invalid thinking_mode `reasoning`") == 0,
              "bad thinking_mode: \"Invalid thinking_mode `reasoning`\"");
    int budget = 0;
    json_t *j = J("\"low\"");
    TAP_CHECK(ds41_chat_reasoning_effort(j, &budget, &err) == 0 && budget == 50 &&
                  ds41_chat_reasoning_effort(NULL, &budget, &err) == 0 && budget == 75,
              "ds41_chat_reasoning_effort: low -> 50, default -> 75");
    json_decref(j);
}

static void test_system_messages(void) {
    expect_render((rq){.messages = "[{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"},"
                                   "{\"role\":\"user\",\"content\":\"hello\"}]"},
                  BOS SYS "You are a helpful assistant." USR "hello" AST ETHINK,
                  "leading system message gets <｜System｜> in chat mode");
    expect_render((rq){.messages = "[{\"role\":\"system\",\"content\":\"sys\"},{\"role\":\"user\",\"content\":\"q1\"},"
                                   "{\"role\":\"assistant\",\"content\":\"a1\",\"reasoning_content\":\"r1\"},"
                                   "{\"role\":\"system\",\"content\":\"mid sys\"}]",
                       .mode = DS41_CHAT_MODE_THINKING, .effort = "88"},
                  BOS SYS E(88) "sys" USR "q1" AST ETHINK "a1" EOS SYS "mid sys" AST THINK,
                  "later system message: own <｜System｜>, acts as the last user turn (reasoning dropped)");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"system\",\"content\":\"s\"},"
                                   "{\"role\":\"assistant\",\"content\":\"a\"}]"},
                  BOS USR "q" SYS "s" AST ETHINK "a" EOS,
                  "a later system message followed by an assistant gets the header, the user before it none");
    expect_render((rq){.messages = "[{\"role\":\"system\",\"content\":null},{\"role\":\"user\",\"content\":\"q\"}]",
                       .mode = DS41_CHAT_MODE_THINKING},
                  BOS SYS E(75) USR "q" AST THINK,
                  "thinking: one <｜System｜> for effort prefix + empty system content");
    expect_render((rq){.messages = "[{\"role\":\"system\",\"content\":\"S\",\"response_format\":{\"type\":\"json_schema\","
                                   "\"json_schema\":{\"name\":\"r\",\"schema\":{\"type\":\"object\"}}}},"
                                   "{\"role\":\"user\",\"content\":\"q\"}]"},
                  BOS SYS "S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                          "{\"type\": \"json_schema\", \"json_schema\": {\"name\": \"r\", \"schema\": {\"type\": "
                          "\"object\"}}}" USR "q" AST ETHINK,
                  "response_format on a system message without tools");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"}]", .response_format = "{\"type\":\"json_object\"}"},
                  BOS SYS "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                          "{\"type\": \"json_object\"}" USR "q" AST ETHINK,
                  "request response_format without a system message: an empty system message is added");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"}]", .response_format = "{\"type\":\"text\"}"},
                  BOS USR "q" AST ETHINK, "request response_format {\"type\": \"text\"} means none");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"}]", .tools = "[" W_TOOL "]"},
                  BOS SYS "\n\n" T_W USR "q" AST ETHINK,
                  "request tools without a system message: empty system message in front (§11.1)");
    expect_render((rq){.messages = "[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":\"q\","
                                   "\"tools\":[" W_TOOL "]}]"},
                  BOS SYS "S" USR "q" AST ETHINK, "tools on a user message are not rendered");
    expect_render_error((rq){.messages = "[{\"role\":\"developer\",\"content\":\"x\"}]"}, "Unknown role: developer",
                        "role developer: \"Unknown role: developer\"");
    expect_render_error((rq){.messages = "[{\"content\":\"x\"}]"}, "Unknown role: None",
                        "missing role: \"Unknown role: None\"");
    expect_render((rq){.messages = "[{\"role\":\"developer\",\"content\":\"x\"},{\"role\":\"user\",\"content\":\"q\"}]",
                       .mode = DS41_CHAT_MODE_THINKING},
                  BOS SYS E(75) USR "q" AST THINK,
                  "thinking + drop: a message of another role before the last user turn vanishes (official)");
    expect_render_error_prefix((rq){.messages = "[\"hi\"]"}, "messages[0] must be a JSON object",
                               "a message that is not an object is refused");
    expect_render_error_prefix((rq){.messages = "{}"}, "messages must be a JSON array", "messages must be an array");
}

/* ---- multi-turn thinking, context, latest_reminder, tasks ---- */

static void test_multi_turn(void) {
    const char *conv = "[{\"role\":\"user\",\"content\":\"q1\"},"
                       "{\"role\":\"assistant\",\"content\":\"a1\",\"reasoning_content\":\"r1\"},"
                       "{\"role\":\"user\",\"content\":\"q2\"},"
                       "{\"role\":\"assistant\",\"content\":\"a2\",\"reasoning_content\":\"r2\"}]";
    expect_render((rq){.messages = conv, .mode = DS41_CHAT_MODE_THINKING},
                  BOS SYS E(75) USR "q1" AST ETHINK "a1" EOS USR "q2" AST THINK "r2" ETHINK "a2" EOS,
                  "thinking multi-turn: reasoning before the last user turn dropped, after it kept");
    expect_render((rq){.messages = conv, .mode = DS41_CHAT_MODE_THINKING, .keep_thinking = true},
                  BOS SYS E(75) USR "q1" AST THINK "r1" ETHINK "a1" EOS USR "q2" AST THINK "r2" ETHINK "a2" EOS,
                  "thinking multi-turn with drop_thinking=false");
    expect_render((rq){.messages = conv},
                  BOS USR "q1" AST ETHINK "a1" EOS USR "q2" AST ETHINK "a2" EOS, "chat multi-turn: no reasoning at all");
    /* context: the prior turns are in the cache; only the new assistant turn is rendered. */
    expect_render((rq){.messages = "[{\"role\":\"assistant\",\"content\":\"a2\",\"reasoning_content\":\"r2\"}]",
                       .context = "[{\"role\":\"user\",\"content\":\"q1\"},{\"role\":\"assistant\",\"content\":\"a1\","
                                  "\"reasoning_content\":\"r1\"},{\"role\":\"user\",\"content\":\"q2\"}]",
                       .mode = DS41_CHAT_MODE_THINKING},
                  "r2" ETHINK "a2" EOS, "context: no BOS, no effort prefix, only the new messages");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q2\"}]",
                       .context = "[{\"role\":\"user\",\"content\":\"q1\"},{\"role\":\"assistant\",\"content\":\"a1\"}]",
                       .mode = DS41_CHAT_MODE_THINKING},
                  USR "q2" AST THINK, "context then a new user turn");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"a\","
                                   "\"wo_eos\":true}]"},
                  BOS USR "q" AST ETHINK "a", "wo_eos leaves the EOS out (prefill of an assistant turn)");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"}]", .no_bos = true}, USR "q" AST ETHINK,
                  "add_bos=false");
    /* encode_messages' count of messages to render is len(drop(context + messages)) -
     * len(drop(context)): a context message of another role dropped only in the full list leaves
     * nothing to render (the official result is the empty string). */
    expect_render((rq){.messages = "[{\"role\":\"tool\",\"content\":\"Y\"}]",
                       .context = "[{\"role\":\"other\"},{\"role\":\"assistant\",\"content\":\"\"}]",
                       .mode = DS41_CHAT_MODE_THINKING},
                  "", "thinking + context: the official message count can leave nothing to render");
}

static void test_reminder_and_tasks(void) {
    expect_render((rq){.messages = "[{\"role\":\"latest_reminder\",\"content\":\"Today is Monday.\"},"
                                   "{\"role\":\"user\",\"content\":\"q\"}]"},
                  BOS LR "Today is Monday." USR "q" AST ETHINK, "latest_reminder before the user turn");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"latest_reminder\",\"content\":\"r\"}]"},
                  BOS USR "q" AST ETHINK LR "r", "latest_reminder after the user (§11.5 example)");
    expect_render((rq){.messages = "[{\"role\":\"latest_reminder\"},{\"role\":\"user\",\"content\":\"q\"}]"},
                  BOS LR "None" USR "q" AST ETHINK, "latest_reminder without content renders None (str.format)");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"classify me\",\"task\":\"query\"}]"},
                  BOS USR "classify me<｜query｜>", "task query: token right after the user, no <｜Assistant｜>");
    static const char *const direct[] = {"authority", "domain", "read_url"};
    for (size_t i = 0; i < 3; i++) {
        char msgs[160], want[160], what[64];
        snprintf(msgs, sizeof msgs, "[{\"role\":\"user\",\"content\":\"u\",\"task\":\"%s\"}]", direct[i]);
        snprintf(want, sizeof want, BOS USR "u<｜%s｜>", direct[i]);
        snprintf(what, sizeof what, "task %s", direct[i]);
        expect_render((rq){.messages = msgs}, want, what);
    }
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"u\",\"task\":\"action\"}]"},
                  BOS USR "u" AST ETHINK "<｜action｜>", "task action in chat mode");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"u\",\"task\":\"action\"},"
                                   "{\"role\":\"assistant\",\"content\":\"Search\",\"reasoning_content\":\"r\"}]",
                       .mode = DS41_CHAT_MODE_THINKING},
                  BOS SYS E(75) USR "u" AST THINK "<｜action｜>Search" EOS,
                  "task action in thinking mode; the answer after a task gets no reasoning");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"u\"},{\"role\":\"assistant\",\"content\":\"a\","
                                   "\"task\":\"title\"}]"},
                  BOS USR "u" AST ETHINK "a" EOS "<｜title｜>", "task title sits after the assistant's EOS");
    expect_render_error((rq){.messages = "[{\"role\":\"user\",\"content\":\"u\",\"task\":\"bogus\"}]"},
                        "Invalid task: 'bogus'. Valid tasks are: ['action', 'query', 'authority', 'domain', 'title', "
                        "'read_url']",
                        "invalid task: official message");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"u\",\"task\":\"bogus\"},"
                                   "{\"role\":\"user\",\"content\":\"v\"}]"},
                  BOS USR "u" USR "v" AST ETHINK,
                  "a user with a task does not merge with the next user; its task is only read at a header");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"u\"},{\"role\":\"user\",\"content\":\"v\"}]"},
                  BOS USR "u\n\nv" AST ETHINK, "consecutive user messages merge with a blank line");
}

/* ---- tool results ---- */

static void test_tool_results(void) {
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"\","
                                   "\"tool_calls\":[{\"id\":\"a\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}},"
                                   "{\"id\":\"b\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}},"
                                   "{\"id\":\"c\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},"
                                   "{\"role\":\"tool\",\"tool_call_id\":\"c\",\"content\":\"C\"},"
                                   "{\"role\":\"tool\",\"tool_call_id\":\"zzz\",\"content\":\"Z\"},"
                                   "{\"role\":\"user\",\"content\":\"text\"},"
                                   "{\"role\":\"tool\",\"tool_call_id\":\"a\",\"content\":\"A\"}]"},
                  BOS USR "q" AST ETHINK
                          "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n\n</｜DSML｜ invoke>\n<｜DSML｜ invoke "
                          "name=\"f\">\n\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"f\">\n\n</｜DSML｜ invoke>\n"
                          "</｜DSML｜ calls>" EOS USR
                          "<tool_result>Z</tool_result>\n\n<tool_result>A</tool_result>\n\ntext\n\n"
                          "<tool_result>C</tool_result>" AST ETHINK,
                  "results stably sorted by call order (unknown id counts 0), text keeps its slot, no-param invokes");
    expect_render((rq){.messages = "[{\"role\":\"tool\",\"content\":\"A\"},{\"role\":\"tool\",\"content\":\"B\"},"
                                   "{\"role\":\"user\",\"content\":\"text\"}]"},
                  BOS USR "<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\ntext" AST ETHINK,
                  "tool messages open a user turn and a following user message joins it (§11.4 example)");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"tool\",\"content\":null},"
                                   "{\"role\":\"tool\",\"content\":{\"temp\":18,\"s\":\"it's\",\"z\":\"\\u200b\"}},"
                                   "{\"role\":\"tool\",\"content\":[{\"type\":\"text\",\"text\":\"t1\"},{\"type\":\"audio\"},"
                                   "{\"type\":\"image_url\",\"image_url\":{\"url\":\"u\"}},{\"type\":\"text\",\"text\":\"t2\"}]},"
                                   "{\"role\":\"tool\",\"content\":1.5},{\"role\":\"tool\"}]"},
                  BOS USR "q\n\n<tool_result>None</tool_result>\n\n<tool_result>{'temp': 18, 's': \"it's\", 'z': "
                          "'\\u200b'}</tool_result>\n\n<tool_result>t1\n\n" IMG "\n\nt2</tool_result>\n\n"
                          "<tool_result>1.5</tool_result>\n\n<tool_result></tool_result>" AST ETHINK,
                  "tool contents: null -> None, object -> Python repr, list -> texts + image placeholder, 1.5, missing");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\",\"task\":\"query\"},{\"role\":\"tool\",\"content\":\"R\"}]"},
                  BOS USR "q\n\n<tool_result>R</tool_result><｜query｜>",
                  "a tool result joins even a user turn that has a task");
    /* The context's calls order the new results. */
    expect_render((rq){.messages = "[{\"role\":\"tool\",\"tool_call_id\":\"y\",\"content\":\"Y\"},"
                                   "{\"role\":\"tool\",\"tool_call_id\":\"x\",\"content\":\"X\"}]",
                       .context = "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"\","
                                  "\"tool_calls\":[{\"id\":\"x\",\"function\":{\"name\":\"f\",\"arguments\":{}}},"
                                  "{\"function\":{\"id\":\"y\",\"name\":\"f\",\"arguments\":{}}}]}]"},
                  USR "<tool_result>X</tool_result>\n\n<tool_result>Y</tool_result>" AST ETHINK,
                  "results after a context are sorted by the context's calls (id also read inside function)");
}

/* ---- content blocks and images ---- */

static void test_content_blocks(void) {
    json_t *images = NULL;
    ds41_error err = {{0}};
    char *got = render((rq){.messages = "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"first\"},"
                                        "{\"type\":\"image_url\",\"image_url\":\"data:x\"},{\"type\":\"text\",\"text\":"
                                        "\"second\"},{\"type\":\"image\",\"source\":{\"path\":\"p\"},\"other\":1},"
                                        "{\"type\":\"input_audio\"}]}]"},
                       NULL, &images, &err);
    const char *want = BOS USR "first\n\n" IMG "\n\nsecond\n\n" IMG "\n\n[Unsupported input_audio]" AST ETHINK;
    TAP_CHECK(got && strcmp(got, want) == 0, "user list content: texts, image placeholders, [Unsupported type]");
    json_t *want_images = J("[{\"type\":\"image\",\"url\":\"data:x\"},{\"type\":\"image\",\"source\":{\"path\":\"p\"}}]");
    TAP_CHECK(images && json_equal(images, want_images), "image records in prompt order");
    json_decref(want_images);
    json_decref(images);
    free(got);
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":["
                                   "{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"refusal\"},{\"type\":\"text\",\"text\":\"b\"}]}]"},
                  BOS USR "q" AST ETHINK "a\n\nb" EOS, "assistant list content: texts joined, other blocks dropped");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":[]}]"}, BOS USR AST ETHINK,
                  "empty list content renders nothing");
    char long_text[400];
    memset(long_text, 'x', 150);
    snprintf(long_text + 150, sizeof long_text - 150, IMG "tail");
    char msgs[600];
    snprintf(msgs, sizeof msgs, "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"%s\"}]}]", long_text);
    char want_err[600];
    snprintf(want_err, sizeof want_err,
             "Text block contains image placeholder '" IMG "': '%.100s'. Images should be separate content blocks.",
             long_text);
    expect_render_error((rq){.messages = msgs}, want_err,
                        "placeholder in a text block: official message with the first 100 characters");
    expect_render_error((rq){.messages = "[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]"},
                        "Image block does not contain a valid source", "image block without a source");
    expect_render_error((rq){.messages = "[{\"role\":\"user\",\"content\":[{\"type\":\"image\",\"url\":\"\"}]}]"},
                        "Image block does not contain a valid source", "image block with an empty url");
    expect_render_error((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"a\","
                                         "\"reasoning_content\":\"see " IMG "\"}]"},
                        "reasoning_content contains image special token '" IMG "'",
                        "placeholder in reasoning_content: official message");
    expect_render_error((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"}]",
                             .context = "[{\"role\":\"system\",\"content\":\"" IMG "\"}]"},
                        "Message content contains image special token '" IMG
                        "'. Images should be provided as image content blocks.",
                        "the placeholder check covers the context too");
    expect_render_error_prefix((rq){.messages = "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":5}]}]"},
                               "messages[0]: a text content block's 'text' must be a string",
                               "a non-string text block is refused, naming the message");
}

/* ---- tools, calls, arguments, namespaces ---- */

static void test_tool_calls(void) {
#define CALL_MSG(args) "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":" args "}}]}]"
#define INVOKE(params) BOS USR "q" AST ETHINK "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n" params "\n</｜DSML｜ invoke>\n</｜DSML｜ calls>" EOS
#define P(name, str, value) "<｜DSML｜ parameter name=\"" name "\" string=\"" str "\">" value "</｜DSML｜ parameter>"
    expect_render((rq){.messages = CALL_MSG("{\"s\":\"a \\\"q\\\" <b>\\n\",\"i\":-3,\"f\":1.0,\"b\":false,\"n\":null,"
                                            "\"l\":[1,\"x\"],\"o\":{\"z\":1,\"a\":2}}")},
                  INVOKE(P("s", "true", "a \"q\" <b>\n") "\n" P("i", "false", "-3") "\n" P("f", "false", "1.0") "\n" P(
                      "b", "false", "false") "\n" P("n", "false", "null") "\n" P("l", "false", "[1, \"x\"]") "\n" P("o", "false",
                                                                                                               "{\"z\": 1, \"a\": 2}")),
                  "dict arguments: strings raw, other values JSON, key order kept");
    expect_render((rq){.messages = CALL_MSG("\"{\\\"a\\\":1,\\\"a\\\":2,\\\"b\\\":\\\"x\\\"}\"")},
                  INVOKE(P("a", "false", "2") "\n" P("b", "true", "x")),
                  "string arguments json.loads-ed (duplicate key: first slot, last value)");
    expect_render((rq){.messages = CALL_MSG("\"\\\"{\\\\\\\"a\\\\\\\": 1}\\\"\"")}, INVOKE(P("a", "false", "1")),
                  "double-encoded arguments decoded twice");
    expect_render((rq){.messages = CALL_MSG("\"not json\"")}, INVOKE(P("arguments", "true", "not json")),
                  "bad JSON arguments: one 'arguments' param with the raw text");
    expect_render((rq){.messages = CALL_MSG("\"\"")}, INVOKE(P("arguments", "true", "")), "empty arguments string");
    expect_render((rq){.messages = CALL_MSG("\"[1, 2]\"")}, INVOKE(P("arguments", "true", "[1, 2]")),
                  "arguments decoding to a list: raw string kept");
    expect_render((rq){.messages = CALL_MSG("null")}, INVOKE(P("arguments", "false", "null")), "null arguments");
    expect_render((rq){.messages = CALL_MSG("{}")}, BOS USR "q" AST ETHINK
                  "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>" EOS,
                  "no arguments: empty parameter list");
    expect_render((rq){.messages = CALL_MSG("\"{\\\"x\\\": NaN, \\\"y\\\": -Infinity, \\\"big\\\": "
                                            "123456789012345678901234567890, \\\"e\\\": 1E400, \\\"z\\\": -0}\"")},
                  INVOKE(P("x", "false", "NaN") "\n" P("y", "false", "-Infinity") "\n" P(
                      "big", "false", "123456789012345678901234567890") "\n" P("e", "false", "Infinity") "\n" P("z", "false",
                                                                                                            "0")),
                  "json.loads semantics: NaN, -Infinity, big ints, overflow to Infinity, -0");
    expect_render_error_prefix((rq){.messages = CALL_MSG("\"{\\\"k\\\": \\\"\\\\ud800\\\"}\"")},
                               "the prompt would not be valid UTF-8",
                               "arguments decoding to a lone surrogate are refused (no UTF-8 form)");
    expect_render((rq){.messages = CALL_MSG("\"\\\"\\\\ud800\\\"\"")}, INVOKE(P("arguments", "true", "\"\\ud800\"")),
                  "a lone surrogate that is not rendered is fine (second decode fails, raw text kept)");
    expect_render_error_prefix(
        (rq){.messages = "[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\"}}]}]"},
        "messages[0]: tool_calls[0].function has no 'arguments'", "a call without arguments is refused");
    expect_render_error_prefix((rq){.messages = "[{\"role\":\"assistant\",\"tool_calls\":[{\"name\":\"f\"}]}]"},
                               "messages[0]: tool_calls[0] has no 'function' object", "a call without function");
    expect_render_error_prefix((rq){.messages = "[{\"role\":\"user\",\"tool_calls\":[{\"name\":\"f\"}]}]"},
                               "messages[0]: tool_calls[0] has no 'function' object",
                               "calls are converted (and checked) on every rendered role, as officially");

    /* namespaces (§11.9) */
    const char *ns_tool = "[{\"type\":\"function\",\"namespace\":{\"name\":\"search\",\"description\":\"Search tools.\"},"
                          "\"function\":{\"name\":\"lookup\",\"description\":\"Look up\",\"parameters\":{}}}]";
    expect_render((rq){.messages = "[{\"role\":\"system\",\"content\":\"s\"}]", .tools = ns_tool},
                  BOS SYS "s\n\n" T_HEAD "{\"name\": \"search::lookup\", \"description\": \"Search tools.\\nLook up\", "
                          "\"parameters\": {}}" T_TAIL,
                  "namespace object at tool level: qualified name, description prefixed in place");
    expect_render((rq){.messages = "[{\"role\":\"system\",\"content\":\"s\",\"tools\":[{\"function\":{\"namespace\":"
                                   "{\"name\":\"fs\",\"description\":\"Files.\"},\"name\":\"fs::read\",\"x\":1}}]}]"},
                  BOS SYS "s\n\n" T_HEAD "{\"name\": \"fs::read\", \"x\": 1, \"description\": \"Files.\\n\"}" T_TAIL,
                  "namespace in function: key removed, prefix not doubled, description appended when absent");
    expect_render((rq){.messages = "[{\"role\":\"system\",\"content\":\"s\",\"tools\":[{\"namespace\":\"a\",\"function\":"
                                   "{\"name\":\"f\",\"namespace\":\"b\"}}]}]"},
                  BOS SYS "s\n\n" T_HEAD "{\"name\": \"a::f\"}" T_TAIL, "tool-level namespace wins over function-level");
    expect_render_error((rq){.messages = "[{\"role\":\"system\",\"content\":\"s\",\"tools\":[{\"namespace\":\"files\","
                                         "\"function\":{\"name\":\"search::lookup\"}}]}]"},
                        "Conflicting tool namespaces: files != search", "conflicting namespaces (tool)");
    expect_render_error((rq){.messages = "[{\"role\":\"system\",\"content\":\"s\",\"tools\":[{\"function\":"
                                         "{\"name\":\"search::nested::lookup\"}}]}]"},
                        "Tool name must not contain '::': nested::lookup", "nested qualified name refused");
    expect_render_error((rq){.messages = "[{\"role\":\"system\",\"content\":\"s\",\"tools\":[{\"namespace\":\"search::nested\","
                                         "\"function\":{\"name\":\"lookup\"}}]}]"},
                        "Tool namespace must not contain '::': search::nested", "namespace containing :: refused");
    expect_render_error_prefix((rq){.messages = "[{\"role\":\"system\",\"content\":\"s\",\"tools\":[{\"type\":\"function\"}]}]"},
                               "messages[0]: tools[0] must be an object with a 'function' object",
                               "a tool without function is refused");
    expect_render((rq){.messages = "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"s\","
                                   "\"tool_calls\":[{\"namespace\":\"search\",\"function\":{\"name\":\"lookup\",\"arguments\":{}}},"
                                   "{\"function\":{\"name\":\"files::lookup\",\"arguments\":{}}},"
                                   "{\"function\":{\"namespace\":\"db\",\"name\":\"lookup\",\"arguments\":{}}}]}]"},
                  BOS USR "q" AST ETHINK "s\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"search::lookup\">\n\n</｜DSML｜ "
                          "invoke>\n<｜DSML｜ invoke name=\"files::lookup\">\n\n</｜DSML｜ invoke>\n<｜DSML｜ invoke "
                          "name=\"db::lookup\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>" EOS,
                  "call namespaces: call level, qualified name, inside function");
    expect_render_error((rq){.messages = "[{\"role\":\"assistant\",\"tool_calls\":[{\"namespace\":\"files\",\"function\":"
                                         "{\"name\":\"search::lookup\",\"arguments\":{}}}]}]"},
                        "Conflicting tool namespaces: files != search", "conflicting namespaces (call)");
#undef CALL_MSG
#undef INVOKE
#undef P
}

/* ---- Python JSON formatting ---- */

static void test_json_format(void) {
    expect_dumps("{\"z\": 1, \"a\": {\"y\": [1, 2, {\"b\": null, \"a\": true}]}, \"m\": []}",
                 "{\"z\": 1, \"a\": {\"y\": [1, 2, {\"b\": null, \"a\": true}]}, \"m\": []}");
    expect_dumps("{\"k\":[],\"o\":{}}", "{\"k\": [], \"o\": {}}");
    expect_dumps("\"é😀 中文 \\u2028\"", "\"é😀 中文 \u2028\"");
    expect_dumps("\"\\u0000\\u0001\\b\\f\\n\\r\\t\\u001f\\\"\\\\/\\u007f\"",
                 "\"\\u0000\\u0001\\b\\f\\n\\r\\t\\u001f\\\"\\\\/\x7f\"");
    static const char *const floats[][2] = {
        {"1e16", "1e+16"},        {"1e-5", "1e-05"},       {"0.1", "0.1"},          {"100.0", "100.0"},
        {"1e2", "100.0"},         {"-0.0", "-0.0"},        {"1.0", "1.0"},          {"1e15", "1000000000000000.0"},
        {"0.0001", "0.0001"},     {"1e22", "1e+22"},       {"5e-324", "5e-324"},    {"1.5e300", "1.5e+300"},
        {"123456789.125", "123456789.125"}, {"0.30000000000000004", "0.30000000000000004"},
        {"1.7976931348623157e308", "1.7976931348623157e+308"}, {"2.5e-5", "2.5e-05"}, {"-1.25e-7", "-1.25e-07"},
        {"9007199254740993.0", "9007199254740992.0"}};
    for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++) expect_dumps(floats[i][0], floats[i][1]);
    expect_dumps("1", "1");
    expect_dumps("-9223372036854775808", "-9223372036854775808");
    expect_dumps("[true, false, null]", "[true, false, null]");

    /* jansson keeps insertion order: iteration, in-place replacement, and duplicate keys */
    json_t *o = J("{\"z\":1,\"a\":2,\"m\":3,\"b\":4,\"y\":5,\"c\":6,\"x\":7,\"d\":8,\"w\":9}");
    const char *order = "zambycxdw";
    const char *key;
    json_t *v;
    size_t k = 0;
    bool in_order = true;
    json_object_foreach(o, key, v) in_order = in_order && key[0] == order[k++];
    TAP_CHECK(in_order && k == 9, "jansson 2.14 iterates object keys in insertion order");
    json_object_set_new(o, "m", json_integer(30));
    json_object_set_new(o, "new", json_integer(10));
    char *s = ds41_json_dumps_py(o, NULL, NULL);
    TAP_CHECK(s && strcmp(s, "{\"z\": 1, \"a\": 2, \"m\": 30, \"b\": 4, \"y\": 5, \"c\": 6, \"x\": 7, \"d\": 8, "
                             "\"w\": 9, \"new\": 10}") == 0,
              "replacing a key keeps its position, a new key goes last (Python dict semantics)");
    free(s);
    json_decref(o);
    char *d = dumps("{\"a\":1,\"b\":2,\"a\":3}");
    TAP_CHECK(d && strcmp(d, "{\"a\": 3, \"b\": 2}") == 0, "duplicate keys in jansson input: first position, last value");
    free(d);

    /* json.loads edge cases */
    static const struct {
        const char *text;
        const char *dumped; /* NULL: Python's json.loads raises */
    } loads[] = {{" {\"a\" : [1, 2.50, -0, 1E2]} \n", "{\"a\": [1, 2.5, 0, 100.0]}"},
                 {"NaN", "NaN"},
                 {"[Infinity,-Infinity]", "[Infinity, -Infinity]"},
                 {"\"\\ud83d\\ude00\"", "\"😀\""},
                 {"1.", NULL},
                 {".5", NULL},
                 {"01", NULL},
                 {"[1,]", NULL},
                 {"{\"a\":1,}", NULL},
                 {"\"tab\there\"", NULL},
                 {"'x'", NULL},
                 {"\xEF\xBB\xBF{}", NULL},
                 {"1 2", NULL},
                 {"", NULL},
                 {"\x0b" "1", NULL},
                 {"nul", NULL},
                 {"\"\\x\"", NULL}};
    for (size_t i = 0; i < sizeof loads / sizeof loads[0]; i++) {
        ds41_py *p = NULL;
        bool is_json = false;
        ds41_error err;
        int rc = ds41_py_loads(loads[i].text, strlen(loads[i].text), &p, &is_json, &err);
        bool ok = rc == 0 && is_json == (loads[i].dumped != NULL);
        if (ok && p) {
            ds41_buf b = {0};
            ds41_py_dumps(p, &b);
            ok = b.data && strcmp(b.data, loads[i].dumped) == 0;
            ds41_buf_free(&b);
        }
        char shown[64] = "";
        size_t k2 = 0;
        for (const char *q = loads[i].text; *q && k2 + 5 < sizeof shown; q++) /* keep the TAP line on one line */
            k2 += (size_t)snprintf(shown + k2, sizeof shown - k2, (unsigned char)*q < 0x20 || (unsigned char)*q >= 0x80
                                                                      ? "\\x%02x" : "%c", (unsigned char)*q);
        TAP_CHECK(ok, "json.loads(%s) %s", shown, loads[i].dumped ? loads[i].dumped : "raises");
        ds41_py_free(p);
    }
    char big[4400];
    memset(big, '9', 4301);
    big[4301] = 0;
    ds41_py *p = NULL;
    bool is_json = true;
    ds41_error err;
    TAP_CHECK(ds41_py_loads(big, 4301, &p, &is_json, &err) == 0 && !is_json &&
                  ds41_py_loads(big, 4300, &p, &is_json, &err) == 0 && is_json,
              "ints: 4300 digits parse, 4301 raise (Python >= 3.11 int_max_str_digits)");
    ds41_py_free(p);
    char deep[1200];
    memset(deep, '[', 600);
    memset(deep + 600, ']', 600);
    TAP_CHECK(ds41_py_loads(deep, 1200, &p, &is_json, &err) == -1 && strstr(err.msg, "deeper"),
              "nesting beyond DS41_PY_MAX_DEPTH is a clear error, not a guess");

    /* Python repr for str() of containers */
    json_t *r = J("[\"it's\", \"say \\\"hi\\\"\", \"both ' \\\"\", \"\\n\\t\\u0001\\u007f\\u00a0\\u00e9\\u200b\\ud83d\\ude00\", "
                  "1.5, true, null, {\"k\": [1]}]");
    ds41_py *rp = ds41_py_from_json(r, &err);
    ds41_buf b = {0};
    ds41_py_str(rp, &b);
    TAP_CHECK(b.data && strcmp(b.data, "[\"it's\", 'say \"hi\"', 'both \\' \"', '\\n\\t\\x01\\x7f\\xa0é\\u200b😀', 1.5, "
                                       "True, None, {'k': [1]}]") == 0,
              "Python repr of a list: quote choice, escapes, printable non-ASCII raw");
    if (!b.data || strstr(b.data, "'say") == NULL) printf("#   repr: %s\n", b.data ? b.data : "(null)");
    ds41_buf_free(&b);
    ds41_py_free(rp);
    json_decref(r);

    /* UTF-8 helpers */
    ds41_buf clean = {0};
    ds41_utf8_sanitize("a\xC3" "b\xE2\x82" "c\xF0\x9F\x98\x80\xFF\xED\xA0\x80", 14, &clean);
    TAP_CHECK(clean.data && strcmp(clean.data, "a\xEF\xBF\xBD" "b\xEF\xBF\xBD" "c\xF0\x9F\x98\x80\xEF\xBF\xBD\xEF\xBF\xBD"
                                               "\xEF\xBF\xBD\xEF\xBF\xBD") == 0,
              "UTF-8 sanitising: one U+FFFD per maximal ill-formed subpart");
    ds41_buf_free(&clean);
}

/* ---- the reverse parser ---- */

static void expect_parse_error(const char *text, ds41_chat_mode mode, const char *expected, const char *what) {
    ds41_chat_completion c;
    ds41_error err = {{0}};
    int rc = ds41_chat_parse_completion(text, strlen(text), mode, &c, &err);
    bool ok = rc != 0 && strcmp(err.msg, expected) == 0;
    TAP_CHECK(ok, "%s", what);
    if (!ok) printf("#   expected: %s\n#   got:      %s\n", expected, rc ? err.msg : "(parsed)");
    if (rc == 0) ds41_chat_completion_free(&c);
}

static bool span_is(const char *s, size_t n, const char *want) {
    return s && n == strlen(want) && memcmp(s, want, n) == 0;
}

#define CALLS_OPEN "\n\n<｜DSML｜ calls>\n"
#define CALLS_CLOSE "</｜DSML｜ calls>"
#define INV(name) "<｜DSML｜ invoke name=\"" name "\">\n"
#define INV_END "</｜DSML｜ invoke>\n"
#define PRM(name, str, value) "<｜DSML｜ parameter name=\"" name "\" string=\"" str "\">" value "</｜DSML｜ parameter>\n"

static void test_parser(void) {
    const ds41_chat_mode C = DS41_CHAT_MODE_CHAT, T = DS41_CHAT_MODE_THINKING;
    ds41_chat_completion c;
    ds41_error err = {{0}};

    const char *text = "Let me think.\n</think>Sure:" CALLS_OPEN INV("get_weather") PRM("city", "true", "Paris, \"FR\"\n")
        PRM("days", "false", "3") PRM("opts", "false", "{\"a\": [1, 2.50]}") INV_END INV("search::lookup")
            INV_END INV("noop") "\n" INV_END CALLS_CLOSE EOS;
    int rc = ds41_chat_parse_completion(text, strlen(text), T, &c, &err);
    TAP_CHECK(rc == 0 && span_is(c.reasoning_content, c.reasoning_content_len, "Let me think.\n") &&
                  span_is(c.content, c.content_len, "Sure:") && c.n_tool_calls == 3,
              "thinking completion: reasoning, content and 3 calls");
    if (rc == 0 && c.n_tool_calls == 3) {
        TAP_CHECK(span_is(c.tool_calls[0].name, c.tool_calls[0].name_len, "get_weather") &&
                      span_is(c.tool_calls[0].arguments, c.tool_calls[0].arguments_len,
                              "{\"city\": \"Paris, \\\"FR\\\"\\n\", \"days\": 3, \"opts\": {\"a\": [1, 2.50]}}") &&
                      !c.tool_calls[0].tool_namespace,
                  "string=\"true\" values JSON-quoted, string=\"false\" values copied raw");
        TAP_CHECK(span_is(c.tool_calls[1].name, c.tool_calls[1].name_len, "lookup") &&
                      span_is(c.tool_calls[1].tool_namespace, c.tool_calls[1].tool_namespace_len, "search") &&
                      span_is(c.tool_calls[1].arguments, c.tool_calls[1].arguments_len, "{}"),
                  "qualified invoke name split into namespace + name; no-param invoke");
        TAP_CHECK(span_is(c.tool_calls[2].name, c.tool_calls[2].name_len, "noop"),
                  "an invoke with an empty line before its end parses");
        json_t *msg = ds41_chat_completion_to_message(&c, &err);
        char *s = msg ? json_dumps(msg, JSON_PRESERVE_ORDER | JSON_COMPACT) : NULL;
        const char *head = "{\"role\":\"assistant\",\"content\":\"Sure:\",\"reasoning_content\":\"Let me think.\\n\","
                           "\"tool_calls\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"";
        TAP_CHECK(s && strncmp(s, head, strlen(head)) == 0 &&
                      strstr(s, "{\"type\":\"function\",\"namespace\":\"search\",\"function\":{\"name\":\"lookup\","
                                "\"arguments\":\"{}\"}}"),
                  "to_message: official key order, namespace beside type, no ids");
        free(s);
        json_decref(msg);
        ds41_chat_completion_free(&c);
    }
    rc = ds41_chat_parse_completion("Hello." EOS, strlen("Hello." EOS), C, &c, &err);
    TAP_CHECK(rc == 0 && span_is(c.content, c.content_len, "Hello.") && c.reasoning_content_len == 0 &&
                  c.n_tool_calls == 0,
              "chat completion: content only, reasoning empty");
    ds41_chat_completion_free(&c);
    const char *no_eos = "x" CALLS_OPEN INV("f") PRM("k", "true", "v") INV_END CALLS_CLOSE;
    rc = ds41_chat_parse_completion(no_eos, strlen(no_eos), C, &c, &err);
    TAP_CHECK(rc == 0 && c.n_tool_calls == 1, "a tool-call block needs no EOS (official behaviour)");
    ds41_chat_completion_free(&c);
    const char *cut_invoke = "a" CALLS_OPEN INV("f");
    rc = ds41_chat_parse_completion(cut_invoke, strlen(cut_invoke), C, &c, &err);
    TAP_CHECK(rc == 0 && c.n_tool_calls == 1 && span_is(c.tool_calls[0].arguments, c.tool_calls[0].arguments_len, "{}"),
              "a last invoke cut right after its name line parses (official behaviour)");
    ds41_chat_completion_free(&c);
    const char *ws_name = "a" CALLS_OPEN "<｜DSML｜ invoke \u3000\t name=\"f\">\n" INV_END CALLS_CLOSE EOS;
    rc = ds41_chat_parse_completion(ws_name, strlen(ws_name), C, &c, &err);
    TAP_CHECK(rc == 0 && c.n_tool_calls == 1 && span_is(c.tool_calls[0].name, c.tool_calls[0].name_len, "f"),
              "invoke head allows Unicode whitespace before name= (Python \\s)");
    ds41_chat_completion_free(&c);
    const char *lt_value = "a" CALLS_OPEN INV("f") "<｜DSML｜ parameter name=\"k\" string=\"true\">a<b<\n/｜DSML｜ "
                                                   "parameter>\n" INV_END CALLS_CLOSE EOS;
    rc = ds41_chat_parse_completion(lt_value, strlen(lt_value), C, &c, &err);
    TAP_CHECK(rc == 0 && c.n_tool_calls == 1 &&
                  span_is(c.tool_calls[0].arguments, c.tool_calls[0].arguments_len, "{\"k\": \"a<b\"}"),
              "parameter regex: value may hold '<'; '$' allows one final newline");
    ds41_chat_completion_free(&c);

    const char *same_names = "a" CALLS_OPEN INV("f") PRM("k", "true", "1") PRM("j", "true", "2") INV_END INV("g")
        PRM("k", "true", "3") PRM("j", "true", "4") INV_END CALLS_CLOSE EOS;
    rc = ds41_chat_parse_completion(same_names, strlen(same_names), C, &c, &err);
    TAP_CHECK(rc == 0 && c.n_tool_calls == 2 &&
                  span_is(c.tool_calls[1].arguments, c.tool_calls[1].arguments_len, "{\"k\": \"3\", \"j\": \"4\"}"),
              "the same parameter names in two invokes are fine");
    ds41_chat_completion_free(&c);
    ds41_buf many = {0};
    ds41_buf_puts(&many, "a" CALLS_OPEN INV("f"));
    for (int i = 0; i < 300; i++) ds41_buf_printf(&many, PRM("p%d", "false", "%d"), i, i);
    ds41_buf_puts(&many, PRM("p17", "true", "again") INV_END CALLS_CLOSE EOS);
    rc = ds41_chat_parse_completion(many.data, many.len, C, &c, &err);
    TAP_CHECK(rc != 0 && strcmp(err.msg, "Duplicate parameter name: 'p17'") == 0,
              "a duplicate after 300 parameters is found");
    if (rc == 0) ds41_chat_completion_free(&c);
    ds41_buf_free(&many);

    /* every §11.7 message */
    expect_parse_error("reasoning without end" EOS, T, "Invalid thinking format: missing </think>",
                       "thinking without </think>");
    expect_parse_error("r" CALLS_OPEN INV("f") INV_END CALLS_CLOSE EOS ETHINK, T,
                       "Invalid thinking format: missing </think>", "a tool block before </think>");
    expect_parse_error("no end", C, "Invalid format: missing EOS token", "missing EOS");
    expect_parse_error("a\n\n<｜DSML｜ calls>\nX" INV("f") INV_END CALLS_CLOSE EOS, C,
                       "Tool call format error: expected '>\\n' but got '>\nX'", "junk before an invoke");
    expect_parse_error("a\n\n<｜DSML｜ calls>\n", C, "Missing special token in tool calls",
                       "a block that ends after its opening line");
    expect_parse_error("a" CALLS_OPEN "<｜DSML｜ invoke nam=\"f\">\n" INV_END CALLS_CLOSE EOS, C,
                       "Tool name format error: ' nam=\"f\">\n'", "bad invoke head");
    expect_parse_error("a" CALLS_OPEN INV("f") PRM("k", "maybe", "v") INV_END CALLS_CLOSE EOS, C,
                       "Parameter format error: ' name=\"k\" string=\"maybe\">v<'", "bad string= flag");
    expect_parse_error("a" CALLS_OPEN INV("f") "<｜DSML｜ parameter name=\"k\" string=\"true\">v</｜DSML｜ parameter>X\n"
                                              INV_END CALLS_CLOSE EOS,
                       C, "Parameter format error: expected '>\\n' but got '>X\n'", "junk after a parameter");
    expect_parse_error("a" CALLS_OPEN INV("f") PRM("k", "true", "1") PRM("k", "false", "2") INV_END CALLS_CLOSE EOS, C,
                       "Duplicate parameter name: 'k'", "duplicate parameter");
    expect_parse_error("a" CALLS_OPEN INV("f") INV_END CALLS_CLOSE "junk" EOS, C, "Unexpected content after tool calls",
                       "text between the block and EOS");
    expect_parse_error("a" CALLS_OPEN INV("f") INV_END CALLS_CLOSE EOS "more", C, "Unexpected content at end",
                       "text after EOS (tool path)");
    expect_parse_error("hi" EOS "more", C, "Unexpected content at end", "text after EOS");
    expect_parse_error("a<think>b" EOS, C, "Unexpected special token '<think>' in content", "<think> in content");
    expect_parse_error("r" BOS ETHINK "c" EOS, T, "Unexpected special token '" BOS "' in content", "BOS in reasoning");
    expect_parse_error("r" EOS ETHINK "c" EOS, T, "Unexpected special token '" EOS "' in content", "EOS in reasoning");
    expect_parse_error("r" ETHINK "c</think>d" EOS, T, "Unexpected special token '</think>' in content",
                       "</think> in content");
    expect_parse_error("see <｜DSML｜tool_calls>" EOS, C, "Unexpected special token '｜DSML｜' in content",
                       "V4's unspaced DSML is content, and refused");
    char bad_utf8[] = "a\xFF" EOS;
    expect_parse_error(bad_utf8, C, "completion text is not valid UTF-8 (byte 1)", "ill-formed UTF-8 refused (strict)");

    /* a long quote is cut at a character boundary */
    char longp[4096];
    int n = snprintf(longp, sizeof longp, "a" CALLS_OPEN INV("f") "<｜DSML｜ parameter name=\"k\" string=\"nope\">");
    for (int i = 0; i < 500; i++) n += snprintf(longp + n, sizeof longp - (size_t)n, "é");
    snprintf(longp + n, sizeof longp - (size_t)n, "</｜DSML｜ parameter>\n" INV_END CALLS_CLOSE EOS);
    rc = ds41_chat_parse_completion(longp, strlen(longp), C, &c, &err);
    size_t ml = strlen(err.msg);
    const char *lp = "Parameter format error: ' name=\"k\" string=\"nope\">éé";
    TAP_CHECK(rc != 0 && strncmp(err.msg, lp, strlen(lp)) == 0 && ml < DS41_ERROR_MAX - 1 &&
                  strcmp(err.msg + ml - 4, "...'") == 0 && ds41_utf8_valid(err.msg, ml, NULL),
              "a quote too long for the error buffer is cut on a character boundary, ending ...'");

    /* lenient */
    const struct {
        const char *text;
        ds41_chat_mode mode;
        const char *reasoning, *content;
        size_t calls;
        const char *what;
    } lenient[] = {
        {"partial answer", C, "", "partial answer", 0, "lenient: no EOS, content to the end"},
        {"still thinking", T, "still thinking", "", 0, "lenient: no </think>, all reasoning"},
        {"r" CALLS_OPEN INV("f") INV_END CALLS_CLOSE EOS, T, "r", "", 1, "lenient: calls without </think>"},
        {"ok" CALLS_OPEN INV("get_w") "<｜DSML｜ parameter name=\"city\" str", C, "",
         "ok" CALLS_OPEN INV("get_w") "<｜DSML｜ parameter name=\"city\" str", 0,
         "lenient: a cut-off block gives no calls, its raw text goes to content"},
        {"ok" CALLS_OPEN INV("f") INV_END CALLS_CLOSE "tail" EOS "after", C, "", "oktail", 1,
         "lenient: text after the block kept, text after EOS dropped"},
        {"a<think>b" EOS, C, "", "a<think>b", 0, "lenient: special tokens in content kept"},
        {"a\xC3(" EOS, C, "", "a\xEF\xBF\xBD(", 0, "lenient: ill-formed UTF-8 replaced"},
    };
    for (size_t i = 0; i < sizeof lenient / sizeof lenient[0]; i++) {
        ds41_error note = {{0}};
        rc = ds41_chat_parse_completion_lenient(lenient[i].text, strlen(lenient[i].text), lenient[i].mode, &c, &note);
        bool ok = rc == 0 && c.repaired && span_is(c.reasoning_content, c.reasoning_content_len, lenient[i].reasoning) &&
                  span_is(c.content, c.content_len, lenient[i].content) && c.n_tool_calls == lenient[i].calls &&
                  note.msg[0] != 0;
        TAP_CHECK(ok, "%s", lenient[i].what);
        if (!ok && rc == 0) {
            show("reasoning", c.reasoning_content, c.reasoning_content_len);
            show("content", c.content, c.content_len);
        }
        if (rc == 0) {
            json_t *m = ds41_chat_completion_to_message(&c, &err);
            if (!m) TAP_CHECK(0, "lenient result converts to a message");
            json_decref(m);
        }
        ds41_chat_completion_free(&c);
    }
    ds41_error note = {{0}};
    rc = ds41_chat_parse_completion_lenient("fine" EOS, strlen("fine" EOS), C, &c, &note);
    TAP_CHECK(rc == 0 && !c.repaired && span_is(c.content, c.content_len, "fine"),
              "lenient = strict on a well-formed text (repaired false)");
    ds41_chat_completion_free(&c);
}

/* ---- render -> parse round trips over generated call sets ---- */

static uint64_t rng_state = 0x9E3779B97F4A7C15u;
static uint32_t rnd(uint32_t n) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

static json_t *random_value(int depth) {
    static const char *const strings[] = {"Paris", "café \"best\"", "line1\nline2", "tab\there", "", "<b>&</b>",
                                          "it's", "😀 emoji", "back\\slash", "a < b > c", "  spaced  ", "\u00a0nbsp"};
    uint32_t r = rnd(depth > 1 ? 7 : 9);
    switch (r) {
    case 0: return json_string(strings[rnd(12)]);
    case 1: return json_string(strings[rnd(12)]);
    case 2: return json_integer((json_int_t)rnd(2000000) - 1000000);
    case 3: return json_real((double)rnd(100000) / 64.0 - 50.0);
    case 4: return json_boolean(rnd(2));
    case 5: return json_null();
    case 6: return json_real(rnd(2) ? 1e16 : 2.5e-7);
    case 7: {
        json_t *a = json_array();
        for (uint32_t i = rnd(4); i > 0; i--) json_array_append_new(a, random_value(depth + 1));
        return a;
    }
    default: {
        json_t *o = json_object();
        for (uint32_t i = rnd(4); i > 0; i--) {
            char key[16];
            snprintf(key, sizeof key, "k%u", rnd(9));
            json_object_set_new(o, key, random_value(depth + 1));
        }
        return o;
    }
    }
}

static void test_round_trips(void) {
    static const char *const names[] = {"get_weather", "search", "run_code", "files::read", "db::query"};
    int failures = 0, cases = 0;
    char first[256] = "";
    for (int set = 0; set < 24; set++) {
        ds41_chat_mode mode = set % 2 ? DS41_CHAT_MODE_THINKING : DS41_CHAT_MODE_CHAT;
        json_t *calls = json_array();
        json_t *args_list = json_array();
        size_t n_calls = 1 + rnd(3);
        for (size_t i = 0; i < n_calls; i++) {
            json_t *args = json_object();
            for (uint32_t k = rnd(5); k > 0; k--) {
                char key[16];
                snprintf(key, sizeof key, "%s%u", rnd(2) ? "p" : "é", rnd(20));
                json_object_set_new(args, key, random_value(0));
            }
            json_array_append(args_list, args);
            char *args_text = ds41_json_dumps_py(args, NULL, NULL);
            /* arguments as the JSON string clients send, or as an object */
            const char *name = names[rnd(5)];
            json_t *as_sent = rnd(2) ? json_string(args_text) : json_incref(args);
            json_t *fn = json_pack("{s:s, s:o}", "name", name, "arguments", as_sent);
            json_array_append_new(calls, json_pack("{s:s, s:o}", "type", "function", "function", fn));
            free(args_text);
            json_decref(args);
        }
        json_t *assistant = json_pack("{s:s, s:s, s:o}", "role", "assistant", "content", rnd(2) ? "" : "Let me check.",
                                      "tool_calls", calls);
        if (mode == DS41_CHAT_MODE_THINKING) json_object_set_new(assistant, "reasoning_content", json_string("Plan."));
        json_t *messages = json_pack("[o]", assistant);
        json_t *context = J("[{\"role\":\"user\",\"content\":\"do it\"}]");
        ds41_chat_request req = ds41_chat_request_default();
        req.messages = messages;
        req.context = context;
        req.mode = mode;
        ds41_chat_prompt p;
        ds41_error err;
        bool ok = ds41_chat_render(&req, &p, &err) == 0;
        ds41_chat_completion c = {0};
        ok = ok && ds41_chat_parse_completion(p.text, p.len, mode, &c, &err) == 0;
        ok = ok && c.n_tool_calls == n_calls;
        for (size_t i = 0; ok && i < n_calls; i++) {
            json_t *fn = json_object_get(json_array_get(calls, i), "function");
            const char *qname = json_string_value(json_object_get(fn, "name"));
            const char *sep = strstr(qname, "::");
            char *want_args = ds41_json_dumps_py(json_array_get(args_list, i), NULL, NULL);
            ok = want_args && span_is(c.tool_calls[i].arguments, c.tool_calls[i].arguments_len, want_args) &&
                 span_is(c.tool_calls[i].name, c.tool_calls[i].name_len, sep ? sep + 2 : qname) &&
                 (sep ? (c.tool_calls[i].tool_namespace && c.tool_calls[i].tool_namespace_len == (size_t)(sep - qname) &&
                         memcmp(c.tool_calls[i].tool_namespace, qname, (size_t)(sep - qname)) == 0)
                      : c.tool_calls[i].tool_namespace == NULL);
            free(want_args);
        }
        /* the official property: the parsed message rendered after the same prompt gives the text back */
        if (ok) {
            json_t *back = ds41_chat_completion_to_message(&c, &err);
            json_t *again = json_pack("[o]", back);
            ds41_chat_request req2 = req;
            req2.messages = again;
            ds41_chat_prompt p2;
            ok = back && ds41_chat_render(&req2, &p2, &err) == 0;
            ok = ok && p2.len == p.len && memcmp(p2.text, p.text, p.len) == 0;
            if (back && ok) ds41_chat_prompt_free(&p2);
            json_decref(again);
        }
        cases++;
        if (!ok && failures++ == 0) snprintf(first, sizeof first, "set %d (%.200s)", set, err.msg);
        ds41_chat_completion_free(&c);
        if (p.text) ds41_chat_prompt_free(&p);
        json_decref(messages);
        json_decref(context);
        json_decref(args_list);
    }
    TAP_CHECK(failures == 0, "render -> parse -> render round trips over %d generated call sets%s%s", cases,
              failures ? ": first failure " : "", first);
}

int main(void) {
    test_fixtures();
    test_worked_examples();
    test_effort();
    test_system_messages();
    test_multi_turn();
    test_reminder_and_tasks();
    test_tool_results();
    test_content_blocks();
    test_tool_calls();
    test_json_format();
    test_parser();
    test_round_trips();
    return tap_done();
}
