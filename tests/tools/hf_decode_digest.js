// Digest of Hugging Face tokenizers' single-id decode over a whole vocabulary:
// for every id 0..n-1, text = decode([id], skip_special_tokens=false), hashed
// as UTF-8 followed by one 0xFF byte (which never occurs in UTF-8, so the
// concatenation is unambiguous).  Prints JSON with the count of ids whose text
// contains U+FFFD, the total UTF-8 length, FNV-1a 64 and SHA-256.
//
// usage: node hf_decode_digest.js tokenizer.json
// needs: npm install @anush008/tokenizers   (HF tokenizers' Rust code via N-API)
// Used once to produce tests/data/tokenizer-v41/decode_digest.json; the C test
// recomputes the FNV-1a 64 with ds41_vocab_decode_id_lossy.
const { Tokenizer } = require('@anush008/tokenizers');
const crypto = require('crypto');

(async () => {
  const tok = Tokenizer.fromFile(process.argv[2]);
  const n = tok.getVocabSize(true);
  const batch = [];
  for (let i = 0; i < n; i++) batch.push([i]);
  const texts = await tok.decodeBatch(batch, false);
  const sha = crypto.createHash('sha256');
  const prime = 0x100000001b3n, mask = (1n << 64n) - 1n;
  let fnv = 0xcbf29ce484222325n, withReplacement = 0, totalBytes = 0;
  const eat = (byte) => { fnv = ((fnv ^ BigInt(byte)) * prime) & mask; };
  for (let i = 0; i < n; i++) {
    const bytes = Buffer.from(texts[i], 'utf8');
    if (texts[i].includes('\ufffd')) withReplacement++;
    totalBytes += bytes.length;
    sha.update(bytes);
    sha.update(Buffer.from([0xff]));
    for (const b of bytes) eat(b);
    eat(0xff);
  }
  console.log(JSON.stringify({
    ids: n,
    ids_with_replacement_char: withReplacement,
    total_utf8_bytes: totalBytes,
    fnv1a64: '0x' + fnv.toString(16).padStart(16, '0'),
    sha256: sha.digest('hex'),
  }, null, 2));
})();
