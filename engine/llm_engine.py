"""LLMEngine: requests in, one scheduler step + one packed forward per step(), tokens out.

A plain library object with no threads: every call, abort included, must come
from the thread that owns it (MLX streams are thread-local).

    eng = LLMEngine.from_pretrained(path, EngineConfig(max_num_seqs=32))
    eng.add_request("r1", prompt="Hello", params=SamplingParams(max_tokens=64))
    while eng.has_unfinished():
        for out in eng.step():
            ...
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

from batchd.engine.adapters.resident import AdapterCache
from batchd.engine.async_step import async_steps
from batchd.engine.config import EngineConfig
from batchd.engine.constraints import GrammarTokenizer
from batchd.engine.detokenizer import TokenTexts, special_token_ids
from batchd.engine.forward import kv_quant
from batchd.engine.forward.backend import choose as choose_backend
from batchd.engine.forward.cuda_paged import KernelShape
from batchd.engine.forward.generic_runner import GenericRunner
from batchd.engine.forward.kv_pool import KVPool, size_pool
from batchd.engine.forward.model_runner import ModelRunner
from batchd.engine.models.loader import LoadedModel, load
from batchd.engine.outputs import RequestOutput, StepStats
from batchd.engine.prompt import encode_prompt
from batchd.engine.request_state import RequestState
from batchd.engine.requests import intake
from batchd.engine.requests.outputs import emit, keep_prompt_logprobs, prompt_targets, token_output
from batchd.engine.sampling.rows import may_speculate, sample_rows
from batchd.engine.sampling.samplers import make_sampler
from batchd.engine.sampling_params import SamplingParams
from batchd.engine.scheduling.schedule import SchedulerOutput
from batchd.engine.scheduling.scheduler import Scheduler
from batchd.engine.scheduling.sequence import FinishReason
from batchd.engine.scheduling.sequence import Sequence as Seq
from batchd.engine.scheduling.stats import step_stats
from batchd.engine.speculative import DraftProposer, NgramProposer
from batchd.engine.speculative.choose import choose_proposer

__all__ = ["LLMEngine", "RequestOutput", "StepStats"]

log = logging.getLogger(__name__)

# Used when neither the config nor the model states a context length.
DEFAULT_MAX_MODEL_LEN = 4096


class LLMEngine:
    """Continuous-batching generation over a paged KV pool.

    How to use it as a library: docs/engine.md, "The engine as a library".
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.spec = loaded.spec
        self.max_model_len = (
            config.max_model_len or loaded.spec.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        )
        quant = kv_quant.from_options(config.kv_bits, config.kv_group_size)
        num_blocks = size_pool(
            loaded.spec,
            block_size=config.block_size,
            memory_fraction=config.kv_memory_fraction,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            tokens_per_seq=config.kv_tokens_per_seq,
            num_blocks=config.num_kv_blocks,
            quant=quant,
        )
        self.pool = KVPool(
            loaded.spec, num_blocks=num_blocks, block_size=config.block_size, quant=quant
        )
        # The forward backend and where its logits are sampled, chosen once (docs/engine.md,
        # "Forward backends").
        self.backend = choose_backend(
            config.forward_backend,
            config.sampler,
            dtype=loaded.spec.dtype,
            quantized_kv=quant is not None,
            generic=loaded.spec.generic,
            shape=KernelShape(
                loaded.spec.num_heads, loaded.spec.num_kv_heads, loaded.spec.head_dim
            ),
        )
        log.info("forward backend: %s", self.backend.describe())
        self.sampler = make_sampler(self.backend.sampler)
        # The specialised runner for the families it covers, mlx-lm's own forward otherwise.
        self.runner: ModelRunner | GenericRunner = (
            GenericRunner(loaded.model, loaded.spec, self.pool)
            if loaded.spec.generic
            else ModelRunner(loaded.model, loaded.spec, self.pool, backend=self.backend)
        )
        self.scheduler = Scheduler(
            config,
            num_blocks=num_blocks,
            max_model_len=self.max_model_len,
            computed_rows=self.runner.computed_rows,
            kv_window=loaded.spec.kv_window,
            propose=self._propose,
        )
        # Speculative decoding (docs/engine.md, "Speculative decoding").
        self.proposer: NgramProposer | DraftProposer
        self.proposer, proposes = choose_proposer(config, loaded)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        if config.speculative != "off":
            log.info(
                "speculative decoding: %s (%s), up to %d tokens a row, decode rows <= %s",
                config.speculative,
                proposes,
                config.num_speculative_tokens,
                config.speculative_max_decode_rows,
            )
        # LoRA adapters (docs/adapters.md), read now: a broken one fails at start.
        self.adapters = AdapterCache(
            loaded.model, max_resident=config.max_resident_adapters, in_use=self._adapters_in_use
        )
        for name, path in config.adapters.items():
            self.adapters.register(name, path)
        self.runner.adapters = self.adapters
        self.eos_token_ids = frozenset(int(t) for t in self.tokenizer.eos_token_ids)
        self.grammar_tokenizer = GrammarTokenizer(
            self.tokenizer, loaded.spec.vocab_size, self.eos_token_ids
        )
        self.special_token_ids = special_token_ids(self.tokenizer)
        self._token_texts = TokenTexts(self.tokenizer)
        self.last_step_stats: StepStats = StepStats(step=0, kv_blocks_total=num_blocks)
        # request id -> its live samples by sample index (insertion order: oldest first)
        self._live: dict[str, dict[int, Seq]] = {}
        # sequence id -> the output side of that sample
        self._states: dict[str, RequestState] = {}
        # sequence id -> its prompt's logprobs so far (samples that asked, until delivered)
        self._prompt_logprobs: dict[str, list[float]] = {}
        self._num_steps = 0
        self._rng = random.Random()
        self._async = async_steps(self)  # None: every step synchronous

    @classmethod
    def from_pretrained(
        cls, path_or_repo: str | Path, config: EngineConfig | None = None
    ) -> LLMEngine:
        """Load a local model directory or hub id (any architecture mlx-lm serves whose
        layers keep attention K/V; see batchd.engine.models.loader)."""
        return cls(load(path_or_repo, dtype=config.dtype if config else None), config)

    # -- requests --------------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        """Requests with a live sample."""
        return len(self._live)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def add_request(
        self,
        request_id: str,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
        resume_output_token_ids: Sequence[int] = (),
        sample: int = 0,
        adapter: str | None = None,
    ) -> FinishReason | None:
        """Queue a request given exactly one of prompt / prompt_token_ids / messages.

        ``resume_output_token_ids`` are outputs a previous run of the same request
        already delivered (with the text this engine gave them): they are not
        emitted again, count toward max_tokens, seeded sampling continues at the
        next position, and the text that run still held back (half a character,
        a possible start of a stop string) comes with the next output, so the
        texts and tokens match an uninterrupted run. Returns None once queued, or
        the finish reason (stop, length) when those outputs already end the
        request: then nothing is queued. Raises InvalidRequest on bad input, and
        ValueError for a sample already running (the caller's bookkeeping, not the
        request).

        ``sample`` > 0 adds another sample of the request (one of its n sequences: a
        job with ``n`` > 1) with the same prompt, its own ``params`` (its own seed)
        and its own resumed outputs. While an earlier sample of the request is live,
        the new one is admitted only once that one has computed the full KV blocks of
        their common prefix, and takes them from the prefix cache instead of
        computing them again (with prefix caching on). Outputs name their sample
        (``RequestOutput.sample``); ``abort`` drops every sample of the request.

        ``adapter`` names a registered LoRA adapter the request runs with (None: the
        base model); one that is not registered raises InvalidRequest.
        """
        params = params or SamplingParams()
        live = self._live.get(request_id, {})
        if sample in live:
            raise ValueError(f"request {request_id!r} sample {sample} is already running")
        ids = encode_prompt(
            self.tokenizer,
            request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
        )
        if adapter is not None:
            self.adapters.acquire(adapter, request_id)
        resumed = [int(t) for t in resume_output_token_ids]
        state = intake.request_state(self, request_id, ids, resumed, params, rng=self._rng)
        if resumed:
            finished = state.resume(resumed)
            if finished is not None:
                return finished
        seq = intake.sequence(
            request_id, state, ids, resumed, sample=sample, priority=priority, adapter=adapter
        )
        leader = next(iter(live.values()), None)
        if leader is not None and self.config.enable_prefix_caching:
            seq.follow(leader, block_size=self.config.block_size)
        self.scheduler.add(seq)
        self._live.setdefault(request_id, {})[sample] = seq
        self._states[seq.seq_id] = state
        if params.prompt_logprobs:
            self._prompt_logprobs[seq.seq_id] = [0.0] * (seq.num_prompt_tokens - 1)
        return None

    def abort(self, request_id: str) -> bool:
        """Drop every sample of a request now, freeing their KV blocks; False if none
        was live."""
        samples = self._live.pop(request_id, {})
        for seq in samples.values():
            self._prompt_logprobs.pop(seq.seq_id, None)
            self.proposer.drop(seq.seq_id)
            del self._states[seq.seq_id]
            self.scheduler.abort(seq.seq_id)
        return bool(samples)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward; the tokens it produced."""
        start = time.perf_counter()
        self._num_steps += 1
        if self._async is not None:
            return self._async.step(start)
        return self._run(self._schedule(), start)

    def _schedule(self) -> SchedulerOutput:
        scheduled = self.scheduler.schedule()
        for seq in scheduled.preempted:
            self.proposer.drop(seq.seq_id)  # its proposer state is rebuilt on resume
        return scheduled

    def _run(self, scheduled: SchedulerOutput, start: float) -> list[RequestOutput]:
        """A scheduled step, run synchronously: forward, sample, wait, emit."""
        if scheduled.is_empty:
            self.last_step_stats = self._stats(scheduled, start, 0.0, 0)
            return []
        sampling = [c for c in scheduled.chunks if c.samples]
        targets = prompt_targets(scheduled.chunks, self._prompt_logprobs)
        logits, scores = self.runner.execute_scored(scheduled.chunks, targets)
        outputs: list[RequestOutput] = []
        drafted = accepted = 0
        overlap_s = wait_s = 0.0
        if logits is None:
            forward_s = time.perf_counter() - start
            keep_prompt_logprobs(scheduled.chunks, scores, targets, self._prompt_logprobs)
            self.scheduler.update(scheduled, {})
        else:
            # Evaluation starts now; the host builds the step's sample rows (grammar
            # masks, penalties) while the device computes, then waits once.
            extra = list(scores.values())
            self.sampler.begin(logits, extra)
            launched = time.perf_counter()
            self.sampler.prepare(sample_rows(sampling, self._states, self.grammar_tokenizer))
            overlap_s = time.perf_counter() - launched
            samples = self.sampler.sample()
            wait_s = self.sampler.wait_s
            forward_s = time.perf_counter() - start
            keep_prompt_logprobs(scheduled.chunks, scores, targets, self._prompt_logprobs)
            outputs, drafted, accepted = emit(
                self.scheduler, scheduled, sampling, samples, self._output
            )
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.last_step_stats = self._stats(
            scheduled, start, forward_s, len(outputs), drafted, accepted, (overlap_s, wait_s)
        )
        return outputs

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[int]]:
        """Run prompts (token ids or text) to completion; generated ids, in order."""
        if isinstance(params, SamplingParams) or params is None:
            per = [params or SamplingParams()] * len(prompts)
        else:
            per = list(params)
        ids = [f"_generate-{self._num_steps}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, per, strict=True):
            if isinstance(prompt, str):
                self.add_request(rid, prompt=prompt, params=p)
            else:
                self.add_request(rid, prompt_token_ids=prompt, params=p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._live for rid in ids):
            for out in self.step():
                if out.request_id in results and out.error is None:
                    results[out.request_id].append(out.token_id)
        return [results[rid] for rid in ids]

    # -- internals -------------------------------------------------------------------------

    def _adapters_in_use(self) -> set[str]:
        """Adapters some live sample runs with: never evicted."""
        return {
            seq.adapter
            for samples in self._live.values()
            for seq in samples.values()
            if seq.adapter is not None
        }

    def _propose(self, seq: Seq, room: int) -> list[int]:
        """The scheduler's proposer: proposed tokens for a decoding row that may
        speculate (batchd.engine.sampling.rows.may_speculate), at most ``room``."""
        state = self._states.get(seq.seq_id)
        if state is None or not may_speculate(state, self.config.speculative):
            return []
        return self.proposer.propose(seq, room)

    def _output(
        self,
        seq: Seq,
        token_id: int,
        logprob: float,
        top: list[tuple[int, float]] | None,
    ) -> RequestOutput:
        """``seq``'s output for its next token; a sample it finishes leaves the engine."""
        out = token_output(
            seq,
            self._states[seq.seq_id],
            token_id,
            logprob,
            top,
            prompt_logprobs=self._prompt_logprobs.pop(seq.seq_id, None),
            token_texts=self._token_texts,
        )
        if out.finish_reason is not None:
            self.scheduler.finish(seq.seq_id, out.finish_reason)
            self.proposer.drop(seq.seq_id)
            del self._states[seq.seq_id]
            samples = self._live[seq.request_id]
            del samples[seq.sample]
            if not samples:
                del self._live[seq.request_id]
        return out

    def _stats(
        self,
        scheduled: SchedulerOutput,
        start: float,
        forward_s: float,
        num_outputs: int,
        drafted: int = 0,
        accepted: int = 0,
        overlap: tuple[float, float] = (0.0, 0.0),
    ) -> StepStats:
        """The step's stats, its speculative counts added to the engine's totals already."""
        return step_stats(
            self.scheduler,
            scheduled,
            step=self._num_steps,
            start=start,
            forward_s=forward_s,
            num_outputs=num_outputs,
            drafted=drafted,
            accepted=accepted,
            totals=(self.num_draft_tokens, self.num_accepted_tokens),
            overlap=overlap,
        )
