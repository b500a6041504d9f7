// Id-for-id parity of ds41-tokenize with Hugging Face's Rust tokenizers
// (@anush008/tokenizers@0.6.0, tokenizers 0.22 through N-API), printing TAP:
// one case per (tokenizer, category), showing the first mismatch.
//
// usage: node tokenizer_parity.js --hf MODULE_DIR --tool DS41_TOKENIZE
//            [--real TOKENIZER_JSON] --synth TOKENIZER_JSON --work DIR
//
// Strings come from a seeded generator (same strings every run) in the
// categories ascii, code, cjk, emoji, combining, whitespace, digits, special
// (added-token text, whole, cut, glued together), mixed and random (any
// scalar value, assigned or not), plus, for the real tokenizer, every Unicode
// scalar value in blocks of 1,000.  Decoding is compared on random id
// sequences (special ids, byte tokens that cut UTF-8 sequences, unknown ids)
// with and without skip_special, and on the encodings (round trip).
// Variants of the synthetic tokenizer exercise what the real file does not
// use: added-token flags, add_prefix_space, use_regex, every Split behavior
// and invert, ignore_merges, and the Oniguruma regex constructs ds41
// translates (\w \d \s \h \b, properties, (?i), (?m), {,n}, anchors, \u).
'use strict';
const fs = require('fs');
const path = require('path');
const { execFileSync } = require('child_process');

const args = {};
for (let i = 2; i < process.argv.length; i += 2) args[process.argv[i].replace(/^--/, '')] = process.argv[i + 1];
const { Tokenizer } = require(args.hf);

let tapN = 0, failed = 0;
const ok = (good, what, detail) => {
  tapN++;
  console.log(`${good ? '' : 'not '}ok ${tapN} - ${what}`);
  if (!good) { failed++; for (const l of String(detail).split('\n')) console.log('# ' + l); }
};

// ---- seeded generator (xorshift128+ on BigInt-free 32-bit halves) ---------
function rng(seed) {
  let a = seed >>> 0 || 1, b = 0x9e3779b9, c = 0x7f4a7c15, d = 0x6a09e667;
  const next = () => {
    const t = b << 9;
    let r = a * 5; r = ((r << 7) | (r >>> 25)) * 9;
    c ^= a; d ^= b; b ^= c; a ^= d; c ^= t; d = (d << 11) | (d >>> 21);
    return (r >>> 0) / 4294967296;
  };
  for (let i = 0; i < 16; i++) next();
  const int = (n) => Math.floor(next() * n);
  const pick = (xs) => xs[int(xs.length)];
  return { next, int, pick };
}
const cp = (c) => String.fromCodePoint(c);
const range = (R, a, b) => cp(a + R.int(b - a + 1));

const WORDS = ['the', 'quick', 'brown', 'fox', 'jumps', 'over', 'lazy', 'dog', 'Hello', 'world', 'tokenizer',
  'DeepSeek', 'model', 'I', "don't", "it's", "we'll", 'naïve', 'café', 'Zürich', 'ÉTÉ', 'Ångström',
  'Straße', 'résumé', 'HTTP', 'JSON', 'x', 'a', 'of', 'and', 'to', 'in', 'is', 'you', 'that'];
const PUNCT = ['.', ',', '!', '?', ';', ':', '...', '--', '"', "'", '(', ')', '[', ']', '{', '}', '<', '>', '/',
  '\\', '@', '#', '$', '%', '^', '&', '*', '+', '=', '~', '`', '|', '-', '_', '…', '“', '”', '«', '»', '¿', '¡'];
const CODE = ['def f(x):\n    return x**2 + 1\n', 'for (int i = 0; i < n; i++) {\n\ta[i] += b[i];\n}\n',
  'const y = await fetch(`/api/${id}`);', 'if x != None and y >= 3:\n        pass', '#include <stdio.h>\n',
  'SELECT * FROM t WHERE a = \'b\';', 'fn main() -> Result<(), Box<dyn Error>> { Ok(()) }',
  '    // comment\n', '/* block */', 'x=>x*2', 'arr[::-1]', '{"key": [1, 2.5e-3, null, true]}',
  '<div class="a">&amp;</div>', '$ ls -la | grep .c', '0x1F | 0b1010 ^ 0o17', 'a_b_c = __init__'];

