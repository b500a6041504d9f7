// The official Anthropic TypeScript SDK (@anthropic-ai/sdk, pinned by the test) against ds41d's
// /v1/messages over its Unix socket, through an undici@6 Agent with connect.socketPath.  Prints one
// JSON object per case: {"ok": bool, "what": ..., "detail": ...}.
// usage: node anthropic_sdk_check.js NODE_MODULES_DIR SOCKET_PATH
'use strict';
const path = require('path');
const [modules, socketPath] = process.argv.slice(2);
const sdk = require(path.join(modules, '@anthropic-ai/sdk'));
const Anthropic = sdk.default || sdk.Anthropic || sdk;
const undici = require(path.join(modules, 'undici'));
const dispatcher = new undici.Agent({ connect: { socketPath } });

const client = new Anthropic({
  baseURL: 'http://ds41',
  apiKey: 'unused',
  maxRetries: 0,
  fetch: undici.fetch,
  fetchOptions: { dispatcher },
});

function report(ok, what, detail) {
  console.log(JSON.stringify({ ok: !!ok, what, detail: ok ? '' : JSON.stringify(detail).slice(0, 600) }));
}

const TOOLS = [{
  name: 'get_weather', description: 'Weather of a city',
  input_schema: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
}];
const FORCED_TOOL =
  'The user wants the weather.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n' +
  '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n' +
  '</｜DSML｜ calls><｜end▁of▁sentence｜>';

// The raw SSE text of a streamed request: each message must have an event: and a data: line
// whose JSON type is the event name.
async function rawEvents(body) {
  const res = await undici.fetch('http://ds41/v1/messages', {
    method: 'POST', dispatcher, headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
  });
  const text = await res.text();
  const events = [];
  let wellFormed = res.headers.get('content-type').startsWith('text/event-stream');
  for (const chunk of text.split('\n\n')) {
    if (!chunk) continue;
    const lines = chunk.split('\n');
    const ev = lines.find((l) => l.startsWith('event: '));
    const data = lines.find((l) => l.startsWith('data: '));
    if (!ev || !data || lines.length !== 2) { wellFormed = false; continue; }
    const obj = JSON.parse(data.slice(6));
    if (obj.type !== ev.slice(7)) wellFormed = false;
    events.push(obj);
  }
  return { events, wellFormed };
}

function textOf(msg) {
  return msg.content.filter((b) => b.type === 'text').map((b) => b.text).join('');
}

