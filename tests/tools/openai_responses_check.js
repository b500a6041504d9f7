// The official OpenAI Node SDK's Responses API (openai@6: client.responses.create / retrieve /
// delete, streaming) against ds41d over its Unix socket, through an undici@6 Agent.
// Prints one JSON object per case: {"ok": bool, "what": ..., "detail": ...}.
// usage: node openai_responses_check.js NODE_MODULES_DIR SOCKET_PATH PHASE STATE_FILE
//   PHASE "first": everything, then writes the id of a stored response to STATE_FILE;
//   PHASE "restarted": (a new daemon on the same state directory) continues that response.
'use strict';
const fs = require('fs');
const [modules, socketPath, phase, stateFile] = process.argv.slice(2);
const { OpenAI, client, report } = require('./openai_sdk_client.js')(modules, socketPath);

const FORCED_TOOL =
  'The user wants the weather.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n' +
  '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n' +
  '</｜DSML｜ calls><｜end▁of▁sentence｜>';
const TOOLS = [{
  type: 'function', name: 'get_weather', description: 'Weather of a city', strict: false,
  parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
}];
const BASE = { model: 'ds41-tiny', instructions: 'You are terse.', max_output_tokens: 8, seed: 11, temperature: 0.7 };

async function collect(stream) {
  const events = [];
  for await (const ev of stream) events.push(ev);
  return events;
}

