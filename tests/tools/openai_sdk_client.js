// The official OpenAI Node SDK (openai@6) pointed at ds41d's Unix socket through an undici@6
// Agent with connect.socketPath, and the one-line-per-case report the test scripts read.
// usage: const { OpenAI, client, report } = require('./openai_sdk_client.js')(NODE_MODULES_DIR, SOCKET_PATH);
'use strict';
const path = require('path');

module.exports = function connect(modules, socketPath) {
  const OpenAI = require(path.join(modules, 'openai')).default || require(path.join(modules, 'openai'));
  const undici = require(path.join(modules, 'undici'));
  const client = new OpenAI({
    baseURL: 'http://ds41/v1',
    apiKey: 'unused',
    maxRetries: 0,
    fetch: undici.fetch,
    fetchOptions: { dispatcher: new undici.Agent({ connect: { socketPath } }) },
  });
  // {"ok": bool, "what": ..., "detail": ...} on one line; detail only on failure
  function report(ok, what, detail) {
    console.log(JSON.stringify({ ok: !!ok, what, detail: ok ? '' : JSON.stringify(detail).slice(0, 600) }));
  }
  return { OpenAI, client, report };
};
