#!/usr/bin/python3
"""Mutation runner for ds41 (issue 19).

Applies each mutant of a mutant list (tests/mutation/mutants.ini, format in
tests/mutation/README.md) to a private copy of the source tree, rebuilds that
copy incrementally with meson, runs the tests the mutant names and reports
whether the tests killed it.  Standard library only.

The copy lives in --work (default: <source>/build-mutation); its files are
synchronised from the source tree's git-tracked and untracked-not-ignored
files at the start of every run (only changed files are rewritten, so the
copy's meson build stays incremental), and every mutated file is restored
from the source tree after its mutant, whatever happened.

Outcomes: killed (an expected test failed), survived (all passed),
stale (the fragment is not found exactly once in the file: the list needs
updating), invalid (the mutated tree does not compile: not counted as a kill),
timeout (the tests ran past --timeout: counted as killed, as a hang is caught).
Exit status: 0 when every mutant is killed, marked equivalent or a known
survivor (the `survives` key); 1 when a mutant expected to be killed survived; 2 when none survived but some were
stale or invalid (the list needs maintenance); 3 on a usage error.
"""
import argparse
import configparser
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SOURCE = os.path.dirname(os.path.dirname(HERE))
# meson test's per-test result line: " 1/2 ds41:quant   FAIL   0.52s   exit status 1"
FAILED_LINE = re.compile(r"^\s*\d+/\d+\s+(\S+)\s+(?:FAIL|TIMEOUT|ERROR)\b", re.M)
REQUIRED = ("file", "find", "replace", "tests", "class", "why")


class Mutant:
    def __init__(self, ident, sec, listfile):
        self.id = ident
        missing = [k for k in REQUIRED if k not in sec or not sec[k].strip()]
        if missing:
            raise ValueError("%s: mutant [%s] lacks %s" % (listfile, ident, ", ".join(missing)))
        self.file = sec["file"].strip()
        self.find = decode_fragment(sec["find"])
        self.replace = decode_fragment(sec["replace"])
        self.tests = sec["tests"].split()
        self.klass = sec["class"].strip()
        self.why = " ".join(sec["why"].split())
        self.quick = sec.get("quick", "no").strip().lower() in ("yes", "true", "1")
        self.equivalent = " ".join(sec.get("equivalent", "").split())
        # A gap the tests are known not to close yet, with the reason and what would close it:
        # reported and counted as survived, but not a failure of the run.
        self.survives = " ".join(sec.get("survives", "").split())
        if self.find == self.replace:
            raise ValueError("%s: mutant [%s]: find and replace are equal" % (listfile, ident))

    @property
    def module(self):
        return self.file


def decode_fragment(value):
    # configparser strips the value and joins nothing usefully, so a fragment
    # that spans lines spells its line breaks {NL} (and a tab {TAB}); every
    # other character is literal, so C escapes like "\\n" need no quoting.
    return value.strip().replace("{NL}", "\n").replace("{TAB}", "\t")


def load_mutants(listfile):
    cp = configparser.ConfigParser(interpolation=None, comment_prefixes=("#",),
                                   inline_comment_prefixes=None, strict=True,
                                   empty_lines_in_values=False)
    cp.optionxform = str
    with open(listfile, encoding="utf-8") as f:
        cp.read_file(f)
    return [Mutant(s, cp[s], listfile) for s in cp.sections()]


def log(msg):
    print(msg, flush=True)


def run(cmd, cwd, timeout=None, env=None):
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout, env=env)
        return p.returncode, p.stdout.decode("utf-8", "replace"), time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode("utf-8", "replace")
        return None, out, time.monotonic() - t0


def tracked_files(source):
    rc, out, _ = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], source)
    if rc != 0:
        print("run_mutants: %s is not a git checkout (skipped): %s" % (source, out.strip()))
        sys.exit(77)
    return [p for p in out.split("\0") if p]


def sync_tree(source, tree):
    """Copy source's files into tree, rewriting only those that differ."""
    os.makedirs(tree, exist_ok=True)
    changed = 0
    wanted = set()
    for rel in tracked_files(source):
        src = os.path.join(source, rel)
        if not os.path.isfile(src) or os.path.islink(src):
            continue
        wanted.add(rel)
        dst = os.path.join(tree, rel)
        with open(src, "rb") as f:
            data = f.read()
        try:
            with open(dst, "rb") as f:
                same = f.read() == data
        except FileNotFoundError:
            same = False
        if not same:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "wb") as f:
                f.write(data)
            os.chmod(dst, os.stat(src).st_mode & 0o777)
            changed += 1
    return changed


