# Why: on the lent GPU machine (no network) this installs the wheels that pack.sh bundled and
# stage.sh collected, so batchd's daemon, bench and engine tests run there on MLX's CUDA
# backend. Meant to be sourced (it exports PYTHONPATH and LD_LIBRARY_PATH) from the repo
# root in the last of the back-to-back calls (the machine stays warm only 30 s after a call):
#   source config/gpu/install.sh && python3 -m pytest ...
_gpu_install() {
  local repo stage site=/tmp/site work=/tmp/gpu-bundle nv nvroot
  repo=$(pwd)
  stage=/tmp/gpu-stage
  mkdir -p "$stage" "$work"
  cp -n .gpu/part-* .gpu/SHA256SUMS "$stage"/ 2>/dev/null
  [[ -f $stage/SHA256SUMS ]] || { echo "install.sh: no SHA256SUMS in $stage or .gpu/" >&2; return 1; }
  cat "$stage"/part-* > "$work/bundle.tar.xz"
  (cd "$work" && sha256sum -c "$stage/SHA256SUMS") || { ls -l "$stage" >&2; return 1; }
  # Python's tarfile, not tar -J: the image may lack the xz program, never the lzma module.
  python3 -c 'import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
    "$work/bundle.tar.xz" "$work" || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$work"/whl/*.whl || return 1
  # batchd, editable into python3's own environment (its setuptools builds it; a site dir, so
  # the finder that maps engine/ -> batchd.engine, as pyproject.toml says, loads at startup).
  if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e "$repo"; then
    # No setuptools fit to build it: map the folders into the (disposable) copy's batchd/.
    echo "install.sh: editable install failed; linking engine/ daemon/ ... into batchd/" >&2
    for d in engine daemon producers config; do ln -sfn "../$d" "$repo/batchd/$d"; done
    mkdir -p "$site/bin"
    printf '#!/bin/sh\nexec python3 -c "import sys; from batchd.daemon.cli import main; sys.exit(main())" "$@"\n' \
      >"$site/bin/batchd" && chmod +x "$site/bin/batchd"
    export PATH=$site/bin:$PATH PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
  fi
  rm -rf /tmp/redis && cp -r "$work/redis" /tmp/redis
  command -v redis-server >/dev/null || export PATH=$PATH:/tmp/redis/bin
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  # libmlx.so's RPATH looks for the CUDA libraries in ../../nvidia beside it (/tmp/site), and
  # MLX's kernel compiler for the CUDA headers in ../../nvidia/cu13/include: link the image's
  # own nvidia-* wheels there, and point the loader at them too.
  nvroot=$(python3 -S -c 'import site;print(site.getsitepackages()[0])')/nvidia
  [[ -d $nvroot && ! -e $site/nvidia ]] && ln -s "$nvroot" "$site/nvidia"
  [[ -d /usr/local/cuda/include && -z ${CUDA_HOME:-} ]] && export CUDA_HOME=/usr/local/cuda
  nv=$(ls -d "$nvroot"/*/lib 2>/dev/null | paste -sd:)
  export LD_LIBRARY_PATH=$nv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  ls -d "$site"/nvidia/*/include 2>/dev/null | head -3
  python3 -c 'import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.cuda.is_available())'
}
_gpu_install
