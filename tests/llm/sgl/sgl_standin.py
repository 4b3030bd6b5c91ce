"""An in-process stand-in for the parts of SGLang 0.5.x that `AsyncSGLTransformer` drives.

SGLang's registry builds need CUDA, and its CPU build runs one release on some
CPUs (`test_sgl_real.py`), so most tests run the backend against this module,
installed under SGLang's module paths (`install`): every release's shape, on
any machine, with failures injected at will. It follows the scheduler's call
sequence and contracts rather than its internals:

- `Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)`
  needs `set_global_server_args_for_scheduler(server_args)` first, as later 0.5.x
  releases do;
- `process_input_requests([TokenizedGenerateReqInput | AbortReq, ...])` queues
  requests in `waiting_queue` (prefix-cache hits recorded as `cached_tokens`).
  A request SGLang rejects (prompt too long; a `lora_id` that names no loaded
  adapter) is finished with an abort on arrival and, as in SGLang, still runs
  through one batch as a one-token prompt so that its abort is reported;
- `get_next_batch_to_run()` first retires `last_batch` (as SGLang merges it into
  the running batch), then forms a prefill batch of at most
  `max_running_requests` requests and `max_loras_per_batch` distinct adapters
  (the base model counts as one; requests over the limit wait for a later
  batch), splitting prompts longer than `chunked_prefill_size` over several
  steps; `None` when idle;
- `run_batch(batch)` returns `result.logits_output.next_token_logits`, one row
  per request of `batch.reqs`, computed by a real transformers model in one
  forward pass, each row under its request's adapter (peft's mixed-adapter
  batches; rows of a partly prefilled prompt hold the logits at the end of
  their chunk);
- `process_batch_result(batch, result)` appends the greedy token, finishes
  requests at `max_new_tokens`, inserts their prompts into the prefix cache
  under their `lora_id` (SGLang's radix keys include it, so adapters never
  share cached prefixes), and sends outputs through `send_to_detokenizer`;
- `flush_cache()` empties the prefix cache, refusing (`False`) while requests
  are waiting or running;
- with `enable_lora=True` (which needs `max_lora_rank` and
  `lora_target_modules`, as when SGLang starts without `lora_paths`),
  `load_lora_adapter(LoadLoRAAdapterReqInput)` loads a PEFT adapter folder
  under the request's `lora_id` and `unload_lora_adapter(UnloadLoRAAdapterReqInput)`
  removes one; both return `LoRAUpdateOutput(success, error_message)` (a bad
  path, a rank above `max_lora_rank`, a module outside `lora_target_modules`,
  a name already loaded or an unknown adapter give `success=False`) and then
  flush the prefix cache, asserting that it could (it must be idle).

It also checks what SGLang's event loop guarantees and a driver must keep:
gradients off during a step, `last_batch` set after each batch and never
retired twice, `cur_batch` pointing at the running batch. It only serves
one-token greedy requests, the only kind the backend sends.

Unlike SGLang's scheduler, which trusts its TokenizerManager to send only
loaded adapters' ids, the stand-in checks `lora_id` itself, so a driver that
sends a stale id sees an abort instead of wrong numbers.

`install(monkeypatch, release)` installs the scheduler as one SGLang release
shapes it; each release in `RELEASES` is the first with one more difference a
driver must handle (read in the released wheels' `scheduler.py`, `io_struct.py`
and `runtime_context.py`):

- 0.5.12.post1: as above; `TokenizedGenerateReqInput.input_ids` is a list;
- 0.5.13: `input_ids` is an `array("q")` (SGLang extends it with arrays, so a
  list fails with "can only concatenate list (not "array.array") to list");
- 0.5.15: the request type is keyword-only and `input_embeds` and
  `token_type_ids` have no defaults;
- 0.5.16: `get_next_batch_to_run(running_batch, last_batch)` returns a plan
  (`batch_to_run`, `running_batch`) and the scheduler keeps no `cur_batch`;
- 0.5.21: `Scheduler(server_args, port_args)`: the ranks come from
  `sglang.srt.runtime_context.publish(server_args, role=..., ranks=SpawnRanks(...))`,
  which must run first.

Failures for tests to inject: `fail_next_run` makes the next `run_batch`
raise once; `device_error` makes every `run_batch` from then on raise it, as
a GPU whose context a device error (an illegal memory access, a device-side
assert) corrupted does. `run_attempts` counts `run_batch` calls, failed ones
included.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from array import array
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class SamplingParams:
    """Sampling parameters; temperature 0 means greedy (top-k 1), as in SGLang."""

    def __init__(
        self, max_new_tokens: int = 128, temperature: float = 1.0, stop: Any = None, **_: Any
    ):
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = 1 if temperature < 1e-6 else -1
        self.stop_strs = stop
        self.normalized = False

    def normalize(self, tokenizer: Any) -> None:
        self.stop_strs = list(self.stop_strs or [])
        self.normalized = True


RELEASES = ("0.5.12.post1", "0.5.13", "0.5.15", "0.5.16", "0.5.21")


def _version(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split(".")[:3])


@dataclasses.dataclass
class TokenizedGenerateReqInput:
    """The request type up to 0.5.12.post1."""

    input_text: str
    input_ids: list[int]
    mm_inputs: Any
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    stream: bool
    input_embeds: Any = None
    token_type_ids: list[int] | None = None
    rid: str | None = dataclasses.field(default=None, kw_only=True)
    lora_id: str | None = dataclasses.field(default=None, kw_only=True)


@dataclasses.dataclass
class ArrayIdsReqInput(TokenizedGenerateReqInput):
    """The request type of 0.5.13 and 0.5.14: token ids as an `array("q")`."""

    input_ids: array


@dataclasses.dataclass(kw_only=True)
class KeywordReqInput:
    """The request type from 0.5.15 on: keyword-only, every field but a few required."""

    input_text: str
    input_ids: array
    input_embeds: Any
    mm_inputs: Any
    token_type_ids: list[int] | None
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    stream: bool
    rid: str | None = None
    lora_id: str | None = None


def _request_type(release: str) -> type:
    version = _version(release)
    if version >= (0, 5, 15):
        return KeywordReqInput
    return ArrayIdsReqInput if version >= (0, 5, 13) else TokenizedGenerateReqInput


@dataclasses.dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False


@dataclasses.dataclass
class LoadLoRAAdapterReqInput:
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


@dataclasses.dataclass
class UnloadLoRAAdapterReqInput:
    lora_name: str
    lora_id: str | None = None


@dataclasses.dataclass
class LoRAUpdateOutput:
    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None


@dataclasses.dataclass
class ServerArgs:
    model_path: str
    disable_overlap_schedule: bool = False
    skip_tokenizer_init: bool = False
    max_running_requests: int = 8
    chunked_prefill_size: int = 64
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | str | None = None
    max_loras_per_batch: int = 8


_global_server_args: list[ServerArgs] = []


def set_global_server_args_for_scheduler(server_args: ServerArgs) -> None:
    _global_server_args[:] = [server_args]


@dataclasses.dataclass
class PortArgs:
    nccl_port: int

    @staticmethod
    def init_new(server_args: ServerArgs) -> PortArgs:
        return PortArgs(nccl_port=29500)


@dataclasses.dataclass
class FinishLength:
    length: int

    def to_json(self) -> dict:
        return {"type": "length", "length": self.length}


@dataclasses.dataclass
class FinishAbort:
    message: str

    def to_json(self) -> dict:
        return {"type": "abort", "message": self.message}


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        lora_id: str | None = None,
    ):
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.lora_id = lora_id
        self.output_ids: list[int] = []
        self.prefilled = 0
        self.cached_tokens = 0
        self.finished_reason: FinishLength | FinishAbort | None = None

    def finished(self) -> bool:
        return self.finished_reason is not None

    def set_finish_with_abort(self, message: str) -> None:
        # As SGLang does: one token left to prefill, so the abort is reported quickly.
        self.origin_input_ids = [0]
        self.lora_id = None
        self.finished_reason = FinishAbort(message)


@dataclasses.dataclass
class ScheduleBatch:
    reqs: list[Req]
    chunk_ends: list[int]

    def is_empty(self) -> bool:
        return not self.reqs


@dataclasses.dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor


@dataclasses.dataclass
class NextBatchPlan:
    batch_to_run: ScheduleBatch | None
    running_batch: ScheduleBatch


@dataclasses.dataclass
class GenerationBatchResult:
    logits_output: LogitsProcessorOutput
    next_token_ids: torch.Tensor


class RecordingSocket:
    """The scheduler's output socket; nothing reads it in-process, so it only piles up."""

    def __init__(self):
        self.sent: list[Any] = []

    def send_pyobj(self, obj: Any) -> None:
        self.sent.append(obj)


