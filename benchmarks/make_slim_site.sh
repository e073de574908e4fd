#!/usr/bin/env bash
# One site archive for device calls that need laya's server but not TileLang: ../shared/gpu/make-gpu-site.sh's
# archive less TileLang and what only it imports (z3, tvm_ffi, torch_c_dlpack_ext: 240 MB unpacked), plus
# make_serve_site.sh's wheels. The full site (53 MB), the serve wheels (6.5 MB) and the tree together are over a
# device call's 64 MiB carry; this one is about 7 MB. A build with `stages.tilelang=false`, the AOTInductor route,
# http_bench.py and laya's eager path run from it (laya imports TileLang only for `fast=True`).
# Run from the project's root after both scripts; it replaces .device-site/site.tar.xz, keeping the full one as
# .device-site/full/site.tar.xz (outside the carry when only .device-site/site.tar.xz is carried). The unpack line
# is then: { [ -d /tmp/site/fastapi ] || tar -xJf .device-site/site.tar.xz -C /tmp/site; }
set -euo pipefail
d=.device-site
[ -f "$d/full/site.tar.xz" ] || { mkdir -p "$d/full"; mv "$d/site.tar.xz" "$d/full/site.tar.xz"; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar -xJf "$d/full/site.tar.xz" -C "$tmp"
rm -rf "$tmp"/tilelang* "$tmp"/z3* "$tmp"/tvm_ffi "$tmp"/apache_tvm_ffi* "$tmp"/torch_c_dlpack_ext*
tar -xJf "$d/serve-site.tar.xz" -C "$tmp"
(cd "$tmp" && tar -cf - . | xz -T0 -6) > "$d/site.tar.xz.part" && mv "$d/site.tar.xz.part" "$d/site.tar.xz"
ls -la "$d/site.tar.xz"
