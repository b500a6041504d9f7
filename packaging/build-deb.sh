#!/bin/bash
# Builds the Debian package ds41_<version>_<arch>.deb with the standard tools
# (dpkg-buildpackage -b -us -uc: debhelper + meson, packaging/debian/) from a
# clean copy of this source tree, and leaves the .deb (and its .buildinfo and
# .changes) in OUTDIR.
#
# usage: packaging/build-deb.sh OUTDIR
#
# The copy holds the files git knows (tracked and untracked-but-not-ignored,
# so uncommitted edits are packaged; build directories are not), or, outside a
# git checkout, the tree without build*/ directories.  packaging/debian/ is
# copied to the copy's debian/: the Debian directory stays out of the top
# level of the project.  Build dependencies: debhelper, dpkg-dev and those
# listed in packaging/debian/control (dpkg-buildpackage names any missing).
# DEB_BUILD_OPTIONS is passed through (nocheck skips the quick test subset,
# parallel=N sets the jobs; default: one per CPU).
set -euo pipefail
if [ $# -ne 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
    echo "usage: $0 OUTDIR   (builds ds41_*.deb from a clean copy of this tree into OUTDIR)" >&2
    exit 2
fi
src=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1"
out=$(cd "$1" && pwd)
for tool in dpkg-buildpackage dh; do
    command -v "$tool" >/dev/null || { echo "$0: $tool not found (apt-get install dpkg-dev debhelper)" >&2; exit 1; }
done

version=$(dpkg-parsechangelog -l "$src/packaging/debian/changelog" -S Version)
meson_version=$(sed -n "s/^ *version *: *'\([^']*\)'.*/\1/p" "$src/meson.build" | head -1)
if [ "${version%%-*}" != "$meson_version" ]; then
    echo "$0: packaging/debian/changelog is at $version but meson.build at $meson_version: add a changelog entry (dch -v $meson_version)" >&2
    exit 1
fi

work=$(mktemp -d /tmp/ds41-deb-XXXXXX)
trap 'rm -rf "$work"' EXIT
tree=$work/ds41-$version
mkdir "$tree"
if git -C "$src" rev-parse --show-toplevel >/dev/null 2>&1 &&
   [ "$(git -C "$src" rev-parse --show-toplevel)" = "$src" ]; then
    (cd "$src" && git ls-files -z --cached --others --exclude-standard |
        while IFS= read -r -d '' f; do
            if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi  # not files deleted in the worktree
        done |
        tar --null -T - -cf -) | tar -C "$tree" -xf -
else
    (cd "$src" && tar --exclude='./build*' --exclude=./debian -cf - .) | tar -C "$tree" -xf -
fi
rm -rf "$tree/debian"
cp -a "$tree/packaging/debian" "$tree/debian"

echo "building ds41 $version in $tree"
(cd "$tree" && dpkg-buildpackage -b -us -uc -J"${DS41_DEB_JOBS:-auto}")
shopt -s nullglob
built=("$work"/*.deb)
[ ${#built[@]} -gt 0 ] || { echo "$0: dpkg-buildpackage made no .deb" >&2; exit 1; }
mv -f "${built[@]}" "$work"/*.ddeb "$work"/*.buildinfo "$work"/*.changes "$out"/
for f in "${built[@]}"; do echo "$out/$(basename "$f")"; done