async function first() {
  // plain
  const r1 = await client.responses.create({ ...BASE, input: 'Tell me about Paris.' });
  const msg = r1.output.find((o) => o.type === 'message');
  report(/^resp_[0-9a-f]{32}$/.test(r1.id) && r1.object === 'response' && r1.status === 'incomplete' &&
         r1.incomplete_details.reason === 'max_output_tokens' && msg && msg.role === 'assistant' &&
         msg.content[0].type === 'output_text' && typeof r1.output_text === 'string' &&
         r1.output_text === msg.content[0].text && r1.usage.output_tokens === 8 &&
         r1.usage.input_tokens > 0 && typeof r1.usage.input_tokens_details.cached_tokens === 'number' &&
         r1.usage.total_tokens === r1.usage.input_tokens + 8 && r1.store === true,
         'responses.create: a response object, output_text, usage, incomplete at max_output_tokens', r1);

  // streamed: the same text, events in order with increasing sequence numbers
  const events = await collect(await client.responses.create({ ...BASE, input: 'Tell me about Paris.', stream: true }));
  const types = events.map((e) => e.type);
  const seqOk = events.every((e, i) => e.sequence_number === i);
  const deltas = events.filter((e) => e.type === 'response.output_text.delta').map((e) => e.delta).join('');
  const last = events[events.length - 1];
  const textDone = events.find((e) => e.type === 'response.output_text.done');
  const order = ['response.created', 'response.in_progress', 'response.output_item.added', 'response.content_part.added',
                 'response.output_text.delta', 'response.output_text.done', 'response.content_part.done',
                 'response.output_item.done', 'response.incomplete'];
  const firstIdx = order.map((t) => types.indexOf(t));
  report(seqOk && firstIdx.every((v, i) => v >= 0 && (i === 0 || v > firstIdx[i - 1])) &&
         deltas === r1.output_text && textDone && textDone.text === deltas &&
         last.type === 'response.incomplete' && last.response.output_text === undefined &&
         last.response.output[0].content[0].text === deltas && last.response.usage.output_tokens === 8,
         'streamed: created, in_progress, item/part added, text deltas, done events, incomplete; deltas = the text',
         { types, deltas, text: r1.output_text });

  // reasoning effort with a forced thinking output: a reasoning item, reasoning tokens
  const FORCED_THINK = 'Paris is a city.</think>It is the capital.<｜end▁of▁sentence｜>';
  const rr = await client.responses.create({ model: 'ds41-tiny', input: 'About Paris?', reasoning: { effort: 'high' },
                                             ds41_forced_output: FORCED_THINK });
  const ri = rr.output[0];
  report(rr.status === 'completed' && ri.type === 'reasoning' && ri.content[0].type === 'reasoning_text' &&
         ri.content[0].text === 'Paris is a city.' && rr.output[1].type === 'message' &&
         rr.output_text === 'It is the capital.' && rr.usage.output_tokens_details.reasoning_tokens > 0 &&
         rr.reasoning.effort === 'high',
         'reasoning effort high: a reasoning item with the thinking, then the message; reasoning_tokens', rr);
  const rev = await collect(await client.responses.create({ model: 'ds41-tiny', input: 'About Paris?',
                                                            reasoning: { effort: 'high' }, ds41_forced_output: FORCED_THINK,
                                                            stream: true }));
  const rtext = rev.filter((e) => e.type === 'response.reasoning_text.delta').map((e) => e.delta).join('');
  const rdone = rev.find((e) => e.type === 'response.reasoning_text.done');
  report(rtext === 'Paris is a city.' && rdone && rdone.text === rtext &&
         rev[rev.length - 1].type === 'response.completed' &&
         rev.filter((e) => e.type === 'response.output_text.delta').map((e) => e.delta).join('') === 'It is the capital.',
         'streamed reasoning: reasoning_text deltas, then output_text deltas, response.completed', rev.map((e) => e.type));

  // function tool round trip
  const t1 = await client.responses.create({ model: 'ds41-tiny', input: 'Weather in Paris?', tools: TOOLS,
                                             reasoning: { effort: 'high' }, ds41_forced_output: FORCED_TOOL });
  const call = t1.output.find((o) => o.type === 'function_call');
  report(call && call.name === 'get_weather' && JSON.parse(call.arguments).city === 'Paris' &&
         /^call_/.test(call.call_id) && /^fc_/.test(call.id) && t1.output[0].type === 'reasoning' &&
         t1.status === 'completed' && t1.tools[0].name === 'get_weather',
         'function tool: a function_call item with the forced call', t1.output);
  const tev = await collect(await client.responses.create({ model: 'ds41-tiny', input: 'Weather in Paris?', tools: TOOLS,
                                                            reasoning: { effort: 'high' }, ds41_forced_output: FORCED_TOOL,
                                                            stream: true }));
  const targs = tev.filter((e) => e.type === 'response.function_call_arguments.delta').map((e) => e.delta).join('');
  const tdone = tev.find((e) => e.type === 'response.function_call_arguments.done');
  const tadded = tev.find((e) => e.type === 'response.output_item.added' && e.item.type === 'function_call');
  report(tadded && tadded.item.name === 'get_weather' && targs === call.arguments && tdone && tdone.arguments === targs,
         'streamed function call: output_item.added, arguments deltas, arguments.done', tev.map((e) => e.type));
  const t2 = await client.responses.create({
    model: 'ds41-tiny', tools: TOOLS, previous_response_id: t1.id, max_output_tokens: 4,
    input: [{ type: 'function_call_output', call_id: call.call_id, output: '{"temp": 18}' }],
  });
  report(t2.previous_response_id === t1.id && t2.output.some((o) => o.type === 'message') &&
         t2.usage.input_tokens > t1.usage.input_tokens,
         'function_call_output with previous_response_id: a reply', t2);
  // the same round trip without the store: the items go back in as input
  const t3 = await client.responses.create({
    model: 'ds41-tiny', tools: TOOLS, max_output_tokens: 4, store: false,
    input: [{ role: 'user', content: 'Weather in Paris?' }, ...t1.output,
            { type: 'function_call_output', call_id: call.call_id, output: '{"temp": 18}' }],
  });
  report(t3.status === 'incomplete' && t3.store === false && t3.usage.input_tokens > t1.usage.input_tokens,
         'the output items (reasoning, function_call) and a function_call_output go back in as input', t3);
  try {
    await client.responses.retrieve(t3.id);
    report(false, 'store: false is not stored', 'retrieved');
  } catch (e) {
    report(e instanceof OpenAI.NotFoundError, 'store: false is not stored (retrieve: NotFoundError)', String(e));
  }

  // previous_response_id: the continuation's prompt is served from the prefix cache
  const c1 = await client.responses.create({ ...BASE, input: 'Tell me a long story about the river Seine and Paris.' });
  const c2 = await client.responses.create({ ...BASE, input: 'And about Rome?', previous_response_id: c1.id });
  report(c2.usage.input_tokens_details.cached_tokens > 0 && c2.usage.input_tokens > c1.usage.input_tokens &&
         c2.previous_response_id === c1.id,
         `previous_response_id: the continuation reports cached tokens (${c2.usage.input_tokens_details.cached_tokens} of ${c2.usage.input_tokens})`,
         c2.usage);

  // retrieve and delete
  const got = await client.responses.retrieve(c1.id);
  report(JSON.stringify(got) === JSON.stringify({ ...c1, output_text: undefined }) ||
         (got.id === c1.id && got.output[0].content[0].text === c1.output_text && got.usage.output_tokens === 8),
         'responses.retrieve: the stored response', got);
  const del = await client.responses.delete(r1.id);
  let goneOk = false;
  try { await client.responses.retrieve(r1.id); } catch (e) { goneOk = e instanceof OpenAI.NotFoundError; }
  report(goneOk, 'responses.delete: then retrieve raises NotFoundError', del);
  try {
    await client.responses.create({ ...BASE, input: 'x', previous_response_id: r1.id });
    report(false, 'a deleted previous_response_id is refused', 'accepted');
  } catch (e) {
    report(e instanceof OpenAI.NotFoundError && e.param === 'previous_response_id',
           'a deleted previous_response_id: NotFoundError naming previous_response_id', { status: e.status, param: e.param });
  }

  // errors
  try {
    await client.responses.create({ ...BASE, input: 'x', frobnicate: true });
    report(false, 'an unknown field raises BadRequestError', 'accepted');
  } catch (e) {
    report(e instanceof OpenAI.BadRequestError && e.param === 'frobnicate' && e.code === 'unknown_field',
           'an unknown field: BadRequestError naming it', { status: e.status, param: e.param, code: e.code });
  }
  try {
    await client.responses.create({ ...BASE, input: [{ role: 'user', content: [{ type: 'input_text' }] }] });
    report(false, 'a part without text raises BadRequestError', 'accepted');
  } catch (e) {
    report(e instanceof OpenAI.BadRequestError && e.param === 'input[0].content[0].text',
           'a part without text: BadRequestError naming input[0].content[0].text', { status: e.status, param: e.param });
  }
  fs.writeFileSync(stateFile, JSON.stringify({ id: c2.id, input_tokens: c2.usage.input_tokens }));
}

async function restarted() {
  const st = JSON.parse(fs.readFileSync(stateFile, 'utf8'));
  const got = await client.responses.retrieve(st.id);
  report(got.id === st.id, 'after a restart: the stored response is still there', got);
  const c3 = await client.responses.create({ ...BASE, input: 'And about Madrid?', previous_response_id: st.id });
  report(c3.usage.input_tokens_details.cached_tokens > 0 && c3.usage.input_tokens > st.input_tokens,
         `after a restart: a previous_response_id continuation reports cached tokens (${c3.usage.input_tokens_details.cached_tokens} of ${c3.usage.input_tokens})`,
         c3.usage);
}

(phase === 'restarted' ? restarted() : first()).then(() => process.exit(0), (e) => {
  report(false, 'the SDK run finished without an exception', String(e && e.stack || e));
  process.exit(0);
});
