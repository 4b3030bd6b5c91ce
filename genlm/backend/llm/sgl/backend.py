"""SGLang backend: next-token log-probabilities from an in-process SGLang scheduler.

The scheduler runs in this process, driven one step at a time by
`SchedulerDriver` (see `genlm.backend.llm.sgl.scheduler_driver`). Every query
is a one-token request whose full-vocabulary logits are read from the batch
result; SGLang's radix prefix cache keeps its tokens, so a later request
extending the same context only prefills its new tokens.

LoRA adapters are loaded into a scheduler built with `enable_lora=True` through
`Scheduler.load_lora_adapter(LoadLoRAAdapterReqInput)` (and unloaded with
`unload_lora_adapter`), after the work in progress is finished; each request
names its adapter by `lora_id` (`None`: the base model). SGLang batches
requests of different adapters together and keeps their cached prefixes apart.
"""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from genlm.backend.batching import AutoBatcher
from genlm.backend.cache import OutputCache
from genlm.backend.llm.base import AsyncLM, check_token_ids, with_default_output_cache
from genlm.backend.llm.sgl.scheduler_driver import (
    Query,
    SchedulerDriver,
    build_scheduler,
    import_sglang_requests,
)

# The driver reads logits synchronously from `run_batch`, which the overlap scheduler
# does not allow; everything else keeps SGLang's defaults.
DEFAULT_ENGINE_OPTS: dict[str, Any] = {"disable_overlap_schedule": True}


