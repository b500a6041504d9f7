// The official OpenAI Node SDK (openai@6) against ds41d over its Unix socket, through an undici@6
// Agent with connect.socketPath.  Prints one JSON object per case: {"ok": bool, "what": ..., "detail": ...}.
// usage: node openai_sdk_check.js NODE_MODULES_DIR SOCKET_PATH
'use strict';
const path = require('path');
const [modules, socketPath] = process.argv.slice(2);
const OpenAI = require(path.join(modules, 'openai')).default || require(path.join(modules, 'openai'));
const undici = require(path.join(modules, 'undici'));

const client = new OpenAI({
  baseURL: 'http://ds41/v1',
  apiKey: 'unused',
  maxRetries: 0,
  fetch: undici.fetch,
  fetchOptions: { dispatcher: new undici.Agent({ connect: { socketPath } }) },
});

function report(ok, what, detail) {
  console.log(JSON.stringify({ ok: !!ok, what, detail: ok ? '' : JSON.stringify(detail).slice(0, 400) }));
}

const FORCED =
  'The user wants the weather.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n' +
  '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n' +
  '</｜DSML｜ calls><｜end▁of▁sentence｜>';
const TOOLS = [{
  type: 'function',
  function: { name: 'get_weather', description: 'Weather of a city',
              parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } },
}];

async function main() {
  const models = await client.models.list();
  const ids = models.data.map((m) => m.id);
  report(ids.length === 1 && ids[0] === 'ds41-tiny', 'models.list() gives ds41-tiny', ids);

  const base = { model: 'ds41-tiny', messages: [{ role: 'user', content: 'Tell me about Paris.' }],
                 max_tokens: 10, seed: 11, temperature: 0.7 };
  const r1 = await client.chat.completions.create(base);
  const c1 = r1.choices[0].message.content;
  report(r1.object === 'chat.completion' && typeof c1 === 'string' && r1.usage.completion_tokens === 10 &&
         typeof r1.usage.prompt_tokens_details.cached_tokens === 'number' && r1.choices[0].finish_reason === 'length',
         'chat.completions.create: content, usage with cached_tokens, finish length', r1);

  let streamed = '', finish = null, usage = null, chunks = 0;
  const stream = await client.chat.completions.create({ ...base, stream: true, stream_options: { include_usage: true } });
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const ch of chunk.choices) {
      streamed += ch.delta.content || '';
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  report(streamed === c1 && finish === 'length' && usage && usage.completion_tokens === 10 && chunks > 3,
         'streamed chat: the same text, finish length, usage in the last chunk', { streamed, c1, finish, usage });

  const r2 = await client.chat.completions.create(base);
  report(r2.choices[0].message.content === c1 &&
         r2.usage.prompt_tokens_details.cached_tokens === r2.usage.prompt_tokens - 1,
         'the same request again: the same answer from the prefix cache (cached_tokens)', r2.usage);

  const toolReq = { model: 'ds41-tiny', messages: [{ role: 'user', content: 'Weather in Paris?' }], tools: TOOLS,
                    reasoning_effort: 'high', ds41_forced_output: FORCED };
  const t1 = await client.chat.completions.create(toolReq);
  const m = t1.choices[0].message;
  const calls = (m.tool_calls || []).map((c) => ({ type: c.type, name: c.function.name, arguments: c.function.arguments,
                                                    id_ok: /^call_/.test(c.id) }));
  report(JSON.stringify(calls) === JSON.stringify([{ type: 'function', name: 'get_weather',
                                                     arguments: '{"city": "Paris"}', id_ok: true }]) &&
         m.reasoning_content === 'The user wants the weather.' && !m.content &&
         t1.choices[0].finish_reason === 'tool_calls',
         'forced output: exactly the expected tool_calls and reasoning_content', m);
  report(JSON.parse(m.tool_calls[0].function.arguments).city === 'Paris', 'tool call arguments are JSON', m.tool_calls);

  const st = await client.chat.completions.create({ ...toolReq, stream: true });
  let reasoning = '', content = '', sfinish = null;
  const scalls = [];
  for await (const chunk of st) {
    for (const ch of chunk.choices) {
      reasoning += ch.delta.reasoning_content || '';
      content += ch.delta.content || '';
      for (const tc of ch.delta.tool_calls || []) {
        if (!scalls[tc.index]) scalls[tc.index] = { id: tc.id, type: tc.type, name: '', arguments: '' };
        if (tc.function && tc.function.name) scalls[tc.index].name += tc.function.name;
        if (tc.function && tc.function.arguments) scalls[tc.index].arguments += tc.function.arguments;
      }
      if (ch.finish_reason) sfinish = ch.finish_reason;
    }
  }
  report(reasoning === 'The user wants the weather.' && content === '' && sfinish === 'tool_calls' &&
         scalls.length === 1 && scalls[0].name === 'get_weather' && scalls[0].arguments === '{"city": "Paris"}' &&
         scalls[0].type === 'function' && /^call_/.test(scalls[0].id),
         'forced output streamed: the same tool call and reasoning_content', { reasoning, content, sfinish, scalls });

  // the conversation goes on with the tool result, as the SDK user would send it
  const follow = await client.chat.completions.create({
    model: 'ds41-tiny', max_tokens: 3, tools: TOOLS,
    messages: [{ role: 'user', content: 'Weather in Paris?' }, m,
               { role: 'tool', tool_call_id: m.tool_calls[0].id, content: '{"temp": 18}' }],
  });
  report(follow.choices[0].message.role === 'assistant' && follow.usage.prompt_tokens > t1.usage.prompt_tokens,
         'the assistant message with tool_calls and a tool result go back in', follow.usage);

  const cmpl = await client.completions.create({ model: 'ds41-tiny', prompt: 'Once upon a time', max_tokens: 5, seed: 2 });
  report(cmpl.object === 'text_completion' && typeof cmpl.choices[0].text === 'string' && cmpl.usage.completion_tokens === 5,
         'completions.create', cmpl);

  try {
    await client.chat.completions.create({ ...base, model: 'gpt-4o' });
    report(false, 'an unknown model raises NotFoundError', 'no error');
  } catch (e) {
    report(e instanceof OpenAI.NotFoundError && e.status === 404 && e.code === 'model_not_found',
           'an unknown model raises NotFoundError (404, model_not_found)', { status: e.status, code: e.code, name: e.name });
  }
  try {
    await client.chat.completions.create({ ...base, temperature: 7 });
    report(false, 'a bad temperature raises BadRequestError', 'no error');
  } catch (e) {
    report(e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === 'temperature',
           'a bad temperature raises BadRequestError naming the param', { status: e.status, param: e.param });
  }
}

main().then(() => process.exit(0), (e) => {
  report(false, 'the SDK run finished without an exception', String(e && e.stack || e));
  process.exit(0);
});