const gens = {
  ascii: (R) => {
    let s = ''; const n = 1 + R.int(20);
    for (let i = 0; i < n; i++) {
      const k = R.int(10);
      if (k < 6) s += (R.int(3) ? ' ' : '') + R.pick(WORDS);
      else if (k < 8) s += R.pick(PUNCT);
      else if (k < 9) s += range(R, 0x20, 0x7e);
      else s += R.pick([' ', '  ', '\n', '\t', '\r\n']);
    }
    return s;
  },
  code: (R) => {
    let s = ''; const n = 1 + R.int(6);
    for (let i = 0; i < n; i++) s += R.pick(CODE) + (R.int(3) ? '' : R.pick(['\n', '    ', '\t', '  \n']));
    return s;
  },
  cjk: (R) => {
    let s = ''; const n = 1 + R.int(25);
    for (let i = 0; i < n; i++) {
      const k = R.int(12);
      if (k < 4) s += range(R, 0x4e00, 0x9fa5);
      else if (k < 5) s += range(R, 0x9fa6, 0x9fff);
      else if (k < 6) s += range(R, 0x3041, 0x309f);
      else if (k < 7) s += range(R, 0x30a0, 0x30ff);
      else if (k < 8) s += range(R, 0xac00, 0xd7a3);
      else if (k < 9) s += R.pick(['，', '。', '、', '！', '？', '：', '；', '「', '」', '（', '）', '·', '～', '　']);
      else if (k < 10) s += range(R, 0x20000, 0x2a6df);
      else if (k < 11) s += R.pick(WORDS) + (R.int(2) ? ' ' : '');
      else s += String(R.int(3000));
    }
    return s;
  },
  emoji: (R) => {
    const E = ['😀', '🤖', '🚀', '🌍', '👍🏽', '👨‍👩‍👧‍👦', '🏳️‍🌈', '🇯🇵', '🇺🇸', '❤️', '✨', '🔥', '⚙️', '#️⃣', '©️', '🫠', '🧑🏿‍💻'];
    let s = ''; const n = 1 + R.int(12);
    for (let i = 0; i < n; i++) {
      const k = R.int(6);
      if (k < 3) s += R.pick(E);
      else if (k < 4) s += range(R, 0x1f300, 0x1faff);
      else if (k < 5) s += ' ' + R.pick(WORDS);
      else s += R.pick([' ', '', '\n', '!', '\u200d', '\ufe0f']);
    }
    return s;
  },
  combining: (R) => {
    let s = ''; const n = 1 + R.int(15);
    for (let i = 0; i < n; i++) {
      const k = R.int(9);
      if (k < 3) { s += range(R, 0x61, 0x7a); const m = R.int(4); for (let j = 0; j < m; j++) s += range(R, 0x300, 0x36f); }
      else if (k < 4) s += range(R, 0x900, 0x97f);
      else if (k < 5) s += range(R, 0xe00, 0xe5b);
      else if (k < 6) s += range(R, 0x600, 0x6ff);
      else if (k < 7) s += range(R, 0x591, 0x5f4);
      else if (k < 8) s += R.pick([' ', '\u0301', '\u20dd', '\u0489', ' \u0308']);
      else s += R.pick(WORDS).normalize(R.int(2) ? 'NFD' : 'NFC');
    }
    return s;
  },
  whitespace: (R) => {
    const W = [' ', '\t', '\n', '\r', '\r\n', '\u00a0', '\u3000', '\u2028', '\u2029', '\u0085', '\u000b', '\u000c',
      '\u2003', '\u202f', '\u205f', '\u1680', '\u180e', '\u200b', '\ufeff'];
    let s = ''; const n = 1 + R.int(12);
    for (let i = 0; i < n; i++) {
      const k = R.int(4);
      if (k < 2) { const m = 1 + R.int(8); for (let j = 0; j < m; j++) s += R.pick(W); }
      else if (k < 3) s += R.pick(WORDS);
      else s += R.pick(PUNCT);
    }
    return s;
  },
  digits: (R) => {
    let s = ''; const n = 1 + R.int(10);
    for (let i = 0; i < n; i++) {
      const k = R.int(8);
      if (k < 3) s += String(R.int(10) < 5 ? R.int(100000) : Math.floor(R.next() * 1e15));
      else if (k < 4) s += (R.next() * 1000).toFixed(R.int(5));
      else if (k < 5) s += range(R, 0x660, 0x669) + range(R, 0x966, 0x96f) + range(R, 0xff10, 0xff19);
      else if (k < 6) s += R.pick(['²', '³', '¹', '¼', '½', '¾', 'Ⅻ', '①', '⑩', '〇', '万', '٫']);
      else if (k < 7) s += R.pick([' ', ',', '.', '-', '+', 'e', '%', '$', ':', '/']);
      else s += R.pick(WORDS);
    }
    return s;
  },
  mixed: null, special: null, random: null,
};
gens.mixed = (R) => {
  let s = ''; const n = 1 + R.int(5);
  const ks = ['ascii', 'code', 'cjk', 'emoji', 'combining', 'whitespace', 'digits'];
  for (let i = 0; i < n; i++) s += gens[R.pick(ks)](R);
  return s;
};
gens.random = (R) => {
  let s = ''; const n = 1 + R.int(16);
  for (let i = 0; i < n; i++) {
    const k = R.int(5);
    let c;
    if (k < 2) c = R.int(0x3000);
    else if (k < 3) c = R.int(0x10000);
    else if (k < 4) c = 0x10000 + R.int(0x30000);
    else c = R.int(0x110000);
    if (c >= 0xd800 && c <= 0xdfff) c = 0xfffd;
    s += cp(c);
  }
  return s;
};
const makeSpecial = (added) => (R) => {
  let s = ''; const n = 1 + R.int(8);
  for (let i = 0; i < n; i++) {
    const k = R.int(8);
    const t = R.pick(added);
    if (k < 4) s += t;
    else if (k < 5) s += t.slice(0, Math.max(1, R.int(t.length)));
    else if (k < 6) s += t.slice(R.int(t.length));
    else if (k < 7) s += R.pick(WORDS) + R.pick(['', ' ', '\n']);
    else s += R.pick([' ', '  ', '\n', '<', '>', '｜', '▁', '<|', '|>', 'x', 'é']);
  }
  return s;
};