class Scheduler:
    """The stand-in scheduler (see the module docstring)."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        gpu_id: int,
        tp_rank: int,
        moe_ep_rank: int,
        pp_rank: int,
        dp_rank: int | None,
    ):
        if tp_rank != 0 or pp_rank != 0 or moe_ep_rank != 0 or dp_rank is not None:
            raise ValueError("the stand-in runs a single rank")
        if _global_server_args != [server_args]:
            raise AssertionError("set_global_server_args_for_scheduler was not called first")
        self.server_args = server_args
        self.request_type = _request_type(_installed["release"])
        self.gpu_id = gpu_id
        self.enable_overlap = not server_args.disable_overlap_schedule
        self.enable_lora = server_args.enable_lora
        if self.enable_lora and (
            server_args.max_lora_rank is None or server_args.lora_target_modules is None
        ):
            raise ValueError("enable_lora needs max_lora_rank and lora_target_modules")
        self.model = AutoModelForCausalLM.from_pretrained(server_args.model_path)
        self.model.eval()
        self.tokenizer = (
            None
            if server_args.skip_tokenizer_init
            else AutoTokenizer.from_pretrained(server_args.model_path)
        )
        vocab_size = self.model.config.vocab_size
        context_len = self.model.config.max_position_embeddings
        self.model_config = types.SimpleNamespace(vocab_size=vocab_size, context_len=context_len)
        self.max_req_input_len = context_len - 1
        self.waiting_queue: list[Req] = []
        self.chunked_req: Req | None = None
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self._retired: ScheduleBatch | None = None
        self._chunk_retired = False
        self.prefix_tree: set[tuple[str | None, tuple[int, ...]]] = set()
        self.loaded_loras: dict[str, str] = {}  # lora_id -> lora_name
        self.send_to_detokenizer = RecordingSocket()
        self.send_to_tokenizer = RecordingSocket()
        # Observations for tests.
        self.forward_ct = 0
        self.received: list[tuple[int, ...]] = []
        self.submission_sizes: list[int] = []
        self.batch_adapters: list[list[str | None]] = []  # each batch's requests' lora_id
        self.finished_reqs: list[Req] = []
        self.fail_next_run: Exception | None = None
        self.device_error: Exception | None = None
        self.run_attempts = 0

    # -- requests ---------------------------------------------------------------
    def process_input_requests(self, recv_reqs: list[Any]) -> None:
        self.submission_sizes.append(len(recv_reqs))
        for recv in recv_reqs:
            if isinstance(recv, AbortReq):
                self.abort_request(recv)
            elif isinstance(recv, self.request_type):
                self._handle_generate_request(recv)
            else:
                raise TypeError(f"unexpected request {type(recv).__name__}")

    def _handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        params = recv.sampling_params
        if not params.normalized:
            raise ValueError("sampling params must be normalised by the sender")
        if params.max_new_tokens != 1 or params.top_k != 1:
            raise NotImplementedError("the stand-in serves one-token greedy requests only")
        if not isinstance(recv.rid, str):
            raise ValueError("a request needs a string rid")
        ids_type = array if self.request_type is not TokenizedGenerateReqInput else list
        if not isinstance(recv.input_ids, ids_type):
            # Where SGLang extends the prompt with the output ids, a step later.
            raise TypeError(
                f"can only concatenate {type(recv.input_ids).__name__} "
                f'(not "{ids_type.__name__}") to {type(recv.input_ids).__name__}'
            )
        req = Req(recv.rid, recv.input_ids, params, recv.lora_id)
        self.received.append(tuple(req.origin_input_ids))
        if len(req.origin_input_ids) >= self.max_req_input_len:
            req.set_finish_with_abort("input is longer than the context")
        elif req.lora_id is not None and req.lora_id not in self.loaded_loras:
            req.set_finish_with_abort(f"LoRA adapter {req.lora_id!r} is not loaded")
        else:
            req.cached_tokens = self._match_prefix(req)
        self.waiting_queue.append(req)

    def _match_prefix(self, req: Req) -> int:
        ids, tree = req.origin_input_ids, self.prefix_tree
        return max(
            (k for k in range(1, len(ids) + 1) if (req.lora_id, tuple(ids[:k])) in tree), default=0
        )

    def abort_request(self, recv: AbortReq) -> None:
        def matches(req: Req) -> bool:
            return recv.abort_all or req.rid.startswith(recv.rid)

        self.waiting_queue = [req for req in self.waiting_queue if not matches(req)]
        if self.chunked_req is not None and matches(self.chunked_req):
            self.chunked_req.finished_reason = FinishAbort("aborted")
            self.chunked_req = None

    # -- the event-loop steps ---------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        return self._form_batch(self.last_batch)

    def _form_batch(self, last_batch: ScheduleBatch | None) -> ScheduleBatch | None:
        if last_batch is not None:
            if last_batch is self._retired:
                raise AssertionError("last_batch retired twice: the driver did not update it")
            self._retired = last_batch
            self._chunk_retired = True
        if self.chunked_req is not None and not self._chunk_retired:
            # SGLang caches a chunk's KV when it retires `last_batch`; without it the
            # next chunk would run on state that was never saved.
            raise AssertionError("a chunked prompt continued without last_batch being set")
        budget = self.server_args.chunked_prefill_size
        reqs, ends = [], []
        if self.chunked_req is not None:
            req = self.chunked_req
            reqs.append(req)
            ends.append(min(len(req.origin_input_ids), req.prefilled + budget))
        for req in list(self.waiting_queue):
            if len(reqs) >= self.server_args.max_running_requests:
                break
            adapters = {r.lora_id for r in reqs} | {req.lora_id}
            if len(adapters) > self.server_args.max_loras_per_batch:
                continue  # waits for a batch with room for its adapter
            too_long = len(req.origin_input_ids) > budget
            if too_long and self.chunked_req is not None:
                break
            self.waiting_queue.remove(req)
            reqs.append(req)
            ends.append(min(len(req.origin_input_ids), budget))
            if too_long:
                self.chunked_req = req
        self._chunk_retired = False
        return ScheduleBatch(reqs, ends) if reqs else None

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        if torch.is_grad_enabled():
            raise AssertionError("SGLang's event loop runs batches without gradients")
        if self._batch_to_run() is not batch:
            raise AssertionError("the batch run must be the one the scheduler gave last")
        self.run_attempts += 1
        if self.device_error is not None:
            raise self.device_error
        if self.fail_next_run is not None:
            error, self.fail_next_run = self.fail_next_run, None
            raise error
        self.forward_ct += 1
        self.batch_adapters.append([req.lora_id for req in batch.reqs])
        longest = max(batch.chunk_ends)
        input_ids = torch.zeros((len(batch.reqs), longest), dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (req, end) in enumerate(zip(batch.reqs, batch.chunk_ends, strict=True)):
            input_ids[row, :end] = torch.tensor(req.origin_input_ids[:end])
            attention_mask[row, :end] = 1
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.loaded_loras:
            inputs["adapter_names"] = [req.lora_id or "__base__" for req in batch.reqs]
        logits = self.model(**inputs).logits
        last = torch.tensor(batch.chunk_ends) - 1
        next_token_logits = logits[torch.arange(len(batch.reqs)), last]
        return GenerationBatchResult(
            LogitsProcessorOutput(next_token_logits), next_token_logits.argmax(dim=-1)
        )

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        done = []
        for req, end, token in zip(
            batch.reqs, batch.chunk_ends, result.next_token_ids.tolist(), strict=True
        ):
            req.prefilled = end
            if end < len(req.origin_input_ids):
                continue
            if self.chunked_req is req:
                self.chunked_req = None
            self.finished_reqs.append(req)
            done.append(req.rid)
            if req.finished():  # aborted on arrival
                continue
            req.output_ids.append(token)
            req.finished_reason = FinishLength(len(req.output_ids))
            ids = req.origin_input_ids
            self.prefix_tree.update((req.lora_id, tuple(ids[:k])) for k in range(1, len(ids) + 1))
        self.send_to_detokenizer.send_pyobj({"finished_rids": done})

    def flush_cache(self) -> bool:
        if self.waiting_queue or self.chunked_req is not None:
            return False
        self.prefix_tree.clear()
        return True

    # -- LoRA adapters ----------------------------------------------------------
    def load_lora_adapter(self, recv: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        try:
            self._load_adapter(recv)
        except (ValueError, OSError) as exc:
            return LoRAUpdateOutput(success=False, error_message=str(exc))
        return self._after_lora_update()

    def unload_lora_adapter(self, recv: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        if self.loaded_loras.get(recv.lora_id) != recv.lora_name:
            return LoRAUpdateOutput(
                success=False,
                error_message=f"LoRA adapter {recv.lora_name!r} ({recv.lora_id}) is not loaded",
            )
        del self.loaded_loras[recv.lora_id]
        if self.loaded_loras:
            self.model.set_adapter(next(iter(self.loaded_loras)))  # peft warns if the active goes
            self.model.delete_adapter(recv.lora_id)
        else:  # peft cannot run without an adapter: back to the plain model
            self.model = self.model.unload().eval()
        return self._after_lora_update()

    def _load_adapter(self, recv: LoadLoRAAdapterReqInput) -> None:
        from peft import LoraConfig, PeftModel

        args = self.server_args
        if not self.enable_lora:
            raise ValueError("LoRA is not enabled: start the server with enable_lora")
        if not isinstance(recv.lora_id, str):
            raise ValueError("a LoRA adapter needs a string lora_id")
        if recv.lora_name in self.loaded_loras.values() or recv.lora_id in self.loaded_loras:
            raise ValueError(f"LoRA adapter {recv.lora_name!r} is already loaded")
        config = LoraConfig.from_pretrained(recv.lora_path)
        if config.r > args.max_lora_rank:
            raise ValueError(f"LoRA rank {config.r} exceeds max_lora_rank {args.max_lora_rank}")
        modules = set(config.target_modules or ())
        if args.lora_target_modules != "all" and not modules <= set(args.lora_target_modules):
            raise ValueError(
                f"LoRA target modules {sorted(modules)} are not all in lora_target_modules"
            )
        if isinstance(self.model, PeftModel):
            self.model.load_adapter(recv.lora_path, adapter_name=recv.lora_id)
        else:
            self.model = PeftModel.from_pretrained(
                self.model, recv.lora_path, adapter_name=recv.lora_id
            )
        self.model.eval()
        self.loaded_loras[recv.lora_id] = recv.lora_name

    def _after_lora_update(self) -> LoRAUpdateOutput:
        # SGLang flushes the prefix cache after every adapter update and asserts it could.
        if not self.flush_cache():
            raise AssertionError("cache flush failed after a LoRA update: the scheduler was busy")
        return LoRAUpdateOutput(
            success=True,
            loaded_adapters={name: lora_id for lora_id, name in self.loaded_loras.items()},
        )

    def is_idle(self) -> bool:
        return not self.waiting_queue and self.chunked_req is None and self._batch_to_run() is None

    def _batch_to_run(self) -> ScheduleBatch | None:
        return self.cur_batch


class PlanningScheduler(Scheduler):
    """The scheduler from 0.5.16 on: the next batch comes in a plan."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        gpu_id: int,
        tp_rank: int,
        moe_ep_rank: int,
        pp_rank: int,
        dp_rank: int | None,
    ):
        super().__init__(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)
        del self.cur_batch
        self.running_batch = ScheduleBatch([], [])
        self._planned: ScheduleBatch | None = None

    def get_next_batch_to_run(
        self, running_batch: ScheduleBatch, last_batch: ScheduleBatch | None
    ) -> NextBatchPlan:
        if running_batch is not self.running_batch or last_batch is not self.last_batch:
            raise AssertionError("the plan must start from the scheduler's own batches")
        self._planned = self._form_batch(last_batch)
        return NextBatchPlan(self._planned, ScheduleBatch([], []))

    def _batch_to_run(self) -> ScheduleBatch | None:
        return self._planned

    def is_idle(self) -> bool:
        # No `cur_batch` to check: the driver records a plan's batch only as `last_batch`.
        return not self.waiting_queue and self.chunked_req is None


