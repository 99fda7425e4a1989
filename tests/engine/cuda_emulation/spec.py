"""The kernel description shared by the NVRTC check and the CPU emulator.

Both tools must see the very source MLX 0.32.x builds in `mx.fast.cuda_kernel`
(mlx/backend/cuda/custom_kernel.cpp, `build_kernel`), so the signature, the
template-argument preamble and the kernel name are produced here once, from one
`KernelSpec`, and each tool only chooses the prelude (MLX's real headers for NVRTC,
the emulation header for g++).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# dtype_to_cuda_type in mlx/backend/cuda/utils.cpp.
CUDA_TYPES: dict[str, str] = {
    "bool": "bool",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
    "float64": "double",
}

# get_type_string in mlx/backend/common/compiled.cpp: names dtype template args in the hash.
_HASH_TYPES: dict[str, str] = {**CUDA_TYPES, "float16": "float16_t", "bfloat16": "bfloat16_t"}

# MLX's default_header: prepended to every custom kernel before the user's header.
DEFAULT_HEADER = (
    '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
)

TemplateValue = int | bool | str


@dataclass(frozen=True)
class KernelSpec:
    """One `mx.fast.cuda_kernel` call: its constructor arguments plus the call-time dtypes.

    `inputs`/`outputs` are (name, dtype) pairs in call order, dtype as MLX spells it
    ("float32", "bfloat16", ...) or an mx.Dtype. `template` holds (name, value) pairs
    where a value is an int, a bool, or a dtype (name or mx.Dtype), as passed to
    `template=`. Stored normalized: tuples of names.
    """

    name: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    source: str
    header: str = ""
    template: tuple[tuple[str, TemplateValue], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # Accept lists and mx.Dtype objects (str(mx.bfloat16) == "mlx.core.bfloat16") too.
        pairs = {
            "inputs": tuple((n, dtype_name(d)) for n, d in self.inputs),
            "outputs": tuple((n, dtype_name(d)) for n, d in self.outputs),
            "template": tuple(
                (n, v if isinstance(v, int) else dtype_name(v)) for n, v in self.template
            ),
        }
        for attr, value in pairs.items():
            object.__setattr__(self, attr, value)
        if not self.outputs:
            raise ValueError(f"kernel {self.name!r}: at least one output is required")
        for arg, dtype in (*self.inputs, *self.outputs):
            if dtype not in CUDA_TYPES:
                raise ValueError(f"kernel {self.name!r}: {arg!r} has unsupported dtype {dtype!r}")

    @property
    def kernel_name(self) -> str:
        """`custom_kernel_<name><template hash>`, as MLX names the __global__ function."""
        return f"custom_kernel_{self.name}{template_hash(self.template)}"

    def shape_infos(self) -> list[tuple[bool, bool, bool]]:
        """Per input: whether the source mentions <in>_shape, <in>_strides, <in>_ndim."""
        return [
            (f"{n}_shape" in self.source, f"{n}_strides" in self.source, f"{n}_ndim" in self.source)
            for n, _ in self.inputs
        ]


def dtype_name(dtype: object) -> str:
    """MLX's dtype name for "bfloat16", mx.bfloat16 or np.float32 alike."""
    name = str(getattr(dtype, "__name__", dtype)).rsplit(".", 1)[-1]
    if name not in CUDA_TYPES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return name


def template_hash(template: tuple[tuple[str, TemplateValue], ...]) -> str:
    """template_arguments_hash in custom_kernel.cpp."""
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append(f"_{_HASH_TYPES[value]}")
    return "".join(parts)


def _template_preamble(template: tuple[tuple[str, TemplateValue], ...]) -> str:
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};\n")
        else:
            lines.append(f"  using {name} = {CUDA_TYPES[value]};\n")
    return "".join(lines) + "\n" if lines else ""


def _parameters(spec: KernelSpec, input_ndims: list[int]) -> str:
    params = []
    for (name, dtype), ndim, info in zip(spec.inputs, input_ndims, spec.shape_infos(), strict=True):
        params.append(f"    const {CUDA_TYPES[dtype]}* {name},\n")
        if ndim > 0:
            kinds = ("Shape {}_shape", "Strides {}_strides", "int {}_ndim")
            for wanted, kind in zip(info, kinds, strict=True):
                if wanted:
                    params.append(f"    const __grid_constant__ {kind.format(name)},\n")
    outs = [f"    {CUDA_TYPES[dtype]}* {name}" for name, dtype in spec.outputs]
    return "".join(params) + ",\n".join(outs) + ") {\n"


def build_kernel_source(
    spec: KernelSpec, prelude: str, input_ndims: list[int] | None = None
) -> str:
    """The translation unit MLX compiles, with `prelude` in place of MLX's default header.

    `input_ndims` matters only for inputs whose shape/strides/ndim the source uses: MLX
    adds those parameters only for inputs with ndim > 0 (default: all inputs 1-D or more).
    """
    ndims = input_ndims if input_ndims is not None else [1] * len(spec.inputs)
    return (
        prelude
        + spec.header
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        + f"__global__ void {spec.kernel_name}(\n"
        + _parameters(spec, ndims)
        + _template_preamble(spec.template)
        + spec.source
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )
