"""Compile an `mx.fast.cuda_kernel` source with NVRTC exactly as MLX's CUDA backend does.

Why: there is no GPU here, and a kernel that fails to compile costs a whole GPU try.
This builds the same translation unit as mlx/backend/cuda/custom_kernel.cpp and runs
NVRTC with the options of mlx/backend/cuda/jit_module.cpp (`compile`):
`--device-as-default-execution-space --gpu-architecture=sm_90a` (H100/H200), the
include paths of the MLX CUDA wheel (mlx/include, mlx/include/cccl) and of the CUDA
runtime wheel (nvidia/cu13/include), and MLX's device headers as in-memory headers
(g_include_names). It fails on any error or warning. Dev tool, not run in CI.

Setup (once, needs downloads):
    pip download mlx-cuda-13==0.32.4 --no-deps -d /tmp/w && unzip the wheel to /tmp/mlxcuda
    pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        'nvidia-cuda-nvrtc==13.*' 'nvidia-cuda-runtime==13.*' -d /tmp/nvrtc
    cd /tmp/nvrtc && for f in *.whl; do python -m zipfile -e $f .; done
MLX's device headers (utils.cuh, ...) are read from the bare mirror
/work/.mirror/ml-explore+mlx/repo at HEAD (the wheel ships only config.h of them).

Usage, from the repo root:
    PYTHONPATH=tests/engine python -m cuda_emulation.nvrtc_check FILE.py:NAME [...]
NAME in FILE.py is a KernelSpec, a list of them, or a zero-argument function returning
either. `--demo` compiles a small elementwise kernel and a planted syntax error.
Options: --mlx-root, --nvrtc-root, --mlx-repo, --arch (default sm_90a), --ptxas-verbose,
--allow-warnings (note: an unused template argument already warns, #177-D).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "cuda_emulation"

from .spec import DEFAULT_HEADER, KernelSpec, build_kernel_source  # noqa: E402

# g_include_names in mlx/backend/cuda/jit_module.cpp.
DEVICE_HEADERS = (
    "atomic_ops.cuh binary_ops.cuh cast_op.cuh config.h complex.cuh cute_dequant.cuh "
    "fp16_math.cuh gemm_sm70.cuh hadamard.cuh indexing.cuh qmm_naive.cuh qmm_sm80.cuh "
    "qmm_sm90.cuh scatter_ops.cuh unary_ops.cuh ternary_ops.cuh utils.cuh"
).split()
DEVICE_PREFIX = "mlx/backend/cuda/device/"


@dataclass(frozen=True)
class Toolchain:
    """Where the MLX wheel, the NVRTC/runtime wheels and the MLX source mirror live."""

    mlx_root: Path = Path("/tmp/mlxcuda/mlx")
    nvrtc_root: Path = Path("/tmp/nvrtc/nvidia/cu13")
    mlx_repo: Path = Path("/work/.mirror/ml-explore+mlx/repo")
    arch: str = "sm_90a"
    ptxas_verbose: bool = False
    allow_warnings: bool = False

    def options(self) -> list[str]:
        """NVRTC options in jit_module.cpp's order: the flags, then include_path_args()."""
        opts = ["--device-as-default-execution-space", f"--gpu-architecture={self.arch}"]
        for path in (self.mlx_root / "include", self.mlx_root / "include" / "cccl"):
            if path.exists():
                opts.append(f"--include-path={path}")
        opts.append(f"--include-path={self.nvrtc_root / 'include'}")
        if self.ptxas_verbose:
            opts.append("--ptxas-options=-v")
        return opts

    def device_headers(self) -> list[tuple[str, bytes]]:
        """(include name, contents) for MLX's in-memory device headers, from the mirror."""
        out = []
        for name in DEVICE_HEADERS:
            rev = f"HEAD:{DEVICE_PREFIX}{name}"
            text = subprocess.run(
                ["git", "-C", str(self.mlx_repo), "show", rev], check=True, capture_output=True
            ).stdout
            out.append((DEVICE_PREFIX + name, text))
        return out


@dataclass(frozen=True)
class CompileResult:
    """NVRTC's verdict: `ok` is False on an error or on any warning in the log."""

    ok: bool
    log: str
    source: str
    binary_size: int


def _load_nvrtc(root: Path) -> ctypes.CDLL:
    lib_dir = root / "lib"
    builtins = sorted(lib_dir.glob("libnvrtc-builtins.so*"))
    if not builtins:
        raise FileNotFoundError(f"no libnvrtc-builtins.so* under {lib_dir} (see module docstring)")
    # libnvrtc dlopens its builtins by soname; loading them first makes that lookup succeed.
    ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(next(iter(sorted(lib_dir.glob("libnvrtc.so*"))))))


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what} failed: {lib.nvrtcGetErrorString(code).decode()}")


