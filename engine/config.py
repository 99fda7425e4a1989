"""Engine limits and policies: the documented options of the scheduler and KV pool.

This dataclass is the one definition of the engine's options: the daemon's
settings (``batchd.config.settings.Settings.engine``) validate TOML and environment
values straight into it, so the engine never depends on the settings
machinery and no option is written twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DTYPES = ("float32", "float16", "bfloat16")
# What a job may name (the wire schema's NAME_PATTERN; producers are not imported here).
ADAPTER_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)
SPECULATIVE = ("off", "ngram", "draft")
# The forward backends and samplers (batchd.engine.forward.backend; not imported here:
# this module loads no MLX).
FORWARD_BACKENDS = ("auto", "mlx", "native_cpu")
SAMPLERS = ("auto", "device", "host")


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

    kv_bits: int | None = None
    """KV-cache quantization: None stores K/V in the model's dtype; 8 or 4 stores them
    group-wise quantized as mlx-lm's QuantizedKVCache does: bits/8 bytes a value plus a
    scale and a bias (in the model's dtype) per kv_group_size values, instead of the
    dtype's 2 or 4 bytes a value, so the automatic pool holds that many more tokens
    within kv_memory_fraction. Costs some accuracy (8 bits: small; 4 bits: much more)
    and, on a CPU, the C attention and products (the MLX path runs).
    docs/performance.md, "KV-cache quantization"."""

    kv_group_size: int = 64
    """Values sharing one scale and bias when kv_bits is set: 32, 64 or 128; must divide
    the model's head_dim (checked at load)."""

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

    speculative: str = "off"
    """Speculative decoding: ``off``, ``ngram`` (prompt lookup: a decoding row's
    next tokens are proposed from where its last tokens occurred earlier in its prompt
    and output, and verified in the same forward as the other rows) or ``draft`` (a
    smaller model of the same tokenizer, speculative_draft_model, proposes them
    greedily). Outputs are the same either way, token for token; ngram pays where
    outputs copy their prompt (extraction, editing). A request may opt out
    (``SamplingParams.speculative`` False) or in (True, even when this is off: then
    ngram). docs/engine.md, "Speculative decoding"."""

    speculative_draft_model: str | None = None
    """The draft model of ``speculative = "draft"``: a model directory, hub id or preset
    name, loaded at start; its tokenizer must be the target's (refused at start
    otherwise). Unused by the other methods."""

    num_speculative_tokens: int = 4
    """Most tokens proposed per row and step with speculative decoding."""

    speculative_ngram_min: int = 2
    """Shortest suffix n-gram prompt lookup matches (it tries the longest first)."""

    speculative_ngram_max: int = 4
    """Longest suffix n-gram prompt lookup matches."""

    speculative_max_decode_rows: int | None = 32
    """Proposed tokens join a step only while its decode rows (one per decoding sequence
    plus the proposed tokens) stay within this many; None: no bound. A verified
    position costs a row of compute whether it is accepted or not: nearly free while a
    step is bound by reading the weights (few rows), a cost once it is bound by compute
    (many rows on a CPU), where a wrong proposal slows every row of the step."""

    adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapters served: name -> adapter directory (mlx-lm's ``adapter_config.json``
    and ``adapters.safetensors``, or PEFT's ``adapter_model.safetensors``). A job names
    one in its ``adapter`` field; the gateway serves it as model ``<model>:<name>``.
    Each is read at start (a broken one stops the start, named). docs/adapters.md."""

    max_resident_adapters: int = 8
    """Most adapters kept loaded; another one named by a request is loaded again,
    evicting the least recently used one no running request uses (one in use is
    never evicted: the cache may then hold more, until they finish)."""

    forward_backend: str = "auto"
    """What computes a step's logits: ``mlx`` (MLX ops on MLX's device: Metal, CUDA or
    the CPU), ``native_cpu`` (the C kernels: an x86 CPU, float32 models, a float KV
    pool; refused at start where they cannot run) or ``auto`` (native_cpu where it
    can run and ``BATCHD_NATIVE_ATTENTION`` is not 0, else mlx). The choice and why are
    logged at start and shown by ``batchd doctor``. docs/engine.md, "Forward backends"."""

    sampler: str = "auto"
    """Where a step's logits are sampled: ``device`` (MLX ops where the logits are, one
    wait a step for the chosen ids), ``host`` (the logits copied out and sampled with
    NumPy, the engine's earlier way) or ``auto`` (device for the mlx backend, host for
    native_cpu). Seeded draws may differ between the two at a near-tie (docs/engine.md,
    "Forward backends")."""

    async_scheduling: bool = False
    """Launch each decode step before the host reads the previous step's sampled ids
    (mlx-lm's pipelining): while step N computes, step N+1 is scheduled as if no row
    stops and fed step N's ids on the device; a row that stopped at N wastes its row of
    N+1. Steps with prompts, grammars, penalties, speculative decoding or prompt
    logprobs run synchronously. Needs the mlx backend and the device sampler (logged
    and off otherwise). Seeded draws depend on (seed, position) only, so tokens are the
    synchronous step's; a request arriving while a step is in flight joins a step later.
    docs/engine.md, "Async scheduling"."""

    def __post_init__(self) -> None:
        backend = self.forward_backend
        _require(
            "forward_backend", backend, backend in FORWARD_BACKENDS, f"one of {FORWARD_BACKENDS}"
        )
        _require("sampler", self.sampler, self.sampler in SAMPLERS, f"one of {SAMPLERS}")
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
        bits = self.kv_bits
        _require("kv_bits", bits, bits is None or bits in KV_BITS, f"None or one of {KV_BITS}")
        group = self.kv_group_size
        _require("kv_group_size", group, group in KV_GROUP_SIZES, f"one of {KV_GROUP_SIZES}")
        _require("aging_rate", self.aging_rate, self.aging_rate >= 0, ">= 0")
        resident = self.max_resident_adapters
        _require("max_resident_adapters", resident, _positive_int(resident), ">= 1")
        _require(
            "adapters",
            self.adapters,
            all(isinstance(n, str) and re.fullmatch(ADAPTER_NAME, n) for n in self.adapters),
            f"a mapping of names ({ADAPTER_NAME}) to adapter directories",
        )
        length = self.max_model_len
        _require("max_model_len", length, length is None or _positive_int(length), "None or >= 1")
        _require(
            "dtype", self.dtype, self.dtype is None or self.dtype in DTYPES, f"one of {DTYPES}"
        )
        _require(
            "speculative",
            self.speculative,
            self.speculative in SPECULATIVE,
            f"one of {SPECULATIVE}",
        )
        draft = self.speculative_draft_model
        _require(
            "speculative_draft_model",
            draft,
            (draft is None or (isinstance(draft, str) and draft != ""))
            and (draft is not None or self.speculative != "draft"),
            'a model (directory, hub id or preset name), set when speculative = "draft"',
        )
        k = self.num_speculative_tokens
        _require("num_speculative_tokens", k, _positive_int(k), ">= 1")
        rows = self.speculative_max_decode_rows
        _require(
            "speculative_max_decode_rows", rows, rows is None or _positive_int(rows), "None or >= 1"
        )
        low, high = self.speculative_ngram_min, self.speculative_ngram_max
        _require("speculative_ngram_min", low, _positive_int(low), ">= 1")
        _require(
            "speculative_ngram_max",
            high,
            _positive_int(high) and high >= low,
            f">= speculative_ngram_min ({low})",
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