def meson_setup(tree, builddir):
    if os.path.isfile(os.path.join(builddir, "build.ninja")):
        return
    # -Dwerror=false: a mutant is judged by the tests, not by a warning (an
    # unused variable left by a replaced expression must not make it 'invalid').
    rc, out, _ = run(["meson", "setup", "-Dwerror=false", builddir], tree)
    if rc != 0:
        sys.exit("run_mutants: meson setup failed in %s:\n%s" % (tree, out))


def test_targets(builddir, names):
    """Build targets the given meson tests need (None: build everything)."""
    rc, out, _ = run(["meson", "introspect", "--tests", "--targets", builddir], builddir)
    if rc != 0:
        return None
    data = json.loads(out)
    ids = {t["id"]: t for t in data["targets"]}
    by_name = {t["name"]: t for t in data["tests"]}
    targets = {}
    for n in names:
        t = by_name.get(n)
        if t is None:
            sys.exit("run_mutants: no meson test named %r (see meson test --list)" % n)
        deps = list(t.get("depends", []))
        for d in deps:
            if d in ids:
                targets[d] = ids[d]
        # The test's own executable (C unit tests) is its command's first word.
        cmd0 = os.path.realpath(t["cmd"][0]) if t["cmd"] else ""
        for tg in data["targets"]:
            if any(os.path.realpath(f) == cmd0 for f in tg.get("filename", [])):
                targets[tg["id"]] = tg
    out = []
    for tg in targets.values():
        fn = tg["filename"][0]
        rel = os.path.relpath(fn, builddir)
        out.append(rel)
    return sorted(out)


def compile_targets(builddir, targets, timeout):
    cmd = ["ninja", "-C", builddir]
    if targets is not None:
        cmd += targets
    return run(cmd, builddir, timeout)


def run_tests(builddir, tests, timeout, multiplier=None):
    cmd = ["meson", "test", "-C", builddir, "--no-rebuild", "--print-errorlogs"]
    if multiplier:
        # A mutant that makes a test hang (a pin never released) is killed by meson's own
        # per-test timeout; scale it down so such a mutant costs minutes, not ten.
        cmd += ["--timeout-multiplier", str(multiplier)]
    if tests:
        cmd += tests
    rc, out, dt = run(cmd, builddir, timeout)
    return rc, out, dt


def on_term(signum, frame):
    # Turn SIGTERM into an exception so the mutated file is restored (finally).
    raise KeyboardInterrupt("signal %d" % signum)


def main():
    signal.signal(signal.SIGTERM, on_term)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", default=os.path.join(HERE, "mutants.ini"), help="mutant list (default: %(default)s)")
    ap.add_argument("--source", default=DEFAULT_SOURCE, help="git checkout to mutate a copy of")
    ap.add_argument("--work", help="persistent work directory for the copy and its build "
                    "(default: <source>/build-mutation)")
    ap.add_argument("--only", action="append", default=[], help="mutant id glob (repeatable)")
    ap.add_argument("--module", action="append", default=[], help="file glob, e.g. 'engine/serve/sampler.c'")
    ap.add_argument("--quick", action="store_true", help="only the mutants marked quick = yes")
    ap.add_argument("--suite", action="store_true",
                    help="run the whole default meson suite for each mutant instead of its tests (slow)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant's tests (default 900)")
    ap.add_argument("--timeout-multiplier", type=float, default=0.25,
                    help="meson test's per-test timeout multiplier for mutants (default 0.25; a hang is a kill)")
    ap.add_argument("--check", action="store_true", help="only check the list (stale fragments), build nothing")
    ap.add_argument("--baseline", action="store_true",
                    help="first run the selected mutants' tests on the unmutated copy (they must pass)")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args()

    source = os.path.abspath(a.source)
    try:
        mutants = load_mutants(a.list)
    except (ValueError, configparser.Error) as e:
        log("run_mutants: %s" % e)
        return 3
    sel = []
    for m in mutants:
        if a.only and not any(fnmatch.fnmatch(m.id, g) for g in a.only):
            continue
        if a.module and not any(fnmatch.fnmatch(m.file, g) for g in a.module):
            continue
        if a.quick and not m.quick:
            continue
        sel.append(m)
    if not sel:
        log("run_mutants: no mutant selected")
        return 3

    results = []
    if a.check:
        for m in sel:
            with open(os.path.join(source, m.file), encoding="utf-8") as f:
                n = f.read().count(m.find)
            st = "ok" if n == 1 else "stale"
            results.append((m, st, 0.0, "found %d times" % n))
            log("%-6s %-28s %s (found %d times)" % (st, m.id, m.file, n))
        return 2 if any(r[1] == "stale" for r in results) else 0

    work = os.path.abspath(a.work or os.path.join(source, "build-mutation"))
    tree = os.path.join(work, "tree")
    builddir = os.path.join(tree, "build")
    t0 = time.monotonic()
    n = sync_tree(source, tree)
    meson_setup(tree, builddir)
    # Regenerate the build files first if a meson.build changed (introspection reads them).
    run(["ninja", "-C", builddir, "build.ninja"], builddir)
    log("# copy %s (%d files refreshed), build %s" % (tree, n, builddir))

    all_tests = sorted({t for m in sel for t in m.tests})
    targets = None if a.suite else test_targets(builddir, all_tests)
    rc, out, dt = compile_targets(builddir, targets, None)
    if rc != 0:
        log(out[-4000:])
        log("run_mutants: the unmutated copy does not build")
        return 3
    log("# unmutated build: %.1f s" % dt)
    if a.baseline:
        rc, out, dt = run_tests(builddir, None if a.suite else all_tests, a.timeout)
        if rc != 0:
            log(out[-4000:])
            log("run_mutants: the unmutated copy fails its tests; fix that first")
            return 3
        log("# baseline tests pass: %.1f s" % dt)

    for m in sel:
        path = os.path.join(tree, m.file)
        with open(os.path.join(source, m.file), "rb") as f:
            orig = f.read()
        text = orig.decode("utf-8")
        count = text.count(m.find)
        t1 = time.monotonic()
        if count != 1:
            results.append((m, "stale", 0.0, "fragment found %d times" % count))
            log("stale    %-28s %s: fragment found %d times" % (m.id, m.file, count))
            continue
        detail = ""
        try:
            with open(path, "wb") as f:
                f.write(text.replace(m.find, m.replace, 1).encode("utf-8"))
            tg = None if a.suite else test_targets(builddir, m.tests)
            rc, out, _ = compile_targets(builddir, tg, None)
            if rc != 0:
                status = "invalid"
                err = [l for l in out.splitlines() if "error" in l]
                detail = err[0] if err else "build failed"
            else:
                rc, out, _ = run_tests(builddir, None if a.suite else m.tests, a.timeout, a.timeout_multiplier)
                if rc is None:
                    status, detail = "killed", "timeout"
                elif rc != 0:
                    status = "killed"
                    failed = [m_.group(1) for m_ in FAILED_LINE.finditer(out)]
                    detail = "by " + " ".join(sorted(set(failed))) if failed else "tests failed"
                else:
                    status = "equivalent" if m.equivalent else "survived"
        finally:
            with open(path, "wb") as f:
                f.write(orig)
        dt = time.monotonic() - t1
        results.append((m, status, dt, detail))
        log("%-8s %-28s %6.1fs %s %s" % (status, m.id, dt, m.file, detail))

    # Rebuild the restored tree so the next run starts from clean objects.
    compile_targets(builddir, targets, None)

    log("")
    log("# per module: killed/total (survived, stale, invalid, equivalent)")
    mods = {}
    for m, st, _, _ in results:
        mods.setdefault(m.file, {}).setdefault(st, 0)
        mods[m.file][st] += 1
    for f in sorted(mods):
        c = mods[f]
        tot = sum(c.values())
        log("%-32s %3d/%-3d (%d, %d, %d, %d)" % (f, c.get("killed", 0), tot, c.get("survived", 0),
                                                 c.get("stale", 0), c.get("invalid", 0),
                                                 c.get("equivalent", 0)))
    cnt = {}
    for _, st, _, _ in results:
        cnt[st] = cnt.get(st, 0) + 1
    k, s = cnt.get("killed", 0), cnt.get("survived", 0)
    rate = 100.0 * k / (k + s) if k + s else 100.0
    log("# total %d: killed %d, survived %d, stale %d, invalid %d, equivalent %d; "
        "kill rate %.1f%% (killed / (killed + survived)); %.0f s" %
        (len(results), k, s, cnt.get("stale", 0), cnt.get("invalid", 0), cnt.get("equivalent", 0),
         rate, time.monotonic() - t0))
    for m, st, _, _ in results:
        if st == "survived":
            log("# SURVIVED %s (%s): %s [%s] -- %s%s" % (m.id, m.klass, m.file, " ".join(m.tests), m.why,
                                                        " [known: %s]" % m.survives if m.survives else ""))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump([{"id": m.id, "file": m.file, "class": m.klass, "tests": m.tests, "status": st,
                        "seconds": round(dt, 1), "detail": d} for m, st, dt, d in results], f, indent=1)
    if any(st == "survived" and not m.survives for m, st, _, _ in results):
        return 1
    if cnt.get("stale", 0) or cnt.get("invalid", 0):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
