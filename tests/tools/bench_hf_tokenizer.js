// Hugging Face tokenizers' (Rust, via @anush008/tokenizers) encode/decode
// throughput on a text file, printed like tests/bench_tokenizer.c.
// usage: node bench_hf_tokenizer.js MODULE_DIR TOKENIZER_JSON TEXT_FILE
'use strict';
const fs = require('fs');
const { Tokenizer } = require(process.argv[2]);
(async () => {
  const tok = Tokenizer.fromFile(process.argv[3]);
  const text = fs.readFileSync(process.argv[4], 'utf8');
  const bytes = Buffer.byteLength(text);
  let bestEnc = 1e9, bestDec = 1e9, ids;
  for (let r = 0; r < 3; r++) {
    let t0 = process.hrtime.bigint();
    const enc = await tok.encode(text, null, { addSpecialTokens: false });
    ids = enc.getIds();
    bestEnc = Math.min(bestEnc, Number(process.hrtime.bigint() - t0) / 1e9);
    t0 = process.hrtime.bigint();
    await tok.decode(Array.from(ids), false);
    bestDec = Math.min(bestDec, Number(process.hrtime.bigint() - t0) / 1e9);
  }
  console.log(`HF   encode: ${(bytes / 1e6 / bestEnc).toFixed(2)} MB/s (${bestEnc.toFixed(3)} s), ${ids.length} ids`);
  console.log(`HF   decode: ${(bytes / 1e6 / bestDec).toFixed(2)} MB/s (${bestDec.toFixed(3)} s)`);
})();
