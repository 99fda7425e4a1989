"""Engine limits and policies: the documented options of the scheduler and KV pool.

This dataclass is the one definition of the engine's options: the daemon's
settings (``batchd.config.settings.Settings.engine``) validate TOML and environment
values straight into it, so the engine never depends on the settings
machinery and no option is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(kw_only=True)
class EngineConfig:
    """Options of one engine (all keyword-only). Raises ValueError naming the field."""

    max_num_seqs: int = 32
    """Most sequences running at once (the decode batch). Must be <= max_num_batched_tokens,
    so every running sequence can decode in every step."""

    max_num_batched_tokens: int = 512
    """Token budget of one step: one token per decode first, prefill chunks fill the rest."""

    max_prefill_tokens_with_decodes: int | None = None
    """Most prefill tokens in a step while sequences are decoding; None: no bound beyond
    max_num_batched_tokens. A step's time grows with its prefill tokens and every running
    decode waits for it, so a small bound (e.g. 32) keeps inter-token latency even under
    arriving prompts, at some cost in time to first token and throughput. With no decode
    running the whole budget goes to prefill. Needs enable_chunked_prefill. The bound
    is raised to fill the row tile (see prefill_fills_row_tile)."""

    prefill_fills_row_tile: bool = True
    """While max_prefill_tokens_with_decodes applies, raise it so that a step's rows
    (its decodes and prefill tokens) fill the row tile they reach: the linear layers
    compute rows in tiles (8 rows with batchd's C products on AVX-512 CPUs, 6 on AVX2,
    16 with MLX's on a CPU from 4 rows up), so rows up to the tile's end cost little
    more and prompts reach their first token
    sooner. Off: the bound as set."""

    block_size: int = 16
    """Tokens per KV-cache block (the paging and prefix-cache granularity)."""

    num_kv_blocks: int | None = None
    """KV pool size in blocks, allocated at start; None: sized from the model and
    kv_tokens_per_seq: max_num_seqs x kv_tokens_per_seq tokens, at least one sequence
    at max_model_len (so every request max_model_len admits can run), at most every
    sequence at max_model_len (more would never be used), and never more than
    kv_memory_fraction of available memory. The size and what bounded it are logged
    at start. A pool smaller than one max_model_len sequence refuses longer requests."""

    kv_tokens_per_seq: int = 1024
    """Tokens of KV cache the automatic pool holds per running sequence, on average
    (see num_kv_blocks). Most jobs are far shorter than max_model_len, and when the
    pool runs out the scheduler preempts a sequence and recomputes it later, so the
    pool need not hold every sequence at full length. Each token takes layers x 2 x
    kv_heads x head_dim x dtype bytes (SmolLM2-135M in float32: 45 KiB, so the default
    32 x 1024 tokens is 1.4 GiB). Raise it for long prompts or outputs (a rising
    batchd_preemptions_total says so); lower it to start faster and use less memory."""

    kv_memory_fraction: float = 0.5
    """Most of available memory (Linux: MemAvailable; macOS: Metal's recommended working
    set) the automatically sized pool may take, as a fraction: a cap, not a target."""

    enable_chunked_prefill: bool = True
    """Split long prompts into chunks across steps so running decodes never stall. When off,
    a prompt is prefilled whole in one step, so a prompt longer than max_num_batched_tokens
    is rejected when added (a preempted sequence's recompute may still be chunked)."""

    enable_prefix_caching: bool = True
    """Reuse the KV blocks of identical prompt prefixes (hash chain over full blocks)."""

    enable_preemption: bool = True
    """When blocks run out, preempt the lowest-priority, most recently admitted running
    sequence (its KV is recomputed later). When off, a sequence is admitted only if the
    pool can hold the worst case (prompt + max_tokens) of every running sequence, so
    fewer run at once but none ever has to give its blocks back."""

    aging_rate: float = 0.1
    """Priority points a waiting request gains per second since it arrived (no starvation)."""

    max_model_len: int | None = None
    """Longest prompt + max_tokens accepted; None: the model's own context length."""

    dtype: str | None = None
    """Compute dtype override (float32, float16, bfloat16); None keeps the model's."""

    def __post_init__(self) -> None:
        _require("max_num_seqs", self.max_num_seqs, _positive_int(self.max_num_seqs), ">= 1")
        budget = self.max_num_batched_tokens
        _require("max_num_batched_tokens", budget, _positive_int(budget), ">= 1")
        _require(
            "max_num_batched_tokens",
            budget,
            budget >= self.max_num_seqs,
            f">= max_num_seqs ({self.max_num_seqs}) so every running sequence can decode",
        )
        bound = self.max_prefill_tokens_with_decodes
        _require(
            "max_prefill_tokens_with_decodes",
            bound,
            bound is None or _positive_int(bound),
            "None or >= 1",
        )
        _require(
            "max_prefill_tokens_with_decodes",
            bound,
            bound is None or self.enable_chunked_prefill,
            "None when enable_chunked_prefill is off (a whole prompt could wait forever)",
        )
        _require("block_size", self.block_size, _positive_int(self.block_size), ">= 1")
        blocks = self.num_kv_blocks
        _require("num_kv_blocks", blocks, blocks is None or _positive_int(blocks), "None or >= 1")
        per_seq = self.kv_tokens_per_seq
        _require("kv_tokens_per_seq", per_seq, _positive_int(per_seq), ">= 1")
        fraction = self.kv_memory_fraction
        _require("kv_memory_fraction", fraction, 0 < fraction <= 1, "in (0, 1]")
        _require("aging_rate", self.aging_rate, self.aging_rate >= 0, ">= 0")
        length = self.max_model_len
        _require("max_model_len", length, length is None or _positive_int(length), "None or >= 1")
        _require(
            "dtype", self.dtype, self.dtype is None or self.dtype in DTYPES, f"one of {DTYPES}"
        )

    def room(self, *, held: int, queue: int) -> int:
        """The one capacity rule: how many more sequences a caller may hand the engine.

        A running slot for each of max_num_seqs, plus ``queue`` more kept waiting so
        that a slot that frees is refilled at once rather than after the caller's next
        read, less the ``held`` sequences handed over (or about to be) and not yet
        ended. A request of n samples holds n. Negative when more are held.
        """
        return self.max_num_seqs + queue - held


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _require(field: str, value: object, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{field} must be {rule}, got {value!r}")
