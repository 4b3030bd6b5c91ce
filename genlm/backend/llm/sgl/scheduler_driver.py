"""Drives an SGLang scheduler in this process, one event-loop step at a time.

SGLang's scheduler (`sglang.srt.managers.scheduler.Scheduler`, 0.5.x) runs an
event loop that repeats `recv_requests` -> `process_input_requests` ->
`get_next_batch_to_run` -> `run_batch` -> `process_batch_result`, setting
`cur_batch` before a batch runs and `last_batch` after it. `SchedulerDriver`
drives the same methods from the caller's thread, handing
`TokenizedGenerateReqInput`s straight to `process_input_requests` (no ZMQ).
Every request asks for one greedy token; its full-vocabulary next-token logits
are read from the batch result (`logits_output.next_token_logits`, one row per
request in `batch.reqs`) before `process_batch_result` finishes the request
and inserts its tokens into SGLang's radix prefix cache. Between calls the
scheduler is left idle (no waiting or running request).

The scheduler runs in the caller's process, so it cannot die apart from it;
what can break it for good is a device error (`torch.AcceleratorError`: the
GPU context may be corrupted) or an error while the driver cleans up after a
failed batch (the scheduler's state is then unknown). Either makes every
waiting and every later call raise `EngineDeadError`; other errors of a batch
reach its callers and the scheduler stays usable. Every SGLang import is here.

The releases differ in what a driver must do, each difference handled where it
appears: token ids as an `array("q")` (0.5.13 on; `import_sglang_requests`),
`input_embeds` and `token_type_ids` required (0.5.15 on; `SchedulerDriver`),
`get_next_batch_to_run(running_batch, last_batch)` returning a plan (0.5.16 on;
`SchedulerDriver`), and the scheduler's ranks published before it is built
instead of passed to it (0.5.21 on; `build_scheduler`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid
from array import array
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from genlm.backend.errors import EngineDeadError
from genlm.backend.llm.rows import fit_width

INSTALL_HINT = "the SGLang backend needs SGLang: pip install 'genlm-backend[sglang]'"


def import_sglang_requests() -> SimpleNamespace:
    """SGLang's request types, and how this release wants a request's token ids."""
    try:
        from sglang.srt.managers.io_struct import (
            AbortReq,
            LoadLoRAAdapterReqInput,
            TokenizedGenerateReqInput,
            UnloadLoRAAdapterReqInput,
        )
        from sglang.srt.sampling.sampling_params import SamplingParams
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return SimpleNamespace(
        AbortReq=AbortReq,
        TokenizedGenerateReqInput=TokenizedGenerateReqInput,
        SamplingParams=SamplingParams,
        LoadLoRAAdapterReqInput=LoadLoRAAdapterReqInput,
        UnloadLoRAAdapterReqInput=UnloadLoRAAdapterReqInput,
        # 0.5.13 on: an `array("q")`, which SGLang extends with arrays (a list fails
        # there with "can only concatenate list (not "array.array") to list").
        ids_as_array="array" in _annotation(TokenizedGenerateReqInput, "input_ids"),
    )


def _annotation(cls: type, name: str) -> str:
    """The annotation of field `name` of `cls` (or a base), as text (`""` if none)."""
    for klass in cls.__mro__:
        annotations = vars(klass).get("__annotations__", {})
        if name in annotations:
            return str(annotations[name])
    return ""


def build_scheduler(model_id: str, engine_opts: dict[str, Any], gpu_id: int) -> Any:
    """An SGLang `Scheduler` for `model_id` in this process, set up as SGLang's scheduler
    process sets one up.

    Before building it, the server arguments are published process-wide
    (0.5.12 on; from 0.5.21 with the rank placement the constructor then
    reads, where earlier releases take the ranks as constructor arguments).

    Args:
        model_id: Hub name or local folder of the model.
        engine_opts: `ServerArgs` fields.
        gpu_id: The GPU the scheduler runs on.

    Raises:
        ImportError: If SGLang is not installed.
    """
    try:
        from sglang.srt import server_args as sgl_server_args
        from sglang.srt.managers.scheduler import Scheduler
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    server_args = sgl_server_args.ServerArgs(model_path=model_id, **engine_opts)
    port_args = sgl_server_args.PortArgs.init_new(server_args)
    constructor = inspect.signature(Scheduler).parameters
    if "tp_rank" in constructor:  # up to 0.5.20: ranks as arguments
        publish = getattr(sgl_server_args, "set_global_server_args_for_scheduler", None)
        if publish is not None:
            publish(server_args)
        ranks = {
            "gpu_id": gpu_id,
            "tp_rank": 0,
            "moe_ep_rank": 0,
            "pp_rank": 0,
            "attn_cp_rank": 0,
            "moe_dp_rank": 0,
            "dp_rank": None,
        }
        accepted = {name: value for name, value in ranks.items() if name in constructor}
        return Scheduler(server_args, port_args, **accepted)
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank

    world_rank = spawn_world_rank(server_args, tp_rank=0, pp_rank=0)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, gpu_id=gpu_id))
    return Scheduler(server_args, port_args)


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


class SchedulerDriver:
    """Runs one-token requests through an SGLang scheduler, one event-loop step at a time.

    Results are kept by request id until their submitter collects them, so runs
    that interleave (an async batch waiting between steps while a sync call
    steps the scheduler) each get their own rows. Steps are serialised by a lock.
    Once the scheduler is dead (see the module), nothing touches it again.
    """

    def __init__(self, scheduler: Any, request_types: SimpleNamespace, row_width: int):
        self.scheduler = scheduler
        self._row_width = row_width
        self._sgl = request_types
        self._lock = threading.RLock()
        self._outstanding: set[str] = set()
        self._results: dict[str, torch.Tensor | BaseException] = {}
        next_batch = inspect.signature(scheduler.get_next_batch_to_run).parameters
        self._plans = "running_batch" in next_batch
        for socket in ("send_to_detokenizer", "send_to_tokenizer"):
            if hasattr(scheduler, socket):
                setattr(scheduler, socket, _DiscardSink())

    def _request(self, rid: str, query: Query) -> Any:
        # Greedy (temperature 0 becomes top-k 1 in SGLang): its sampler then takes an
        # argmax and leaves `next_token_logits` as the model computed them, whereas
        # random sampling rescales them in place.
        lora_id, token_ids = query
        return self.request(rid, token_ids, max_new_tokens=1, lora_id=lora_id)

    def request(
        self,
        rid: str,
        token_ids: Sequence[int],
        max_new_tokens: int,
        lora_id: str | None = None,
        ignore_eos: bool = False,
    ) -> Any:
        """A greedy generation request of this SGLang release's type (its token ids as the
        release wants them)."""
        params = self._sgl.SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos
        )
        params.normalize(self.scheduler.tokenizer)
        return self._sgl.TokenizedGenerateReqInput(
            rid=rid,
            input_text="",
            input_ids=array("q", token_ids) if self._sgl.ids_as_array else list(token_ids),
            input_embeds=None,  # required from 0.5.15 on, optional before
            token_type_ids=None,  # likewise
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
                batch = self._next_batch()
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

    def _next_batch(self) -> Any:
        """The scheduler's next batch (`None` when idle), with its bookkeeping done."""
        scheduler = self.scheduler
        if self._plans:  # 0.5.16 on: a plan, from the running and the last batch
            plan = scheduler.get_next_batch_to_run(
                running_batch=scheduler.running_batch, last_batch=scheduler.last_batch
            )
            scheduler.running_batch = plan.running_batch
            return plan.batch_to_run
        batch = scheduler.get_next_batch_to_run()
        scheduler.cur_batch = batch
        return batch

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
                row_logprobs = torch.log_softmax(logits[row].float(), dim=-1).clone()
                self._results[req.rid] = fit_width(row_logprobs, self._row_width)

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
                if not self._plans:
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

    def close(self) -> None:
        """Finish the scheduler's work and let go of it (nothing touches it again)."""
        with self._lock:
            try:
                if getattr(self.scheduler, _DEATH_ATTRIBUTE, None) is None:
                    self.drain()
            except Exception:  # already delivered to the callers of the failed batch
                pass
            self._results.clear()
            self._outstanding.clear()
            self.scheduler = None

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
