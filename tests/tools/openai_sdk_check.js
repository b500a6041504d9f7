// The official OpenAI Node SDK (openai@6) against ds41d over its Unix socket, through an undici@6
// Agent with connect.socketPath.  Prints one JSON object per case: {"ok": bool, "what": ..., "detail": ...}.
// usage: node openai_sdk_check.js NODE_MODULES_DIR SOCKET_PATH
'use strict';
const [modules, socketPath] = process.argv.slice(2);
const { OpenAI, client, report } = require('./openai_sdk_client.js')(modules, socketPath);

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
  let reasoning = '', content = '', sfinish = null, rawFirst = null, toolChunks = 0;
  const scalls = [], rawLater = [];
  for await (const chunk of st) {
    for (const ch of chunk.choices) {
      reasoning += ch.delta.reasoning_content || '';
      content += ch.delta.content || '';
      if ((ch.delta.tool_calls || []).length) toolChunks++;
      for (const tc of ch.delta.tool_calls || []) {
        if (!rawFirst) rawFirst = tc; else rawLater.push(tc);
        if (!scalls[tc.index]) scalls[tc.index] = { id: tc.id, type: tc.type, name: '', arguments: '' };
        if (tc.function && tc.function.name) scalls[tc.index].name += tc.function.name;
        if (tc.function && tc.function.arguments) scalls[tc.index].arguments += tc.function.arguments;
      }
      if (ch.finish_reason) sfinish = ch.finish_reason;
    }
  }
  report(rawFirst && rawFirst.index === 0 && /^call_/.test(rawFirst.id) && rawFirst.type === 'function' &&
         rawFirst.function.name === 'get_weather' && rawFirst.function.arguments === '' && toolChunks >= 2 &&
         !rawLater.some((tc) => tc.id !== undefined || tc.type !== undefined || (tc.function && tc.function.name !== undefined)),
         'tool call streamed as deltas: first chunk index, id, type, name with arguments "", then the arguments (a call is sent once its invoke is complete)',
         { rawFirst, toolChunks, rawLater: rawLater.slice(0, 3) });
  report(reasoning === 'The user wants the weather.' && content === '' && sfinish === 'tool_calls' &&
         scalls.length === 1 && scalls[0].name === 'get_weather' && scalls[0].arguments === '{"city": "Paris"}' &&
         scalls[0].type === 'function' && /^call_/.test(scalls[0].id),
         'forced output streamed: the same tool call and reasoning_content', { reasoning, content, sfinish, scalls });

  // two calls through the SDK's stream helper, which accumulates the tool_call deltas
  const FORCED2 =
    'Two cities.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n' +
    '<｜DSML｜ parameter name="city" string="true">Paris "Lutèce"</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n' +
    '<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n' +
    '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n' +
    '</｜DSML｜ calls><｜end▁of▁sentence｜>';
  const expected2 = [{ name: 'get_weather', arguments: '{"city": "Paris \\"Lutèce\\""}' },
                     { name: 'get_weather', arguments: '{"city": "Rome", "days": 3}' }];
  const two = { ...toolReq, ds41_forced_output: FORCED2 };
  const helper = client.chat.completions.stream(two);
  let argDeltas = 0;
  const done = [];
  helper.on('tool_calls.function.arguments.delta', (e) => { if (e.arguments_delta) argDeltas++; });
  helper.on('tool_calls.function.arguments.done', (e) => done.push({ name: e.name, arguments: e.arguments }));
  const fin = await helper.finalChatCompletion();
  const hm = fin.choices[0].message;
  const hcalls = (hm.tool_calls || []).map((c) => ({ name: c.function.name, arguments: c.function.arguments }));
  report(JSON.stringify(hcalls) === JSON.stringify(expected2) && JSON.stringify(done) === JSON.stringify(expected2) &&
         argDeltas >= 2 && fin.choices[0].finish_reason === 'tool_calls' &&
         hm.tool_calls.every((c) => /^call_/.test(c.id)) && hm.tool_calls[0].id !== hm.tool_calls[1].id,
         'stream helper: the accumulated tool_calls are exactly the forced ones (two calls, argument deltas)',
         { hcalls, done, argDeltas });
  const ns2 = await client.chat.completions.create(two);
  const ncalls = (ns2.choices[0].message.tool_calls || []).map((c) => ({ name: c.function.name, arguments: c.function.arguments }));
  report(JSON.stringify(ncalls) === JSON.stringify(expected2), 'non-streamed: the same two calls', ncalls);

  // tool_choice forces a call from the random model, streamed and not, with parallel_tool_calls false
  const named = { model: 'ds41-tiny', messages: [{ role: 'user', content: 'Weather in Paris?' }], tools: TOOLS,
                  tool_choice: { type: 'function', function: { name: 'get_weather' } }, parallel_tool_calls: false,
                  thinking: { type: 'disabled' }, max_tokens: 200, seed: 4, temperature: 1 };
  // (200: the schema grammar reserves one token per byte of the shortest close; at 80 the close
  // of a random model's call is cut by the budget and the call comes back with finish 'length')
  const n1 = await client.chat.completions.create(named);
  const n1m = n1.choices[0].message;
  let n1args = null;
  try { n1args = JSON.parse(n1m.tool_calls[0].function.arguments); } catch (e) { n1args = null; }
  report(n1.choices[0].finish_reason === 'tool_calls' && n1m.tool_calls && n1m.tool_calls.length === 1 &&
         n1m.tool_calls[0].function.name === 'get_weather' && n1args !== null && !n1m.content,
         'tool_choice named (random model, no forced output): one call to that function, JSON arguments', n1m);
  const n2 = await client.chat.completions.stream(named).finalChatCompletion();
  const n2m = n2.choices[0].message;
  report(n2.choices[0].finish_reason === 'tool_calls' && n2m.tool_calls && n2m.tool_calls.length === 1 &&
         n2m.tool_calls[0].function.name === 'get_weather' &&
         n2m.tool_calls[0].function.arguments === n1m.tool_calls[0].function.arguments,
         'tool_choice named, streamed: the same call, accumulated from deltas', { n2m, n1m });
  const rq = await client.chat.completions.create({ ...named, tool_choice: 'required', seed: 5 });
  report(rq.choices[0].finish_reason === 'tool_calls' && rq.choices[0].message.tool_calls.length === 1,
         'tool_choice required: a call', rq.choices[0].message);
  const none = await client.chat.completions.create({ ...toolReq, tool_choice: 'none' });
  report(!none.choices[0].message.tool_calls && none.choices[0].finish_reason === 'stop' &&
         none.choices[0].message.content.includes('<｜DSML｜ invoke'),
         'tool_choice none: no tools parsed, the block stays content', none.choices[0].message);

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
