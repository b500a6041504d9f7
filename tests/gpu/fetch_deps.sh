#!/bin/bash
# Download (here, with apt) the .deb files of the libraries ds41 builds against into .gpudeps/ of the
# working tree, for a device machine whose image lacks them (tests/gpu/README.md): the -dev
# packages, the shared libraries they point at, and pkgconf.  .gpudeps is ignored by git
# (.gitignore); name it in the device tool's `carry`.  check.sh unpacks them there only when
# pkg-config cannot find the libraries (tests/gpu/deps_env.sh).
set -eu
cd "$(dirname "$0")/../.."
mkdir -p .gpudeps
cd .gpudeps
apt-get download \
    libjansson-dev libjansson4 libutf8proc-dev libutf8proc2 libyaml-dev libyaml-0-2 \
    libsystemd-dev libsystemd0 libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 \
    liburing-dev liburing2 libzstd-dev libzstd1 pkgconf pkgconf-bin libpkgconf3
du -sh .
