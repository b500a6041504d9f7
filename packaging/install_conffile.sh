#!/bin/sh
# meson install script (packaging/meson.build): install a configuration file
# only when none is there yet, as dpkg treats a conffile on a fresh install --
# `meson install` after an upgrade must not overwrite an edited
# /etc/ds41d/ds41d.yaml.  Honours DESTDIR (staged installs) and
# `meson install --dry-run`.
#
# usage: install_conffile.sh SOURCE DEST [MODE]   (DEST absolute, outside the prefix)
set -eu
src=$1
dest=$2
mode=${3:-0644}
case $dest in /*) ;; *) echo "install_conffile.sh: $dest: not an absolute path" >&2; exit 1 ;; esac
# meson gives scripts the prefix with and without DESTDIR; DESTDIR is the difference (absolute,
# whatever was given on the command line).
prefix=${MESON_INSTALL_PREFIX:-/}
dprefix=${MESON_INSTALL_DESTDIR_PREFIX:-$prefix}
destdir=${dprefix%"$prefix"}
destdir=${destdir%/}
target=$destdir$dest
if [ -e "$target" ] || [ -L "$target" ]; then
    echo "Keeping $target (it exists; the packaged default was not installed over it)"
    exit 0
fi
if [ -n "${MESON_INSTALL_DRY_RUN:-}" ]; then
    echo "Would install $src to $target"
    exit 0
fi
echo "Installing $src to $target"
mkdir -p "$(dirname "$target")"
tmp=$target.tmp-$$
install -m "$mode" "$src" "$tmp"
mv -f "$tmp" "$target"