def compile_source(source: str, kernel_name: str, tc: Toolchain) -> CompileResult:
    """Compile one translation unit like jit_module.cpp's `compile` and return the log."""
    lib = _load_nvrtc(tc.nvrtc_root)
    headers = tc.device_headers()
    names = (ctypes.c_char_p * len(headers))(*[n.encode() for n, _ in headers])
    texts = (ctypes.c_char_p * len(headers))(*[t for _, t in headers])
    prog = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), b"kernel.cu", len(headers), texts, names
        ),
        "nvrtcCreateProgram",
    )
    try:
        _check(lib, lib.nvrtcAddNameExpression(prog, kernel_name.encode()), "AddNameExpression")
        opts = [o.encode() for o in tc.options()]
        code = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "GetProgramLogSize")
        buf = ctypes.create_string_buffer(size.value + 1)
        _check(lib, lib.nvrtcGetProgramLog(prog, buf), "GetProgramLog")
        log = buf.value.decode(errors="replace")
        binary = ctypes.c_size_t(0)
        if code == 0:
            getter = lib.nvrtcGetCUBINSize if tc.arch.startswith("sm_") else lib.nvrtcGetPTXSize
            _check(lib, getter(prog, ctypes.byref(binary)), "GetCUBINSize")
        ok = code == 0 and (tc.allow_warnings or "warning" not in log.lower())
        return CompileResult(ok=ok, log=log, source=source, binary_size=binary.value)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def check_spec(
    spec: KernelSpec, tc: Toolchain | None = None, input_ndims: list[int] | None = None
) -> CompileResult:
    """Build `spec`'s source as MLX does and compile it with NVRTC."""
    source = build_kernel_source(spec, DEFAULT_HEADER, input_ndims)
    return compile_source(source, f"mlx::core::cu::{spec.kernel_name}", tc or Toolchain())


DEMO = KernelSpec(
    name="myexp",
    inputs=(("inp", "float32"),),
    outputs=(("out", "float32"),),
    template=(("T", "float32"),),
    source="""
        uint32_t elem = blockIdx.x * blockDim.x + threadIdx.x;
        if (elem < inp_shape[0]) {
          T tmp = inp[elem];
          out[elem] = exp(tmp);
        }
    """,
)
DEMO_BROKEN = KernelSpec(
    name="broken", inputs=DEMO.inputs, outputs=DEMO.outputs, source="out[0] = inp[0]  // no ;"
)


def _load_specs(target: str) -> list[KernelSpec]:
    path, _, attr = target.rpartition(":")
    module_spec = importlib.util.spec_from_file_location("kernel_under_check", path)
    if not path or module_spec is None or module_spec.loader is None:
        raise SystemExit(f"expected FILE.py:NAME, got {target!r}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    value = getattr(module, attr)
    value = value() if callable(value) and not isinstance(value, KernelSpec) else value
    return [value] if isinstance(value, KernelSpec) else list(value)


def _report(spec: KernelSpec, result: CompileResult, expect_ok: bool = True) -> bool:
    verdict = "OK" if result.ok else "FAILED"
    print(f"== {spec.kernel_name}: {verdict} (binary {result.binary_size} bytes)")
    if result.log.strip():
        print(result.log)
    if not result.ok:
        numbered = "\n".join(f"{i + 1:4d} {ln}" for i, ln in enumerate(result.source.splitlines()))
        print(numbered)
    return result.ok == expect_ok


def main(argv: list[str] | None = None) -> int:
    """CLI: exit status 0 only if every kernel compiles without errors or warnings."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("targets", nargs="*", help="FILE.py:NAME")
    ap.add_argument("--demo", action="store_true")
    ap.add_argument("--mlx-root", type=Path, default=Toolchain.mlx_root)
    ap.add_argument("--nvrtc-root", type=Path, default=Toolchain.nvrtc_root)
    ap.add_argument("--mlx-repo", type=Path, default=Toolchain.mlx_repo)
    ap.add_argument("--arch", default=Toolchain.arch)
    ap.add_argument("--ptxas-verbose", action="store_true", help="print registers/spills")
    ap.add_argument("--allow-warnings", action="store_true", help="fail on errors only")
    args = ap.parse_args(argv)
    tc = Toolchain(
        args.mlx_root,
        args.nvrtc_root,
        args.mlx_repo,
        args.arch,
        args.ptxas_verbose,
        args.allow_warnings,
    )
    good = True
    if args.demo:
        good &= _report(DEMO, check_spec(DEMO, tc))
        good &= _report(DEMO_BROKEN, check_spec(DEMO_BROKEN, tc), expect_ok=False)
    for target in args.targets:
        for spec in _load_specs(target):
            good &= _report(spec, check_spec(spec, tc))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