_published: list[tuple[ServerArgs, SpawnRanks | None]] = []


@dataclasses.dataclass(frozen=True)
class SpawnRanks:
    world_rank: int
    dp_rank: int | None = None
    gpu_id: int | None = None


def publish(server_args: ServerArgs, *, role: str, ranks: SpawnRanks | None = None) -> None:
    if role != "scheduler":
        raise ValueError(f"unexpected role {role!r}")
    _published[:] = [(server_args, ranks)]
    _global_server_args[:] = [server_args]


def spawn_world_rank(server_args: ServerArgs, *, tp_rank: int, pp_rank: int) -> int:
    return tp_rank + pp_rank


class RanklessScheduler(PlanningScheduler):
    """The scheduler from 0.5.21 on: its ranks come from what was published."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs):
        if not _published or _published[0][0] is not server_args or _published[0][1] is None:
            raise AssertionError("publish(server_args, role=..., ranks=...) was not called first")
        ranks = _published[0][1]
        super().__init__(
            server_args, port_args, ranks.gpu_id, ranks.world_rank, 0, 0, ranks.dp_rank
        )


def _scheduler_type(release: str) -> type:
    version = _version(release)
    if version >= (0, 5, 21):
        return RanklessScheduler
    return PlanningScheduler if version >= (0, 5, 16) else Scheduler


_installed = {"release": "0.5.12.post1"}


def install(monkeypatch: Any, release: str = "0.5.12.post1") -> None:
    """Make this module importable under SGLang's module paths for one test, shaped as
    `release` (one of `RELEASES`) shapes SGLang's scheduler and requests."""
    monkeypatch.setitem(_installed, "release", release)
    modules = {
        "sglang": {},
        "sglang.srt": {},
        "sglang.srt.managers": {},
        "sglang.srt.managers.io_struct": {
            "TokenizedGenerateReqInput": _request_type(release),
            "AbortReq": AbortReq,
            "LoadLoRAAdapterReqInput": LoadLoRAAdapterReqInput,
            "UnloadLoRAAdapterReqInput": UnloadLoRAAdapterReqInput,
            "LoRAUpdateOutput": LoRAUpdateOutput,
        },
        "sglang.srt.managers.scheduler": {"Scheduler": _scheduler_type(release)},
        "sglang.srt.runtime_context": {
            "SpawnRanks": SpawnRanks,
            "publish": publish,
            "spawn_world_rank": spawn_world_rank,
        },
        "sglang.srt.sampling": {},
        "sglang.srt.sampling.sampling_params": {"SamplingParams": SamplingParams},
        "sglang.srt.server_args": {
            "ServerArgs": ServerArgs,
            "PortArgs": PortArgs,
            "set_global_server_args_for_scheduler": set_global_server_args_for_scheduler,
        },
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
