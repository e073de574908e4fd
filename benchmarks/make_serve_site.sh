#!/usr/bin/env bash
# The wheels the offline H200 host needs beyond ../shared/gpu/make-gpu-site.sh's archive, for
# benchmarks/http_bench.py (laya's server) and gpu_ci_merge.py (zstd packs): cp312 / manylinux x86_64,
# unpacked into one archive, .device-site/serve-site.tar.xz (git-ignored like the site archive).
# Run from the project's root on a machine with PyPI access; on the host, after the site unpack line:
#   { [ -d /tmp/site/fastapi ] || tar -xJf .device-site/serve-site.tar.xz -C /tmp/site; }
set -euo pipefail
out=.device-site
mkdir -p "$out"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp/wheels" \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
  anyio==4.16.0 h11==0.16.0 click==8.5.1 idna==3.20 typing-extensions==4.16.0 zstandard==0.25.0
mkdir -p "$tmp/site"
for w in "$tmp"/wheels/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
(cd "$tmp/site" && tar -cf - . | xz -T0 -6) > "$out/serve-site.tar.xz.part" && mv "$out/serve-site.tar.xz.part" "$out/serve-site.tar.xz"
ls -la "$out/serve-site.tar.xz"