function strings(seed, per, added) {
  const out = [];
  const R = rng(seed);
  const cats = Object.keys(gens);
  for (const cat of cats) {
    const g = cat === 'special' ? makeSpecial(added) : gens[cat];
    const list = [];
    for (let i = 0; i < per; i++) list.push(g(R));
    out.push([cat, list]);
  }
  return out;
}

// ---- running both sides --------------------------------------------------
function ds41(tokJson, lines, extra) {
  const input = lines.map((l) => JSON.stringify(l)).join('\n') + '\n';
  let out;
  try {
    out = execFileSync(args.tool, [tokJson, ...extra], { input, maxBuffer: 1 << 30, stdio: ['pipe', 'pipe', 'pipe'] });
  } catch (e) {
    out = e.stdout || Buffer.from('');
    const err = String(e.stderr || e.message).split('\n').slice(0, 3).join(' | ');
    console.log(`# ds41-tokenize exited ${e.status}: ${err}`);
  }
  return out.toString('utf8').split('\n').slice(0, lines.length).map((l) => (l ? JSON.parse(l) : undefined));
}

const show = (s) => { const j = String(JSON.stringify(s)); return j.length > 160 ? j.slice(0, 160) + '…' : j; };
const firstDiff = (a, b) => { let i = 0; while (i < a.length && i < b.length && a[i] === b[i]) i++; return i; };

async function compareEncode(name, tokJson, hf, cat, list) {
  const mine = ds41(tokJson, list, []);
  const encs = await hf.encodeBatch(list, { addSpecialTokens: false });
  const theirs = encs.map((e) => Array.from(e.getIds()));
  let bad = -1;
  for (let i = 0; i < list.length && bad < 0; i++)
    if (!mine[i] || mine[i].length !== theirs[i].length || firstDiff(mine[i], theirs[i]) !== theirs[i].length) bad = i;
  let detail = '';
  if (bad >= 0) {
    const m = mine[bad] || [], t = theirs[bad], d = firstDiff(m, t);
    detail = `text ${show(list[bad])}\nfirst difference at id ${d}: ds41 ${JSON.stringify(m.slice(d, d + 8))} HF ${JSON.stringify(t.slice(d, d + 8))}` +
      `\nHF tokens ${JSON.stringify(encs[bad].getTokens().slice(Math.max(0, d - 2), d + 6))}`;
  }
  ok(bad < 0, `${name}: encode ${cat} (${list.length} strings) id for id`, detail);
  return theirs;
}

