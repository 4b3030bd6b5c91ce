"""SGLang backend: next-token log-probabilities from an in-process SGLang scheduler.

SGLang's scheduler (`sglang.srt.managers.scheduler.Scheduler`, 0.5.x) runs an
event loop that repeats `recv_requests` -> `process_input_requests` ->
`get_next_batch_to_run` -> `run_batch` -> `process_batch_result`, setting
`cur_batch` before a batch runs and `last_batch` after it. This module drives
the same methods from the caller's thread, handing `TokenizedGenerateReqInput`s
straight to `process_input_requests` (no ZMQ). Every request asks for one
greedy token; its full-vocabulary next-token logits are read from the batch
result (`logits_output.next_token_logits`, one row per request in
`batch.reqs`) before `process_batch_result` finishes the request and inserts
its tokens into SGLang's radix prefix cache, so a later request extending the
same context only prefills its new tokens. Between calls the scheduler is left
idle (no waiting or running request).

LoRA adapters are loaded into a scheduler built with `enable_lora=True` through
`Scheduler.load_lora_adapter(LoadLoRAAdapterReqInput)` (and unloaded with
`unload_lora_adapter`), after the work in progress is finished; each request
names its adapter by `lora_id` (`None`: the base model). SGLang batches
requests of different adapters together and keeps their cached prefixes apart.

The scheduler runs in the caller's process, so it cannot die apart from it;
what can break it for good is a device error (`torch.AcceleratorError`: the
GPU context may be corrupted) or an error while the driver cleans up after a
failed batch (the scheduler's state is then unknown). Either makes every
waiting and every later call raise `EngineDeadError`; other errors of a batch
reach its callers and the scheduler stays usable.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from genlm.backend.batcher import AutoBatcher
from genlm.backend.cache import OutputCache
from genlm.backend.errors import EngineDeadError
from genlm.backend.llm.base import AsyncLM, check_token_ids, with_default_output_cache

_INSTALL_HINT = "the SGLang backend needs SGLang: pip install 'genlm-backend[sglang]'"

# The driver reads logits synchronously from `run_batch`, which the overlap scheduler
# does not allow; everything else keeps SGLang's defaults.
DEFAULT_ENGINE_OPTS: dict[str, Any] = {"disable_overlap_schedule": True}


def _import_sglang_requests() -> SimpleNamespace:
    try:
        from sglang.srt.managers.io_struct import (
            AbortReq,
            LoadLoRAAdapterReqInput,
            TokenizedGenerateReqInput,
            UnloadLoRAAdapterReqInput,
        )
        from sglang.srt.sampling.sampling_params import SamplingParams
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return SimpleNamespace(
        AbortReq=AbortReq,
        TokenizedGenerateReqInput=TokenizedGenerateReqInput,
        SamplingParams=SamplingParams,
        LoadLoRAAdapterReqInput=LoadLoRAAdapterReqInput,
        UnloadLoRAAdapterReqInput=UnloadLoRAAdapterReqInput,
    )


def _import_sglang_engine() -> SimpleNamespace:
    try:
        from sglang.srt import server_args
        from sglang.srt.managers.scheduler import Scheduler
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return SimpleNamespace(
        Scheduler=Scheduler,
        ServerArgs=server_args.ServerArgs,
        PortArgs=server_args.PortArgs,
        # Later 0.5.x releases read the server arguments from a process-wide slot
        # that SGLang's scheduler process fills before building its Scheduler.
        set_global_server_args=getattr(server_args, "set_global_server_args_for_scheduler", None),
    )


class _DiscardSink:
    """Replaces the scheduler's output sockets.

    In-process nobody reads them, and a ZMQ socket without a reader would queue
    every output in memory. Every `send*` method (`send_pyobj`, or the wrapper
    methods of other SGLang versions) discards its message.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("send"):
            return _discard
        raise AttributeError(name)


def _discard(*args: Any, **kwargs: Any) -> None:
    return None


