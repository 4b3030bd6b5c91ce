"""How the vLLM backend's batches become engine requests and results: `RowRequests`.

A batch of logprob queries is planned into requests (`request_plan`), run by
the engine loop, and its rows are taken from the capture and stored in the
output cache; a batch of sampling requests comes back as token ids.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from genlm.backend.cache import OutputCache
from genlm.backend.llm.rows import fit_width
from genlm.backend.llm.vllm.adapters import EngineAdapters
from genlm.backend.llm.vllm.capture import InProcessLogits, WorkerLogits, hook_error
from genlm.backend.llm.vllm.engine_loop import EngineLoop
from genlm.backend.llm.vllm.futures import then
from genlm.backend.llm.vllm.request_plan import (
    SampleRequest,
    captured_request,
    check_capture,
    new_tags,
    plan_requests,
    refused,
    sample_request,
    until_stop,
)


class RowRequests:
    """Runs the vLLM backend's batches in the engine and delivers their rows (or tokens).

    Logprob queries that are prefixes of a longer one share its request (a
    chain, see `request_plan`), unless the engine cannot record rows at
    prompt positions or the adapter has weights in the output layer.

    Args:
        engine: The loop that drives the engine.
        logits: Where the captured rows are taken from.
        cache: The output cache computed rows are stored in.
        adapters: The backend's adapters (their checks and output-layer weights).
        block_size: Tokens per key/value block of the engine (prefix caching
            reuses whole blocks).
        row_width: Columns of a delivered row: the tokenizer's length (see `fit_width`).
    """

    def __init__(
        self,
        engine: EngineLoop,
        logits: InProcessLogits | WorkerLogits,
        cache: OutputCache,
        adapters: EngineAdapters,
        block_size: int,
        row_width: int,
    ):
        self._engine = engine
        self._logits = logits
        self._cache = cache
        self._adapters = adapters
        self._block_size = block_size
        self._row_width = row_width
        # Whether queries that are prefixes of a longer one share its request: the
        # engine must record rows at prompt positions.
        self._chains = logits.reads_prompt_rows

    def check_capture(self, max_logprobs: int) -> None:
        """Check the capture on one request (see `request_plan.check_capture`); it may turn
        chains off."""
        self._chains = check_capture(self._engine, self._logits, self._chains, max_logprobs)

    def logprobs(self, queries: list[tuple], reads_prefix_cache: bool = True) -> Future:
        """Put the queries into the engine; the future gives their rows (or their errors).

        Queries that are prefixes of a longer one share its request (see
        `request_plan`). A chain's rows at positions the engine took from
        its prefix cache are missing: those queries are asked again, by
        chains that recompute their whole prompt or by requests of their own,
        whichever computes fewer tokens.

        Args:
            queries: Distinct `(LoRA request or None, token ids)` pairs.
            reads_prefix_cache: `False`: the requests compute their whole prompt
                (none is kept live).
        """

        def ask_again(outcomes: list) -> list | Future:
            missing = [i for i, outcome in enumerate(outcomes) if outcome is None]
            if not missing:
                return outcomes

            def fill(again: list) -> list:
                for i, outcome in zip(missing, again, strict=True):
                    outcomes[i] = outcome
                return outcomes

            return then(self._submit([queries[i] for i in missing], True), fill)

        return then(self._submit(queries, False, reads_prefix_cache), ask_again)

    def samples(self, requests: list[SampleRequest]) -> Future:
        """Put the sampling requests into the engine; the future gives their tokens."""
        engine_requests = [
            sample_request(request, self._adapters.check(request.lora)) for request in requests
        ]

        def finish(outcomes: list) -> list[list[int] | ValueError]:
            return [
                outcome
                if refused(outcome)
                else until_stop(outcome.outputs[0].token_ids, request.eos_token_ids)
                for request, outcome in zip(requests, outcomes, strict=True)
            ]

        return self._engine.run(engine_requests, finish)

    def _may_chain(self, lora: Any) -> bool:
        """Whether queries for `lora` may share a request (see `plan_requests`)."""
        return self._chains and not self._adapters.adapts_output_layer(lora)

    def _submit(
        self, queries: list[tuple], recompute: bool, reads_prefix_cache: bool = True
    ) -> Future:
        """One round of requests for `queries` (see `plan_requests` for `recompute`; with
        `reads_prefix_cache` false, no request reads the prefix cache or is kept live).

        The future gives one outcome per query: its row, the error that kept
        its request out, or `None` for a row the request could not read (not
        when `recompute`: then that is an error).
        """
        plan = plan_requests(queries, self._may_chain, recompute, self._block_size)
        tags = new_tags(len(queries))
        owner, requests = self._logits.owner, []
        per_adapter: dict[Any, tuple[Any, bool]] = {}  # its check, whether it reads the cache
        for chain in plan:
            lora, ids = queries[chain.members[0]]
            if (adapter := per_adapter.get(lora)) is None:
                reads = reads_prefix_cache and self._adapters.reads_prefix_cache(lora)
                adapter = per_adapter[lora] = (self._adapters.check(lora), reads)
            check, reads = adapter
            # Every member's row, the first one's too, in query order: one tensor of rows
            # per engine step, which is the caller's result as it is when the queries are
            # all of a call's (see `rows_through_cache`).
            members = sorted(chain.members) if len(chain.members) > 1 else ()
            requests.append(
                captured_request(
                    ids,
                    lora,
                    tags[chain.members[0]],
                    owner,
                    check=check,
                    prompt_rows=[(len(queries[i][1]) - 1, tags[i]) for i in members],
                    reads_prefix_cache=chain.reads_prefix_cache and reads,
                    live=not members and not recompute and reads_prefix_cache,
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
            found = [
                (i, fit_width(row, self._row_width))
                for i, row in zip(served, rows, strict=True)
                if row is not None
            ]
            for i, row in found:
                results[i] = row
            self._cache.store_rows([queries[i] for i, _ in found], [row for _, row in found])
            if recompute:
                error = RuntimeError(hook_error("a row at a prompt position was not recorded"))
                results = [error if outcome is None else outcome for outcome in results]
            return results

        def discard() -> None:  # rows recorded before the failure
            self._logits.take(tags, discard=True)

        return self._engine.run(requests, finish, discard)