async function compareDecode(name, tokJson, hf, what, seqs) {
  for (const skip of [false, true]) {
    const mine = ds41(tokJson, seqs, skip ? ['--decode', '--skip-special'] : ['--decode']);
    const theirs = await hf.decodeBatch(seqs, skip);
    let bad = -1;
    for (let i = 0; i < seqs.length && bad < 0; i++) if (mine[i] !== theirs[i]) bad = i;
    ok(bad < 0, `${name}: decode ${what}${skip ? ', skip_special' : ''} (${seqs.length} sequences)`,
      bad < 0 ? '' : `ids ${show(seqs[bad])}\nds41 ${show(mine[bad])}\nHF   ${show(theirs[bad])}`);
  }
}

function randomIdSeqs(seed, n, vocabSize, specials, byteIds) {
  const R = rng(seed);
  const out = [];
  for (let i = 0; i < n; i++) {
    const len = R.int(40);
    const s = [];
    for (let j = 0; j < len; j++) {
      const k = R.int(10);
      if (k < 5) s.push(R.int(vocabSize));
      else if (k < 7) s.push(R.pick(specials));
      else if (k < 9) s.push(R.pick(byteIds));
      else s.push(vocabSize + R.int(1000)); // ids HF cannot name: skipped
    }
    out.push(s);
  }
  return out;
}

async function runTokenizer(name, tokJson, seed, per, opts = {}) {
  const json = JSON.parse(fs.readFileSync(tokJson, 'utf8'));
  const hf = Tokenizer.fromFile(tokJson);
  const added = json.added_tokens.map((t) => t.content);
  let total = 0;
  const allEnc = [];
  for (const [cat, list] of strings(seed, per, added)) {
    const enc = await compareEncode(name, tokJson, hf, cat, list);
    total += list.length;
    allEnc.push(...enc.filter((_, i) => i % 7 === 0));
  }
  if (opts.everyCodePoint) {
    const blocks = [];
    let cur = '';
    let n = 0;
    for (let c = 0; c < 0x110000; c++) {
      if (c >= 0xd800 && c <= 0xdfff) continue;
      cur += cp(c);
      if (++n % 1000 === 0) { blocks.push(cur); cur = ''; }
    }
    if (cur) blocks.push(cur);
    await compareEncode(name, tokJson, hf, 'every scalar value U+0000..U+10FFFF in blocks of 1000', blocks);
    total += blocks.length;
  }
  const vocabSize = hf.getVocabSize(true);
  const specials = json.added_tokens.map((t) => t.id);
  const byteIds = [];
  for (let b = 0; b < 256; b++) {
    const ch = byteChar(b);
    const id = json.model.vocab[ch];
    if (id !== undefined) byteIds.push(id);
  }
  await compareDecode(name, tokJson, hf, 'random ids', randomIdSeqs(seed + 1, opts.decodeSeqs || 1000, vocabSize, specials, byteIds));
  await compareDecode(name, tokJson, hf, 'of encoded strings', allEnc);
  return total;
}