async function main() {
  const base = { model: 'ds41-tiny', max_tokens: 10, temperature: 0, thinking: { type: 'disabled' },
                 messages: [{ role: 'user', content: 'Tell me about Paris.' }] };
  const m1 = await client.messages.create(base);
  report(/^msg_/.test(m1.id) && m1.type === 'message' && m1.role === 'assistant' && m1.model === 'ds41-tiny' &&
         m1.content.length === 1 && m1.content[0].type === 'text' && m1.content[0].text.length > 0 &&
         m1.stop_reason === 'max_tokens' && m1.stop_sequence === null && m1.usage.output_tokens === 10 &&
         m1.usage.input_tokens > 0 && typeof m1.usage.cache_read_input_tokens === 'number' &&
         m1.usage.cache_creation_input_tokens === 0,
         'messages.create: one text block, stop_reason max_tokens, usage', m1);

  // streamed: the SDK's raw event stream, the exact sequence, and the same text as not streamed
  const stream = await client.messages.create({ ...base, stream: true });
  const types = [];
  let streamed = '', delta = null, startMsg = null;
  for await (const ev of stream) {
    types.push(ev.type === 'content_block_delta' ? ev.type + ':' + ev.delta.type : ev.type);
    if (ev.type === 'message_start') startMsg = ev.message;
    if (ev.type === 'content_block_delta' && ev.delta.type === 'text_delta') streamed += ev.delta.text;
    if (ev.type === 'message_delta') delta = ev;
  }
  const seq = types.filter((t, i) => !(t === 'content_block_delta:text_delta' && types[i - 1] === t));
  // (the SDK's iterator drops ping events; the raw stream below has them)
  report(JSON.stringify(seq) === JSON.stringify(['message_start', 'content_block_start',
                                                  'content_block_delta:text_delta', 'content_block_stop',
                                                  'message_delta', 'message_stop']) &&
         startMsg && startMsg.content.length === 0 && startMsg.stop_reason === null && startMsg.usage.input_tokens > 0,
         'stream: message_start (empty content), ping, content_block_start/delta/stop, message_delta, message_stop',
         { types, startMsg });
  report(streamed === textOf(m1) && delta && delta.delta.stop_reason === 'max_tokens' &&
         delta.delta.stop_sequence === null && delta.usage.output_tokens === 10,
         'stream: the accumulated text_delta equals the non-streamed text (temperature 0), message_delta usage',
         { streamed, m1: textOf(m1), delta });
  const raw = await rawEvents({ ...base, stream: true });
  report(raw.wellFormed && raw.events.length >= 7 && raw.events[0].type === 'message_start' &&
         raw.events[1].type === 'ping' && raw.events[raw.events.length - 1].type === 'message_stop',
         'stream: every SSE message has an event: and a data: line naming the same type; a ping follows message_start',
         raw.events.slice(0, 3));

  const m2 = await client.messages.create(base);
  report(textOf(m2) === textOf(m1) && m2.usage.cache_read_input_tokens > 0 &&
         m2.usage.input_tokens + m2.usage.cache_read_input_tokens === m1.usage.input_tokens + m1.usage.cache_read_input_tokens,
         'the same prompt again: cache_read_input_tokens > 0 from the prefix cache, the same answer', { u1: m1.usage, u2: m2.usage });

  const ct = await client.messages.countTokens({ model: 'ds41-tiny', thinking: { type: 'disabled' }, messages: base.messages });
  report(ct.input_tokens === m1.usage.input_tokens + m1.usage.cache_read_input_tokens,
         'messages.countTokens: input_tokens equals the prompt the message used', { ct, usage: m1.usage });

  // tool use forced by tool_choice (random model, grammar-constrained), then the tool_result round trip
  const ask = { role: 'user', content: 'Weather in Paris?' };
  const t1 = await client.messages.create({ model: 'ds41-tiny', max_tokens: 200, temperature: 1, tools: TOOLS,
                                            tool_choice: { type: 'tool', name: 'get_weather' },
                                            thinking: { type: 'disabled' }, messages: [ask] });
  const use = t1.content.find((b) => b.type === 'tool_use');
  report(t1.stop_reason === 'tool_use' && use && /^toolu_/.test(use.id) && use.name === 'get_weather' &&
         use.input && typeof use.input === 'object' && !Array.isArray(use.input) && !('_raw' in use.input),
         'tool_choice {type: tool}: a tool_use block with parsed input, stop_reason tool_use', t1);
  const t2 = await client.messages.create({
    model: 'ds41-tiny', max_tokens: 8, temperature: 0, tools: TOOLS, thinking: { type: 'disabled' },
    messages: [ask, { role: 'assistant', content: t1.content },
               { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: '18 C, sunny' }] }],
  });
  report(t2.type === 'message' && t2.content.length >= 1 && ['max_tokens', 'end_turn', 'tool_use'].includes(t2.stop_reason) &&
         t2.usage.input_tokens + t2.usage.cache_read_input_tokens > t1.usage.input_tokens + t1.usage.cache_read_input_tokens,
         'tool_result round trip: the reply to the tool result', t2);

  // thinking enabled: a thinking block, then the tool_use (forced output gives the exact text)
  const forced = { model: 'ds41-tiny', max_tokens: 2000, tools: TOOLS, messages: [ask],
                   thinking: { type: 'enabled', budget_tokens: 1024 }, ds41_forced_output: FORCED_TOOL };
  const f1 = await client.messages.create(forced);
  report(f1.content.length === 2 && f1.content[0].type === 'thinking' &&
         f1.content[0].thinking === 'The user wants the weather.' && f1.content[0].signature === '' &&
         f1.content[1].type === 'tool_use' && JSON.stringify(f1.content[1].input) === '{"city":"Paris"}' &&
         f1.stop_reason === 'tool_use',
         'thinking enabled: a thinking block before the tool_use block, exact text and input', f1);
  const fs = client.messages.stream(forced);
  const ftypes = [];
  fs.on('streamEvent', (ev) => { if (ev.type === 'content_block_delta') ftypes.push(ev.delta.type); });
  const f2 = await fs.finalMessage();
  const noId = (c) => JSON.stringify(c.map((b) => ({ ...b, id: b.id && /^toolu_/.test(b.id) })));
  report(noId(f2.content) === noId(f1.content) && f2.stop_reason === 'tool_use' &&
         ftypes.includes('thinking_delta') && ftypes.includes('signature_delta') && ftypes.includes('input_json_delta') &&
         ftypes.indexOf('thinking_delta') < ftypes.indexOf('input_json_delta'),
         'thinking + tool_use streamed (messages.stream): thinking_delta, signature_delta, input_json_delta; finalMessage equals',
         { f2: f2.content, ftypes });

  const think = await client.messages.create({
    model: 'ds41-tiny', max_tokens: 2000, thinking: { type: 'enabled', budget_tokens: 1024 },
    messages: [{ role: 'user', content: 'Hi' }],
    ds41_forced_output: 'Greet back.</think>Hello there.<｜end▁of▁sentence｜>' });
  report(think.content.map((b) => b.type).join(',') === 'thinking,text' && think.content[0].thinking === 'Greet back.' &&
         think.content[1].text === 'Hello there.' && think.stop_reason === 'end_turn',
         'thinking enabled: thinking block, then text, stop_reason end_turn', think);

  const st = await client.messages.create({
    ...base, max_tokens: 50, stop_sequences: ['never', 'world'],
    ds41_forced_output: 'Hello world and more.<｜end▁of▁sentence｜>' });
  report(textOf(st) === 'Hello ' && st.stop_reason === 'stop_sequence' && st.stop_sequence === 'world',
         'stop_sequences: stop_reason stop_sequence naming the one that matched', st);

  try {
    await client.messages.create({ ...base, frobnicate: 1 });
    report(false, 'unknown field: 400 invalid_request_error', 'no error');
  } catch (e) {
    report(e instanceof Anthropic.BadRequestError && e.status === 400 && e.error && e.error.type === 'error' &&
           e.error.error.type === 'invalid_request_error' && /frobnicate/.test(e.error.error.message),
           'unknown field: 400 invalid_request_error (the SDK BadRequestError) naming the field', { status: e.status, error: e.error });
  }
  try {
    const { max_tokens, ...noMax } = base; // eslint-disable-line no-unused-vars
    await client.messages.create(noMax);
    report(false, 'missing max_tokens: 400', 'no error');
  } catch (e) {
    report(e.status === 400 && /max_tokens/.test(e.error.error.message), 'missing max_tokens: 400 naming it', e.error);
  }
}

main().catch((e) => { report(false, 'the script ran to the end', String(e && e.stack || e)); process.exitCode = 1; });