# A query: the adapter's SGLang `lora_id` (`None`: the base model) and the context.
Query = tuple[str | None, tuple[int, ...]]

# Where a scheduler keeps why it died: every backend driving it then refuses to.
_DEATH_ATTRIBUTE = "_genlm_engine_death"
_REMEDY = (
    "Every call on this scheduler now fails: create a new backend (e.g. with "
    "load_model_by_name or AsyncSGLTransformer.from_name; after a device error, "
    "in a new process)"
)


def _is_device_error(exc: BaseException) -> bool:
    """Whether `exc` is an accelerator (CUDA) error, after which the GPU context may be unusable."""
    device_error = getattr(torch, "AcceleratorError", None)
    return device_error is not None and isinstance(exc, device_error)


class _SchedulerDriver:
    """Runs one-token requests through an SGLang scheduler, one event-loop step at a time.

    Results are kept by request id until their submitter collects them, so runs
    that interleave (an async batch waiting between steps while a sync call
    steps the scheduler) each get their own rows. Steps are serialised by a lock.
    Once the scheduler is dead (see the module), nothing touches it again.
    """

    def __init__(self, scheduler: Any, request_types: SimpleNamespace):
        self.scheduler = scheduler
        self._sgl = request_types
        self._lock = threading.RLock()
        self._outstanding: set[str] = set()
        self._results: dict[str, torch.Tensor | BaseException] = {}
        for socket in ("send_to_detokenizer", "send_to_tokenizer"):
            if hasattr(scheduler, socket):
                setattr(scheduler, socket, _DiscardSink())

    def _request(self, rid: str, query: Query) -> Any:
        # Greedy (temperature 0 becomes top-k 1 in SGLang): its sampler then takes an
        # argmax and leaves `next_token_logits` as the model computed them, whereas
        # random sampling rescales them in place.
        params = self._sgl.SamplingParams(max_new_tokens=1, temperature=0.0)
        params.normalize(self.scheduler.tokenizer)
        lora_id, token_ids = query
        return self._sgl.TokenizedGenerateReqInput(
            rid=rid,
            input_text="",
            input_ids=list(token_ids),
            mm_inputs=None,
            sampling_params=params,
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            lora_id=lora_id,
        )

    def check_alive(self) -> None:
        """Raise `EngineDeadError` if the scheduler died (chaining what it raised)."""
        death = getattr(self.scheduler, _DEATH_ATTRIBUTE, None)
        if death is not None:
            message, cause = death
            raise EngineDeadError(message) from cause

    def submit(self, queries: Sequence[Query]) -> list[str]:
        rids = [uuid.uuid4().hex for _ in queries]
        requests = [self._request(rid, query) for rid, query in zip(rids, queries, strict=True)]
        with self._lock:
            self.check_alive()
            self._outstanding.update(rids)
            self.scheduler.process_input_requests(requests)
        return rids

    def step(self) -> bool:
        """One iteration of the scheduler's event loop; `False` once it is idle."""
        with self._lock, torch.no_grad():
            self.check_alive()
            scheduler = self.scheduler
            try:
                batch = scheduler.get_next_batch_to_run()
                scheduler.cur_batch = batch
                if batch is None:
                    scheduler.last_batch = None
                    return False
                result = scheduler.run_batch(batch)
                logits = result.logits_output.next_token_logits
                scheduler.process_batch_result(batch, result)
            except Exception as exc:
                error = self._fail_outstanding(exc)
                if error is exc:
                    raise
                raise error from error.__cause__
            scheduler.last_batch = batch
            self._collect(batch.reqs, logits)
            return True

    def _collect(self, reqs: Sequence[Any], logits: torch.Tensor) -> None:
        for row, req in enumerate(reqs):
            if req.rid not in self._outstanding or not req.finished():
                continue  # another caller's request, or a prompt still being prefilled in chunks
            self._outstanding.discard(req.rid)
            reason = req.finished_reason.to_json()
            if reason.get("type") == "abort":
                self._results[req.rid] = RuntimeError(
                    f"SGLang aborted the request: {reason.get('message', reason)}"
                )
            else:
                self._results[req.rid] = torch.log_softmax(logits[row].float(), dim=-1).clone()

    def _fail_outstanding(self, exc: Exception) -> BaseException:
        """Give every request of ours the error `exc` in a step means, and return it.

        That is `exc` itself, unless it is a device error or cleaning up after it
        fails too: then the scheduler is dead, and the error is `EngineDeadError`.
        """
        if _is_device_error(exc):
            error = self._die(f"a batch raised {exc!r}", exc)
        else:
            try:
                # The failed batch's state is unknown: drop every request of ours from the
                # scheduler and forget the batch, as the event loop would never have
                # recorded it.
                self.scheduler.cur_batch = None
                self.scheduler.last_batch = None
                self.scheduler.abort_request(self._sgl.AbortReq(abort_all=True))
                error = exc
            except Exception as failure:
                reason = f"after a batch raised {exc!r}, aborting its requests raised {failure!r}"
                error = self._die(reason, failure)
        for rid in self._outstanding:
            self._results[rid] = error
        self._outstanding.clear()
        return error

    def _die(self, reason: str, cause: BaseException) -> EngineDeadError:
        """Mark the scheduler dead, for every backend driving it; returns the error."""
        message = f"the SGLang scheduler died: {reason}. {_REMEDY}"
        setattr(self.scheduler, _DEATH_ATTRIBUTE, (message, cause))
        error = EngineDeadError(message)
        error.__cause__ = cause
        return error

    def drain(self) -> None:
        """Step until the scheduler is idle."""
        while self.step():
            pass

    def collect(self, rids: Sequence[str]) -> list[torch.Tensor | BaseException]:
        """Each request's row, or the error that ended it (e.g. SGLang aborted it)."""
        with self._lock:
            outcomes = [self._results.pop(rid, None) for rid in rids]
            self._outstanding.difference_update(rids)
        if any(outcome is None for outcome in outcomes):
            raise RuntimeError("the SGLang scheduler went idle without finishing a request")
        return outcomes

    def discard(self, rids: Sequence[str]) -> None:
        """Finish the scheduler's work and drop the results of `rids`."""
        try:
            self.drain()
        except Exception:  # already delivered to the callers of the failed batch
            pass
        finally:
            with self._lock:
                for rid in rids:
                    self._results.pop(rid, None)
                self._outstanding.difference_update(rids)

    def run(self, queries: Sequence[Query]) -> list[torch.Tensor]:
        rids = self.submit(queries)
        try:
            self.drain()
        except BaseException:
            self.discard(rids)
            raise
        outcomes = self.collect(rids)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes

    async def run_async(self, queries: Sequence[Query]) -> list[torch.Tensor | BaseException]:
        rids = self.submit(queries)
        try:
            while self.step():
                await asyncio.sleep(0)  # lets callers join requests that are in flight
        except BaseException:
            self.discard(rids)
            raise
        return self.collect(rids)

    def flush_prefix_cache(self) -> None:
        with self._lock:
            self.drain()
            if not self.scheduler.flush_cache():
                raise RuntimeError("SGLang refused to flush its prefix cache")

    def load_lora(self, lora_name: str, lora_path: str, lora_id: str) -> Any:
        request = self._sgl.LoadLoRAAdapterReqInput(
            lora_name=lora_name, lora_path=lora_path, lora_id=lora_id
        )
        with self._lock:
            self.drain()  # SGLang flushes its prefix cache after a load, which needs it idle
            return self.scheduler.load_lora_adapter(request)

    def unload_lora(self, lora_name: str, lora_id: str) -> Any:
        request = self._sgl.UnloadLoRAAdapterReqInput(lora_name=lora_name, lora_id=lora_id)
        with self._lock:
            self.drain()  # the adapter's requests in flight finish with it
            return self.scheduler.unload_lora_adapter(request)


