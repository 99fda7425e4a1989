"""The paged KV pool: one K and one V array per layer, addressed by slot.

Layout ``[kv_heads, num_blocks * block_size, head_dim]``: gathering a batch's
blocks along axis 1 yields ``[kv_heads, B, T, head_dim]``, which reshapes for
free into the contiguous ``[kv_heads * B, 1, T, head_dim]`` that SDPA reads
fastest on CPU (the layouts compared: docs/bench/HISTORY.md, "Figures behind
the code's choices"). Slot ``s`` lives in block ``s // block_size`` at offset
``s % block_size``; new K/V are written by an in-place scatter on slots.

The pool is allocated and zeroed at start, every page written, so its size is start-up
time as well as memory: SmolLM2-135M (float32, 45 KiB per token) took 34 s to be ready
with the old default of half of available memory (16182 blocks, 11.1 GiB, 2 CPU cores)
and 4.4-5 s with the default rule of plan_pool (2048 blocks, 1.4 GiB). That rule holds
``max_num_seqs x kv_tokens_per_seq`` tokens, as llama.cpp's server shares one context
among its slots, rather than vLLM's "whatever memory is free": jobs are mostly short, and
a pool that runs out preempts a sequence to recompute it later instead of failing it.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx

from batchd.engine.config import EngineConfig
from batchd.engine.forward import kv_quant
from batchd.engine.forward.kv_quant import Blocks, KVQuant, QuantizedBlocks
from batchd.engine.models.loader import ModelSpec

log = logging.getLogger(__name__)

# Never size a pool below this many blocks, whatever memory says.
MIN_BLOCKS = 16
DEFAULT_TOKENS_PER_SEQ = EngineConfig.kv_tokens_per_seq


class KVPool:
    """Zero-initialised K/V storage for every layer (zeros keep masked reads finite).

    With ``quant`` the storage is quantized (batchd.engine.forward.kv_quant): ``k`` and
    ``v`` are then empty and ``qk``/``qv`` hold each layer's codes, scales and biases.
    Writers go through :meth:`write` and readers through :meth:`blocked`, which serve
    both kinds; only the C kernels read ``k``/``v`` directly (float pools only).
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        num_blocks: int,
        block_size: int,
        quant: KVQuant | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.dtype = spec.dtype
        self.quant = quant
        shape = (spec.num_kv_heads, num_blocks * block_size, spec.head_dim)
        self.k: list[mx.array] = []
        self.v: list[mx.array] = []
        self.qk: list[kv_quant.Quantized] = []
        self.qv: list[kv_quant.Quantized] = []
        if quant is None:
            self.k = [mx.zeros(shape, dtype=spec.dtype) for _ in range(spec.num_layers)]
            self.v = [mx.zeros(shape, dtype=spec.dtype) for _ in range(spec.num_layers)]
        else:
            self.qk = [kv_quant.zeros(quant, shape, spec.dtype) for _ in range(spec.num_layers)]
            self.qv = [kv_quant.zeros(quant, shape, spec.dtype) for _ in range(spec.num_layers)]
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        """Every array of the pool: evaluate them to run the writes still lazy."""
        quantized = [a for stored in (*self.qk, *self.qv) for a in stored]
        return [*self.k, *self.v, *quantized]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def write(self, layer: int, slots: mx.array, k_new: mx.array, v_new: mx.array) -> None:
        """Store K/V ``[kv_heads, n, head_dim]`` of ``n`` tokens at ``slots`` (in place,
        lazily), cast to the pool's dtype and quantized when the pool is."""
        if k_new.dtype != self.dtype:
            k_new, v_new = k_new.astype(self.dtype), v_new.astype(self.dtype)
        if self.quant is None:
            self.k[layer][:, slots] = k_new
            self.v[layer][:, slots] = v_new
            return
        for stored, new in ((self.qk[layer], k_new), (self.qv[layer], v_new)):
            for array, part in zip(stored, kv_quant.quantize(self.quant, new), strict=True):
                array[:, slots] = part

    def blocked(self, layer: int) -> tuple[Blocks, Blocks]:
        """Layer ``layer``'s K and V as blocks ``[kv_heads, num_blocks, block_size, *]``:
        float arrays, or QuantizedBlocks (read with kv_quant.take_blocks)."""
        blocks = (self.num_kv_heads, self.num_blocks, self.block_size)
        if self.quant is None:
            shape = (*blocks, self.head_dim)
            return self.k[layer].reshape(shape), self.v[layer].reshape(shape)
        quant = self.quant

        def view(stored: kv_quant.Quantized) -> QuantizedBlocks:
            codes, scales, biases = (a.reshape(*blocks, -1) for a in stored)
            return QuantizedBlocks(quant, (codes, scales, biases))

        return view(self.qk[layer]), view(self.qv[layer])


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def kv_bytes_per_token(spec: ModelSpec, quant: KVQuant | None = None) -> int:
    """Bytes of K and V for one token across all layers, as the pool stores them."""
    if quant is None:
        return spec.kv_bytes_per_token
    return 2 * spec.num_layers * spec.num_kv_heads * quant.row_bytes(spec.head_dim, spec.dtype)


def available_memory_bytes() -> int:
    """Memory the pool may draw from: Metal's working set, else MemAvailable."""
    if sys.platform == "darwin" and mx.metal.is_available():
        info = mx.device_info()
        budget = int(info.get("max_recommended_working_set_size", info["memory_size"]))
        return max(0, budget - mx.get_active_memory())
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot tell available memory: pass num_kv_blocks explicitly")


