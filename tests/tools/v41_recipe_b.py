#!/usr/bin/python3
"""Rebuild DeepSeek-V4.1-Flash's tokenizer.json from DeepSeek-V4's (Recipe B of
tests/data/tokenizer-v41/README.md): the 9 added-token entries that differ
between V4 and V4.1 are rewritten in place, keeping the file's layout byte for
byte, and one "\\n" is appended.

usage: v41_recipe_b.py V4_TOKENIZER_JSON ADDED_TOKENS_V41_JSON OUT_FILE

Only the standard library is used.  Every rewritten entry must be found
exactly once with the V4 layout; anything unexpected aborts (exit 1)."""
import json
import re
import sys

CHANGED_IDS = [128799, 129264, 129265, 129266, 129267, 129268, 129269, 129270, 129279]


def json_value(v):
    # The V4 file is Python json.dumps(ensure_ascii=False) output.
    return json.dumps(v, ensure_ascii=False)


def main(argv):
    if len(argv) != 4:
        sys.stderr.write(__doc__)
        return 1
    v4_path, added_path, out_path = argv[1:]
    with open(v4_path, "rb") as f:
        text = f.read().decode("utf-8")
    with open(added_path, "rb") as f:
        added = {t["id"]: t for t in json.loads(f.read().decode("utf-8"))}
    if text.endswith("\n"):
        sys.stderr.write("%s: already ends with a newline; not the V4 file\n" % v4_path)
        return 1
    for tid in CHANGED_IDS:
        want = added[tid]
        # One entry: the "id" line, then the fields in file order up to "}".
        pat = re.compile(r'(\n {6}"id": %d,\n)((?: {5,6}"[a-z_]+": [^\n]*\n)+)( {4}\})' % tid)
        found = pat.findall(text)
        if len(found) != 1:
            sys.stderr.write("%s: entry id %d found %d times\n" % (v4_path, tid, len(found)))
            return 1

        def rewrite(m):
            lines = m.group(2).split("\n")
            out = []
            for line in lines:
                fm = re.match(r'^( +)"([a-z_]+)": (.*?)(,?)$', line)
                if not fm:
                    out.append(line)
                    continue
                indent, key, _, comma = fm.groups()
                if key not in want:
                    raise SystemExit("%s: entry id %d has unknown field %s" % (v4_path, tid, key))
                out.append('%s"%s": %s%s' % (indent, key, json_value(want[key]), comma))
            return m.group(1) + "\n".join(out) + m.group(3)

        text = pat.sub(rewrite, text)
    text += "\n"
    with open(out_path, "wb") as f:
        f.write(text.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
