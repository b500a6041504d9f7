"""TAP output and subprocess helper shared by the reference tests (meson runs them as TAP)."""

import os
import subprocess
import sys

_tests = 0
_failed = 0


def tap(ok, desc, diag=None):
    """One test line; diag (text) printed as comments when it fails.  Returns ok."""
    global _tests, _failed
    _tests += 1
    print(f"{'ok' if ok else 'not ok'} {_tests} - {desc}")
    if not ok:
        _failed += 1
        for line in str(diag or '').splitlines():
            print(f"# {line}")
    sys.stdout.flush()
    return ok


def note(msg):
    print(f"# {msg}")
    sys.stdout.flush()


def plan():
    """Print the plan line; the exit status (1 if a test failed)."""
    print(f"1..{_tests}")
    return 1 if _failed else 0


def missing(*paths):
    """Print the TAP skip plan and return True when one of the programs is not built."""
    for p in paths:
        if not os.path.exists(p):
            print(f"1..0 # SKIP {p} not built")
            return True
    return False


def run(cmd, env=None, check=True):
    """Run cmd capturing its output; with check, a non-zero exit raises naming the command."""
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return p