class PoolBound(str, Enum):
    """What decided the pool's size (logged at start)."""

    SET = "num_kv_blocks"
    BUDGET = "budget"
    ONE_SEQUENCE = "one_sequence"
    ALL_SEQUENCES = "all_sequences"
    MEMORY = "memory"
    MINIMUM = "minimum"


@dataclass(frozen=True)
class PoolPlan:
    """A pool size and why: ``blocks`` of ``block_size`` tokens, ``block_bytes`` each."""

    blocks: int
    block_size: int
    block_bytes: int
    bound: PoolBound
    why: str
    storage: str = ""  # how a token's K/V are stored: the dtype, or the quantization

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def mib(self) -> float:
        return self.blocks * self.block_bytes / 2**20


def sequence_blocks(max_model_len: int, block_size: int) -> int:
    """Blocks one sequence of ``max_model_len`` tokens holds (as the scheduler counts:
    the last sampled token is never fed back, so it needs no K/V)."""
    return -(-(max_model_len - 1) // block_size)


def plan_pool(
    spec: ModelSpec,
    *,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    tokens_per_seq: int,
    memory_fraction: float,
    num_blocks: int | None = None,
    available_bytes: int | None = None,
    quant: KVQuant | None = None,
) -> PoolPlan:
    """The pool's size by the rule EngineConfig.num_kv_blocks documents, and what bounded it.

    ``num_blocks`` given wins as is; otherwise ``available_bytes`` (default: asked of the
    system, and only then) caps the size, at the bytes per token of the pool's storage
    (``quant``: quantized, so more blocks fit). Raises ValueError for a bad
    memory_fraction.
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"kv_memory_fraction={memory_fraction} must be in (0, 1]")
    if quant is not None:
        quant.check(spec.head_dim)
    block_bytes = kv_bytes_per_token(spec, quant) * block_size
    storage = quant.describe() if quant is not None else f"{dtype_name(spec.dtype)} KV"

    def plan(blocks: int, bound: PoolBound, why: str) -> PoolPlan:
        return PoolPlan(blocks, block_size, block_bytes, bound, why, storage)

    if num_blocks is not None:
        return plan(num_blocks, PoolBound.SET, f"num_kv_blocks = {num_blocks}")
    one = sequence_blocks(max_model_len, block_size)
    wanted = max_num_seqs * -(-tokens_per_seq // block_size)
    bound = PoolBound.BUDGET
    why = f"max_num_seqs {max_num_seqs} x kv_tokens_per_seq {tokens_per_seq}"
    if wanted < one:
        wanted, bound = one, PoolBound.ONE_SEQUENCE
        why = f"one sequence at max_model_len {max_model_len}"
    elif wanted > max_num_seqs * one:
        wanted, bound = max_num_seqs * one, PoolBound.ALL_SEQUENCES
        why = f"all {max_num_seqs} sequences at max_model_len {max_model_len}"
    free = available_memory_bytes() if available_bytes is None else available_bytes
    by_memory = int(free * memory_fraction) // block_bytes
    if by_memory < wanted:
        bound = PoolBound.MEMORY
        why = (
            f"kv_memory_fraction {memory_fraction} of {free / 2**30:.1f} GiB available "
            f"(wanted {wanted} blocks: {why})"
        )
    blocks = min(wanted, by_memory)
    if blocks < MIN_BLOCKS:
        blocks, bound, why = MIN_BLOCKS, PoolBound.MINIMUM, f"the minimum ({why})"
    return plan(blocks, bound, why)


def size_pool(
    spec: ModelSpec,
    *,
    block_size: int,
    memory_fraction: float,
    max_num_seqs: int,
    max_model_len: int,
    tokens_per_seq: int = DEFAULT_TOKENS_PER_SEQ,
    num_blocks: int | None = None,
    available_bytes: int | None = None,
    quant: KVQuant | None = None,
) -> int:
    """Blocks for the pool (see plan_pool), logged with what bounded them (call it once,
    at start), with a warning when one sequence at ``max_model_len`` would not fit."""
    plan = plan_pool(
        spec,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        tokens_per_seq=tokens_per_seq,
        memory_fraction=memory_fraction,
        num_blocks=num_blocks,
        available_bytes=available_bytes,
        quant=quant,
    )
    log.info(
        "KV pool: %d blocks of %d tokens = %d tokens, %.1f MiB (%s, %d bytes a token); from %s",
        plan.blocks,
        plan.block_size,
        plan.tokens,
        plan.mib,
        plan.storage,
        plan.block_bytes // plan.block_size,
        plan.why,
        extra={
            "event": "kv_pool",
            "blocks": plan.blocks,
            "tokens": plan.tokens,
            "mib": round(plan.mib, 1),
            "bound": plan.bound.value,
            "kv_bits": quant.bits if quant is not None else None,
        },
    )
    if plan.blocks < sequence_blocks(max_model_len, block_size):
        log.warning(
            "KV pool holds %d tokens, fewer than max_model_len %d: a request whose prompt "
            "+ max_tokens needs more is refused; lower engine.max_model_len or give the "
            "pool more room",
            plan.tokens,
            max_model_len,
            extra={"event": "kv_pool_short"},
        )
    return plan.blocks
