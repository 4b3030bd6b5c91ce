"""An in-process stand-in for the parts of SGLang 0.5.x that `AsyncSGLTransformer` drives.

SGLang has no CPU build, so the CPU tests run the backend against this module,
installed under SGLang's module paths (`install`). It follows the scheduler's
documented call sequence and contracts rather than its internals:

- `Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)`
  needs `set_global_server_args_for_scheduler(server_args)` first, as later 0.5.x
  releases do;
- `process_input_requests([TokenizedGenerateReqInput | AbortReq, ...])` queues
  requests in `waiting_queue` (prefix-cache hits recorded as `cached_tokens`);
- `get_next_batch_to_run()` first retires `last_batch` (as SGLang merges it into
  the running batch), then forms a prefill batch of at most
  `max_running_requests` requests, splitting prompts longer than
  `chunked_prefill_size` over several steps; `None` when idle;
- `run_batch(batch)` returns `result.logits_output.next_token_logits`, one row
  per request of `batch.reqs`, computed by a real transformers model (rows of a
  partly prefilled prompt hold the logits at the end of its chunk);
- `process_batch_result(batch, result)` appends the greedy token, finishes
  requests at `max_new_tokens`, inserts their prompts into the prefix cache,
  and sends outputs through `send_to_detokenizer`;
- `flush_cache()` empties the prefix cache, refusing (`False`) while requests
  are waiting or running.

It also checks what SGLang's event loop guarantees and a driver must keep:
gradients off during a step, `last_batch` set after each batch and never
retired twice, `cur_batch` pointing at the running batch. It only serves
one-token greedy requests, the only kind the backend sends.
"""

from __future__ import annotations

import dataclasses
import sys
import types
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


@dataclasses.dataclass
class TokenizedGenerateReqInput:
    input_text: str
    input_ids: list[int]
    mm_inputs: Any
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    stream: bool
    rid: str | None = dataclasses.field(default=None, kw_only=True)


@dataclasses.dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False


@dataclasses.dataclass
class ServerArgs:
    model_path: str
    disable_overlap_schedule: bool = False
    skip_tokenizer_init: bool = False
    max_running_requests: int = 8
    chunked_prefill_size: int = 64


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
    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams):
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.output_ids: list[int] = []
        self.prefilled = 0
        self.cached_tokens = 0
        self.finished_reason: FinishLength | FinishAbort | None = None

    def finished(self) -> bool:
        return self.finished_reason is not None


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
        self.gpu_id = gpu_id
        self.enable_overlap = not server_args.disable_overlap_schedule
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
        self.prefix_tree: set[tuple[int, ...]] = set()
        self.send_to_detokenizer = RecordingSocket()
        self.send_to_tokenizer = RecordingSocket()
        # Observations for tests.
        self.forward_ct = 0
        self.received: list[tuple[int, ...]] = []
        self.submission_sizes: list[int] = []
        self.finished_reqs: list[Req] = []
        self.fail_next_run: Exception | None = None

    # -- requests ---------------------------------------------------------------
    def process_input_requests(self, recv_reqs: list[Any]) -> None:
        self.submission_sizes.append(len(recv_reqs))
        for recv in recv_reqs:
            if isinstance(recv, AbortReq):
                self.abort_request(recv)
            elif isinstance(recv, TokenizedGenerateReqInput):
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
        req = Req(recv.rid, recv.input_ids, params)
        self.received.append(tuple(req.origin_input_ids))
        if len(req.origin_input_ids) >= self.max_req_input_len:
            req.finished_reason = FinishAbort("input is longer than the context")
        else:
            req.cached_tokens = self._match_prefix(req.origin_input_ids)
        self.waiting_queue.append(req)

    def _match_prefix(self, ids: list[int]) -> int:
        return max(
            (k for k in range(1, len(ids) + 1) if tuple(ids[:k]) in self.prefix_tree), default=0
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
        if self.last_batch is not None:
            if self.last_batch is self._retired:
                raise AssertionError("last_batch retired twice: the driver did not update it")
            self._retired = self.last_batch
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
            if req.finished():  # aborted on arrival: reported without running
                self.waiting_queue.remove(req)
                self.finished_reqs.append(req)
                continue
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
        if self.cur_batch is not batch:
            raise AssertionError("cur_batch must be the batch being run")
        if self.fail_next_run is not None:
            error, self.fail_next_run = self.fail_next_run, None
            raise error
        self.forward_ct += 1
        longest = max(batch.chunk_ends)
        input_ids = torch.zeros((len(batch.reqs), longest), dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (req, end) in enumerate(zip(batch.reqs, batch.chunk_ends, strict=True)):
            input_ids[row, :end] = torch.tensor(req.origin_input_ids[:end])
            attention_mask[row, :end] = 1
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
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
            req.output_ids.append(token)
            req.finished_reason = FinishLength(len(req.output_ids))
            ids = req.origin_input_ids
            self.prefix_tree.update(tuple(ids[:k]) for k in range(1, len(ids) + 1))
            self.finished_reqs.append(req)
            done.append(req.rid)
        self.send_to_detokenizer.send_pyobj({"finished_rids": done})

    def flush_cache(self) -> bool:
        if self.waiting_queue or self.chunked_req is not None:
            return False
        self.prefix_tree.clear()
        return True

    def is_idle(self) -> bool:
        return not self.waiting_queue and self.chunked_req is None and self.cur_batch is None


def install(monkeypatch: Any) -> None:
    """Make this module importable under SGLang's module paths for one test."""
    modules = {
        "sglang": {},
        "sglang.srt": {},
        "sglang.srt.managers": {},
        "sglang.srt.managers.io_struct": {
            "TokenizedGenerateReqInput": TokenizedGenerateReqInput,
            "AbortReq": AbortReq,
        },
        "sglang.srt.managers.scheduler": {"Scheduler": Scheduler},
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
