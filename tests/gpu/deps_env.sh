# shellcheck shell=bash
# Sourced by tests/gpu/check.sh before each step: `. tests/gpu/deps_env.sh ROOT WORK`.
#
# Sets MESON and NINJA (the commands, or their Python modules where only those are installed).
# When pkg-config cannot find the project's libraries (the device machine's image is a CUDA image,
# not a build host) and ROOT/.gpudeps holds the .deb files tests/gpu/fetch_deps.sh downloads, they
# are unpacked once under WORK/deps (never into /) and pkg-config, the compiler, the linker and the
# loader are pointed there: the build and the programs it makes find them, nothing else changes.
_ds41_root=$1
_ds41_work=$2
MESON=$(command -v meson || echo "python3 -m mesonbuild.mesonmain")
NINJA=$(command -v ninja || command -v ninja-build || echo "python3 -m ninja")
export MESON NINJA
_ds41_pkgs="jansson libutf8proc yaml-0.1 libsystemd libpcre2-8 liburing libzstd"
if [ -d "$_ds41_root/.gpudeps" ] &&
    ! { command -v pkg-config >/dev/null && pkg-config --exists $_ds41_pkgs 2>/dev/null; }; then
    _d=$_ds41_work/deps
    if [ ! -f "$_d/.done" ]; then
        mkdir -p "$_d/.ar"
        for _f in "$_ds41_root"/.gpudeps/*.deb; do
            if command -v dpkg-deb >/dev/null; then
                dpkg-deb -x "$_f" "$_d"
            else
                (cd "$_d/.ar" && rm -f data.tar.* && ar x "$_f" && tar xf data.tar.* -C "$_d")
            fi
        done
        # Debian's .pc files say prefix=/usr: make them say where they are now.
        find "$_d" -name '*.pc' -exec sed -i "s|^prefix=/usr\$|prefix=$_d/usr|" {} +
        touch "$_d/.done"
        echo "deps_env: unpacked $(ls "$_ds41_root"/.gpudeps/*.deb | wc -l) packages of .gpudeps under $_d"
    fi
    _l=$_d/usr/lib/x86_64-linux-gnu
    export PATH=$_d/usr/bin:$PATH
    export PKG_CONFIG_PATH=$_l/pkgconfig:$_d/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
    export LIBRARY_PATH=$_l:$_d/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$_l:$_d/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export C_INCLUDE_PATH=$_d/usr/include${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}
fi
