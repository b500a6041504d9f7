#!/usr/bin/env python3
"""Independent (stdlib-only) prototype of the Engram compressed token map, REFERENCE.md §6.1.

Reads a Hugging Face byte-level BPE tokenizer.json (the real DeepSeek-V4.1 one, see
tests/data/engram/README.md for how to rebuild it), decodes every id on its own the way
`tokenizers` does (`decode([id], skip_special_tokens=False)`: ByteLevel decoder, then
UTF-8 with replacement), normalises each text, and assigns compressed ids by first
appearance.  It exists as a cross-check for engine/model/engram_token_map.c; it shares no code
with it.

    engram_token_map.py TOKENIZER_JSON                 # prints count and sha256
    engram_token_map.py TOKENIZER_JSON --map OUT.json  # also writes the map
    engram_token_map.py TOKENIZER_JSON --texts OUT.json
        # writes [[text, raw_token_string], ...] for every id (input for
        # test_engram_layout via DS41_ENGRAM_TOKEN_TEXTS)
    engram_token_map.py --strings STRINGS.json [--out CASES.json]
        # [[s, normalize(s)], ...] for a JSON list of strings (how
        # tests/data/engram/normalize_cases.json was made from engram_normalize_strings.json)

Digest format (found empirically: the only tried serialisation that gives de40bcdd…5dc28 on
the released tokenizer): sha256 of the map written as Python `json.dumps(list_of_ints)` with
its default separators, i.e. ASCII "[0, 1, 2, ...]": decimal ids joined by ", " inside
brackets, no whitespace elsewhere, no trailing newline (the layout of struffl's
engram_token_map.json).  int32/int64 little-endian arrays, "," separators, a trailing
newline and one-id-per-line all give other digests.

Unicode tables come from Python's unicodedata; where its Unicode version differs from
utf8proc's or Rust's, results could in principle differ for code points assigned in
between, which the released vocabulary does not exercise (the digest matches).
"""
import argparse
import hashlib
import json
import re
import sys
import unicodedata

# Unicode White_Space (PropList.txt), what Rust's char::is_whitespace and the
# `Strip` normaliser of `tokenizers` use.  Python's str.strip() strips a wider set
# (it adds U+001C..U+001F), so it must not be used here.
WHITE_SPACE = frozenset(
    [chr(c) for c in range(0x09, 0x0E)] + ['\x20', '\x85', '\xa0', '\u1680']
    + [chr(c) for c in range(0x2000, 0x200B)]
    + ['\u2028', '\u2029', '\u202f', '\u205f', '\u3000'])
SENTINEL = '\ue000'
RUN_OF_SPACES = re.compile('[ \t\r\n]+')


def gpt2_byte_alphabet():
    """char -> byte of the GPT-2 byte-level alphabet."""
    printable = (list(range(ord('!'), ord('~') + 1)) + list(range(0xA1, 0xAD))
                 + list(range(0xAE, 0x100)))
    mapping = {}
    extra = 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


CHAR_TO_BYTE = gpt2_byte_alphabet()


def byte_level_decode(token):
    """Bytes of one token as the ByteLevel decoder yields them: every char through the
    byte alphabet, or the token's own UTF-8 when some char is not in it."""
    out = bytearray()
    for ch in token:
        b = CHAR_TO_BYTE.get(ch)
        if b is None:
            return token.encode('utf-8')
        out.append(b)
    return bytes(out)


def lowercase_per_char(s):
    # Full per-character mapping (Rust char::to_lowercase).  Lowercasing each character on
    # its own keeps Python's str.lower() from applying the contextual Final_Sigma rule.
    return ''.join(ch.lower() for ch in s)


def normalize(text):
    s = unicodedata.normalize('NFKC', text)
    s = unicodedata.normalize('NFD', s)
    s = ''.join(ch for ch in s if not unicodedata.category(ch).startswith('M'))
    s = lowercase_per_char(s)
    s = RUN_OF_SPACES.sub(' ', s)
    if s == ' ':
        s = SENTINEL
    i, j = 0, len(s)
    while i < j and s[i] in WHITE_SPACE:
        i += 1
    while j > i and s[j - 1] in WHITE_SPACE:
        j -= 1
    s = s[i:j]
    return s.replace(SENTINEL, ' ')


def key_for(text, raw):
    if '\ufffd' in text:
        return raw
    norm = normalize(text)
    return norm if norm else text


def token_texts(tokenizer_path):
    with open(tokenizer_path, encoding='utf-8') as f:
        tj = json.load(f)
    id_to_token = {}
    for tok, tid in tj['model']['vocab'].items():
        id_to_token[tid] = tok
    for added in tj['added_tokens']:
        id_to_token[added['id']] = added['content']   # added vocabulary wins
    n = max(id_to_token) + 1
    out = []
    for tid in range(n):
        raw = id_to_token[tid]
        text = byte_level_decode(raw).decode('utf-8', errors='replace')
        out.append((text, raw))
    return out


def build_map(texts):
    seen = {}
    mapping = []
    for text, raw in texts:
        key = key_for(text, raw)
        mapping.append(seen.setdefault(key, len(seen)))
    return mapping, len(seen)


def digest(mapping):
    return hashlib.sha256(json.dumps(mapping).encode('ascii')).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('tokenizer', nargs='?')
    ap.add_argument('--map', help='write the map as a JSON list')
    ap.add_argument('--texts', help='write [[text, raw], ...] for every id as JSON')
    ap.add_argument('--strings', help='normalise each string of a JSON list: [[s, normalize(s)], ...]')
    ap.add_argument('--out', help='with --strings: write the cases here instead of stdout')
    a = ap.parse_args()
    if a.strings:
        with open(a.strings, encoding='utf-8') as f:
            cases = [[s, normalize(s)] for s in json.load(f)]
        text = '[\n' + ',\n'.join(json.dumps(c, ensure_ascii=True) for c in cases) + '\n]\n'
        if a.out:
            with open(a.out, 'w', encoding='ascii') as f:
                f.write(text)
        else:
            sys.stdout.write(text)
        return 0
    if not a.tokenizer:
        ap.error('TOKENIZER_JSON is required')
    texts = token_texts(a.tokenizer)
    mapping, n_compressed = build_map(texts)
    print('ids %d compressed %d sha256 %s' % (len(mapping), n_compressed, digest(mapping)))
    if a.map:
        with open(a.map, 'w', encoding='utf-8') as f:
            json.dump(mapping, f)
    if a.texts:
        with open(a.texts, 'w', encoding='utf-8') as f:
            json.dump([list(t) for t in texts], f, ensure_ascii=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