def _rank_kwargs(scheduler_cls: type, gpu_id: int) -> dict[str, Any]:
    """Single-GPU rank arguments, limited to those this SGLang version's `Scheduler` takes."""
    ranks = {
        "gpu_id": gpu_id,
        "tp_rank": 0,
        "moe_ep_rank": 0,
        "pp_rank": 0,
        "attn_cp_rank": 0,
        "moe_dp_rank": 0,
        "dp_rank": None,
    }
    accepted = inspect.signature(scheduler_cls).parameters
    return {name: value for name, value in ranks.items() if name in accepted}


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

    If the scheduler dies (see the module), every call waiting on it and every
    later call that needs it (queries, `sample`, adapter and prefix-cache
    operations) raises `EngineDeadError`, without touching it again.

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
    """

    def __init__(
        self, sgl_model: Any, cache_size: int = 0, cache_opts: dict[str, Any] | None = None
    ):
        request_types = _import_sglang_requests()
        if getattr(sgl_model, "tokenizer", None) is None:
            raise ValueError("the SGLang scheduler has no tokenizer: leave skip_tokenizer_init off")
        if getattr(sgl_model, "enable_overlap", False):
            raise ValueError(
                "the SGLang scheduler must be built with disable_overlap_schedule=True"
            )
        super().__init__(sgl_model.tokenizer)
        self.sgl_model = sgl_model
        self.vocab_size = sgl_model.model_config.vocab_size
        # SGLang rejects prompts of `max_req_input_len` tokens or more.
        max_input = getattr(sgl_model, "max_req_input_len", None)
        self.max_length = None if max_input is None else max_input - 1
        self.cache = OutputCache(maxsize=cache_size, **(cache_opts or {}))
        self._driver = _SchedulerDriver(sgl_model, request_types)
        self._adapter_names: dict[str, str] = {}  # lora_id -> name, of every adapter loaded
        self._engine_task: asyncio.Task | None = None
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
        sgl = _import_sglang_engine()
        server_args = sgl.ServerArgs(
            model_path=model_id, **{**DEFAULT_ENGINE_OPTS, **(engine_opts or {})}
        )
        if sgl.set_global_server_args is not None:
            sgl.set_global_server_args(server_args)
        port_args = sgl.PortArgs.init_new(server_args)
        scheduler = sgl.Scheduler(server_args, port_args, **_rank_kwargs(sgl.Scheduler, gpu_id))
        return cls(scheduler, **with_default_output_cache(kwargs))

    def _query(self, token_ids: Sequence[int], lora_name: str | None) -> Query:
        self._driver.check_alive()
        adapter = self.loras.select(lora_name)
        lora_id = None if adapter is None else self.loras[adapter]
        return lora_id, check_token_ids(token_ids, self.vocab_size, self.max_length)

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
            A 1-D float32 tensor over the model's vocabulary with `logsumexp == 0`,
            owned by the caller.

        Raises:
            ValueError: For bad token ids (see `check_token_ids`), an unknown
                `lora_name`, or an adapter removed while the query waited.
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
            A 1-D float32 tensor over the model's vocabulary with `logsumexp == 0`,
            owned by the caller.

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
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
            EngineDeadError: If the scheduler died.
        """
        self._driver.check_alive()
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
                unregistered, even if it named an adapter before).
            EngineDeadError: If the scheduler died.
        """
        self._driver.check_alive()
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
            RuntimeError: If SGLang fails to unload it (it is unregistered anyway).
            EngineDeadError: If the scheduler died.
        """
        self._driver.check_alive()
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
            RuntimeError: If SGLang refuses to flush.
            EngineDeadError: If the scheduler died.
        """
        self._driver.flush_prefix_cache()

    def reset_async_queries(self) -> None:
        """Cancel every waiting caller and the batch being computed.

        The scheduler finishes the requests it already holds (their results are
        dropped), so it is idle and usable afterwards.
        """
        self._batcher.reset()
        task = self._engine_task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()