class AsyncSGLTransformer(AsyncLM):
    """Next-token log-probabilities from an in-process SGLang scheduler.

    Concurrent `next_token_logprobs` awaits are queued and handed to the
    scheduler together; a context whose request is already in flight is not
    submitted again (its callers share the result). Requests run one scheduler
    step at a time, yielding to the event loop in between.

    Every query method takes `lora_name=None`: `None` uses the adapter made
    active by `set_lora` (the base model when none is), a registered adapter's
    name uses that adapter for this call only. Requests of different adapters
    are handed to the scheduler together; results are cached per adapter. A
    call whose adapter is removed (or replaced) while it waits fails alone,
    with a `ValueError` naming the adapter.

    If the scheduler dies (see `scheduler_driver`), every call waiting on it
    and every later call that needs it (queries, `sample`, adapter and
    prefix-cache operations) raises `EngineDeadError`, without touching it
    again. `cleanup()` (or leaving a `with` block) lets go of the scheduler.

    Args:
        sgl_model: An SGLang `Scheduler` (see `from_name`), built with
            `disable_overlap_schedule=True` and its tokenizer loaded. This object
            drives it from now on.
        cache_size: Entries of the output cache (`0`: no cache; `from_name`
            turns it on, bounded in bytes).
        cache_opts: Further `OutputCache` options (e.g. `move_to_cpu`, `max_bytes`).

    Raises:
        ImportError: If SGLang is not installed.
        ValueError: If the scheduler has no tokenizer or uses the overlap scheduler.

    Attributes:
        sgl_model: The scheduler (also `model`, its name in 0.3.x).
        vocab_size: Length of a logprobs row: the tokenizer's length (see `AsyncLM`).
        device: Where rows live: the scheduler's device.
    """

    def __init__(
        self, sgl_model: Any, cache_size: int = 0, cache_opts: dict[str, Any] | None = None
    ):
        request_types = import_sglang_requests()
        if getattr(sgl_model, "tokenizer", None) is None:
            raise ValueError("the SGLang scheduler has no tokenizer: leave skip_tokenizer_init off")
        if getattr(sgl_model, "enable_overlap", False):
            raise ValueError(
                "the SGLang scheduler must be built with disable_overlap_schedule=True"
            )
        super().__init__(sgl_model.tokenizer)
        self.sgl_model = sgl_model
        self.device = _scheduler_device(sgl_model)
        self.vocab_size = len(self.byte_vocab)
        # Ids a context may hold: the tokenizer's, less those past the model's embeddings.
        self._id_bound = min(self.vocab_size, sgl_model.model_config.vocab_size)
        # SGLang rejects prompts of `max_req_input_len` tokens or more.
        max_input = getattr(sgl_model, "max_req_input_len", None)
        self.max_length = None if max_input is None else max_input - 1
        self.cache = OutputCache(maxsize=cache_size, **(cache_opts or {}))
        self._driver = SchedulerDriver(sgl_model, request_types, self.vocab_size)
        self._adapter_names: dict[str, str] = {}  # lora_id -> name, of every adapter loaded
        self._engine_task: asyncio.Task | None = None
        self._closed = False
        # Requests go to the running scheduler at the next pass of the event loop, all
        # at once; SGLang splits them into batches itself (max_running_requests).
        self._batcher = AutoBatcher(self._evaluate, timeout=0.0, key=lambda q: q)

    @classmethod
    def from_name(
        cls,
        model_id: str,
        engine_opts: dict[str, Any] | None = None,
        gpu_id: int = 0,
        **kwargs: Any,
    ) -> AsyncSGLTransformer:
        """Build an in-process SGLang scheduler for `model_id`.

        Args:
            model_id: Hub name or local folder of the model.
            engine_opts: `ServerArgs` fields overriding `DEFAULT_ENGINE_OPTS`
                (for LoRA adapters: `enable_lora=True`, `max_lora_rank`,
                `lora_target_modules`, and optionally `max_loras_per_batch`).
            gpu_id: The GPU the scheduler runs on.
            **kwargs: Passed to the constructor (`cache_size`, `cache_opts`).
                Unless `cache_size` is given, the output cache is on, bounded
                by `cache_opts["max_bytes"]` (default 256 MiB, as
                `AsyncTransformer`'s).

        Returns:
            The backend, owning the new scheduler.

        Raises:
            ImportError: If SGLang is not installed.
        """
        options = {**DEFAULT_ENGINE_OPTS, **(engine_opts or {})}
        scheduler = build_scheduler(model_id, options, gpu_id)
        return cls(scheduler, **with_default_output_cache(kwargs))

    @property
    def model(self) -> Any:
        """The SGLang scheduler (`sgl_model`), by its 0.3.x name."""
        return self.sgl_model

    def _query(self, token_ids: Sequence[int], lora_name: str | None) -> Query:
        self._check_open()
        adapter = self.loras.select(lora_name)
        lora_id = None if adapter is None else self.loras[adapter]
        return lora_id, check_token_ids(token_ids, self._id_bound, self.max_length)

    async def _evaluate(self, queries: list[Query]) -> list[torch.Tensor | BaseException]:
        # A query whose adapter was removed while it waited gets an error of its own;
        # SGLang would be sent an adapter it no longer holds.
        loaded = {self.loras[name] for name in self.loras.names}
        outcomes: list[torch.Tensor | BaseException | None] = [
            self.loras.removed_error(self._adapter_names.get(lora_id, lora_id))
            if lora_id is not None and lora_id not in loaded
            else None
            for lora_id, _ in queries
        ]
        live = [query for query, outcome in zip(queries, outcomes, strict=True) if outcome is None]
        if not live:
            return outcomes
        self._engine_task = asyncio.current_task()
        try:
            rows = iter(await self._driver.run_async(live))
        finally:
            self._engine_task = None
        outcomes = [next(rows) if outcome is None else outcome for outcome in outcomes]
        self._cache_rows(queries, outcomes)
        return outcomes

    def _cache_rows(
        self, queries: Sequence[Query], rows: Sequence[torch.Tensor | BaseException]
    ) -> None:
        # An adapter replaced or removed while its requests ran leaves nothing cached.
        loaded = {self.loras[name] for name in self.loras.names}
        kept = [
            i
            for i, (query, row) in enumerate(zip(queries, rows, strict=True))
            if isinstance(row, torch.Tensor) and (query[0] is None or query[0] in loaded)
        ]
        if kept:
            self.cache.store_rows([queries[i] for i in kept], [rows[i] for i in kept])

    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token, batched with concurrent calls.

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 1-D float32 tensor of `vocab_size` log-probabilities on `device`
            (see `AsyncLM`), owned by the caller.

        Raises:
            ValueError: For bad token ids (see `check_token_ids`), an unknown
                `lora_name`, or an adapter removed while the query waited.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the scheduler died, before or while the query waited.
            asyncio.CancelledError: If `reset_async_queries()` dropped the query.
        """
        query = self._query(token_ids, lora_name)
        cached = self.cache.get(query)
        if cached is not None:
            return cached
        return await self._batcher.submit(query)

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Synchronous `next_token_logprobs` (works inside a running event loop too).

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 1-D float32 tensor of `vocab_size` log-probabilities on `device`
            (see `AsyncLM`), owned by the caller.

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the scheduler died.
        """
        return self.batch_next_token_logprobs_sync([token_ids], lora_name=lora_name)[0]

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Next-token log-probabilities of several contexts in one scheduler run.

        Contexts found in the output cache are not recomputed.

        Args:
            token_ids_list: The contexts (may be empty).
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 2-D tensor, one row per context, in input order (`(0, vocab_size)`
            for no context).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
            RuntimeError: After `cleanup()`.
            EngineDeadError: If the scheduler died.
        """
        self._check_open()
        queries = [self._query(ids, lora_name) for ids in token_ids_list]
        if not queries:
            self.loras.select(lora_name)
            return torch.empty((0, self.vocab_size))
        rows = {q: self.cache[q] for q in dict.fromkeys(queries) if q in self.cache}
        missing = [q for q in dict.fromkeys(queries) if q not in rows]
        if missing:
            computed = self._driver.run(missing)
            self._cache_rows(missing, computed)
            rows.update(zip(missing, computed, strict=True))
        return torch.stack([rows[q] for q in queries])

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Load a LoRA adapter into the scheduler under `lora_name` (it is not activated).

        The scheduler first finishes the work in progress; SGLang then flushes
        its prefix cache.

        Args:
            lora_path: Folder of a PEFT LoRA adapter.
            lora_name: Name to select it by (`set_lora`, or `lora_name=` per
                call). Loading an adapter under a name in use unloads the old
                one and drops its cached results first (an active name stays
                active; calls still queued for the old one fail, see `remove_lora`).

        Raises:
            ValueError: If the scheduler was built without LoRA support.
            RuntimeError: If SGLang fails to load the adapter (the name is then
                unregistered, even if it named an adapter before), or after `cleanup()`.
            EngineDeadError: If the scheduler died.
        """
        self._check_open()
        if not getattr(self.sgl_model.server_args, "enable_lora", False):
            raise ValueError(
                "the SGLang scheduler was built without LoRA support: pass engine_opts="
                "{'enable_lora': True, 'max_lora_rank': <rank>, 'lora_target_modules': "
                "[...]} to from_name (and 'max_loras_per_batch' to batch more adapters)"
            )
        if lora_name in self.loras:
            self._unload(lora_name, self.loras[lora_name])
        lora_id = uuid.uuid4().hex
        self._adapter_names[lora_id] = lora_name
        result = self._driver.load_lora(lora_name, lora_path, lora_id)
        if not result.success:
            if lora_name in self.loras:
                self.loras.remove(lora_name)
            raise RuntimeError(
                f"SGLang could not load LoRA adapter {lora_name!r} from {lora_path!r}: "
                f"{result.error_message}"
            )
        self.loras.add(lora_name, lora_id)

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        """Activate an adapter, loading it from `lora_path` first if it is new.

        Args:
            lora_path: Folder of the adapter; needed only if `lora_name` was not added.
            lora_name: The adapter that calls with `lora_name=None` use from now on.

        Raises:
            ValueError: If `lora_name` was never added and no `lora_path` is given.
        """
        if lora_name not in self.loras and lora_path is not None:
            self.add_new_lora(lora_path, lora_name)
        self.loras.active = self.loras.check(lora_name)

    def clear_lora(self) -> None:
        """Deactivate LoRA adapters: calls with `lora_name=None` use the base model."""
        self.loras.active = None

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter from the scheduler and drop its cached results.

        Its requests already in the scheduler finish first. Calls for it still
        queued in this backend fail with a `ValueError` naming the adapter
        (they never reach SGLang); calls batched with them are served.

        Args:
            lora_name: A registered adapter (if active, the base model becomes active).

        Raises:
            ValueError: If no adapter is registered under `lora_name`.
            RuntimeError: If SGLang fails to unload it (it is unregistered anyway), or
                after `cleanup()`.
            EngineDeadError: If the scheduler died.
        """
        self._check_open()
        self._unload(lora_name, self.loras.remove(lora_name))

    def _unload(self, lora_name: str, lora_id: str) -> None:
        self.cache.remove_if(lambda query: query[0] == lora_id)
        result = self._driver.unload_lora(lora_name, lora_id)
        if not result.success:
            raise RuntimeError(
                f"SGLang could not unload LoRA adapter {lora_name!r}: {result.error_message}"
            )

    def clear_cache(self) -> None:
        """Drop the output cache and flush SGLang's prefix (KV) cache.

        Raises:
            EngineDeadError: If the scheduler died (the output cache is dropped anyway).
        """
        self.cache.clear()
        self.clear_kv_cache()

    def clear_kv_cache(self) -> None:
        """Flush SGLang's radix prefix cache (after finishing the work in progress).

        Raises:
            RuntimeError: If SGLang refuses to flush, or after `cleanup()`.
            EngineDeadError: If the scheduler died.
        """
        self._check_open()
        self._driver.flush_prefix_cache()

    def cleanup(self) -> None:
        """Let go of the scheduler; later calls raise `RuntimeError`.

        Waiting callers are cancelled and the scheduler's work in progress is
        finished first. Works after the scheduler died too. SGLang itself keeps
        what it built in this process: its model and memory pools are freed
        when the process exits (SGLang 0.5.18 on the CPU: no child process and
        no thread but its daemon watchdog is left, and the process exits
        normally).
        """
        if self._closed:
            return
        self._closed = True
        self.reset_async_queries()
        self.cache.clear()
        self._driver.close()
        self.sgl_model = None
        gc.collect()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncSGLTransformer was cleaned up; create a new one")
        self._driver.check_alive()

    def reset_async_queries(self) -> None:
        """Cancel every waiting caller and the batch being computed.

        The scheduler finishes the requests it already holds (their results are
        dropped), so it is idle and usable afterwards.
        """
        self._batcher.reset()
        task = self._engine_task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()


def _scheduler_device(scheduler: Any) -> torch.device:
    """The device a scheduler computes its rows on: its server arguments' device type (the
    CUDA GPU `gpu_id` for `cuda`; without one, CUDA where it is available)."""
    device = getattr(getattr(scheduler, "server_args", None), "device", None)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", getattr(scheduler, "gpu_id", 0))
    return torch.device(device)