function byteChar(b) {
  const printable = (x) => (x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || (x >= 0xae && x <= 0xff);
  if (printable(b)) return cp(b);
  let n = 0;
  for (let x = 0; x < b; x++) if (!printable(x)) n++;
  return cp(0x100 + n);
}

// ---- synthetic variants -----------------------------------------------------
function variant(base, mutate) {
  const d = JSON.parse(JSON.stringify(base));
  mutate(d);
  return d;
}

function addTokens(d, list) {
  // ids as Hugging Face assigns them: the next after max(len(vocab), largest added id)
  let next = Math.max(Object.keys(d.model.vocab).length, ...d.added_tokens.map((t) => t.id + 1));
  for (const [content, flags] of list) {
    if (d.model.vocab[content] !== undefined) throw new Error(`variant token ${content} is in model.vocab`);
    d.added_tokens.push(Object.assign({ id: next++, content, single_word: false, lstrip: false, rstrip: false,
      normalized: false, special: false }, flags));
  }
}

const SPLIT = (re, behavior = 'Isolated', invert = false, literal = false) =>
  ({ type: 'Split', pattern: literal ? { String: re } : { Regex: re }, behavior, invert });
const BYTE_LEVEL = (aps = false, ur = false) => ({ type: 'ByteLevel', add_prefix_space: aps, trim_offsets: true, use_regex: ur });

(async () => {
  let total = 0;
  const synthBase = JSON.parse(fs.readFileSync(args.synth, 'utf8'));
  const variants = [
    ['synthetic 2000', synthBase],
    ['synthetic + added-token flags', variant(synthBase, (d) => addTokens(d, [
      ['zqxw', { single_word: true }], ['qzq', { lstrip: true }], ['kxk', { rstrip: true }],
      ['⟦lr⟧', { lstrip: true, rstrip: true }], ['⟦sw⟧', { single_word: true, lstrip: true, rstrip: true }],
      [' jvj', { normalized: true }], ['wvw', { normalized: true, special: true, rstrip: true }],
      ['<|x|>', { special: true }], ['<|x|><|y|>', { special: true }], ['<|', { normalized: true }],
      ['\n\n⟦nl⟧', {}], ['qzqzq', { single_word: true, normalized: true }]]))],
    ['synthetic + add_prefix_space + use_regex', variant(synthBase, (d) => {
      d.pre_tokenizer.pretokenizers[3] = BYTE_LEVEL(true, true);
    })],
    ['synthetic + ByteLevel alone (GPT-2 regex)', variant(synthBase, (d) => { d.pre_tokenizer = BYTE_LEVEL(false, true); })],
    ['synthetic + Split behaviors and invert', variant(synthBase, (d) => {
      d.pre_tokenizer.pretokenizers = [SPLIT('\\p{N}{1,3}', 'MergedWithNext'), SPLIT(' ', 'MergedWithPrevious', false, true),
        SPLIT('\\s+', 'Contiguous', true), SPLIT('[\\p{P}\\p{S}]', 'Removed'), SPLIT('[aeiou]', 'MergedWithNext', true),
        SPLIT('[一-龥]+', 'Isolated', true), SPLIT('x*', 'Isolated'), BYTE_LEVEL(true, false)];
    })],
    ['synthetic + ignore_merges', variant(synthBase, (d) => { d.model.ignore_merges = true; })],
    ['synthetic + Oniguruma constructs', variant(synthBase, (d) => {
      d.pre_tokenizer.pretokenizers = [SPLIT('\\b\\w{1,4}\\b|\\W\\B'), SPLIT('(?i)TH|[\\d\\h]{2,}|\\s(?=\\S)|^.|.$'),
        SPLIT('\\p{Lu}\\P{Lu}{,2}|[^\\p{L}\\s]|\\p{^L}\\u00e9|\\x{3042}+|(?m:a.b)'), SPLIT('[\\w]|[^\\S\\D]{2}', 'Removed', true),
        BYTE_LEVEL(false, false)];
    })],
  ];
  fs.mkdirSync(args.work, { recursive: true });
  let seed = 100;
  for (const [name, d] of variants) {
    const p = path.join(args.work, name.replace(/[^a-z0-9]+/gi, '_') + '.json');
    fs.writeFileSync(p, JSON.stringify(d));
    total += await runTokenizer(name, p, seed++, name === 'synthetic 2000' ? 300 : 150,
      { everyCodePoint: name.includes('Oniguruma'), decodeSeqs: 300 });
  }
  if (args.real) total += await runTokenizer('real V4.1', args.real, 1, 1100, { everyCodePoint: true, decodeSeqs: 2000 });
  console.log(`# ${total} strings encoded by both`);
  ok(!args.real || total >= 10000, `at least 10,000 strings compared (${total})`, 'too few strings');
  console.log(`1..${tapN}`);
  process.exit(failed ? 1 : 0);
})().catch((e) => { console.log(`not ok ${tapN + 1} - parity script crashed: ${e.stack}`); console.log(`1..${tapN + 1}`); process.exit(1); });
