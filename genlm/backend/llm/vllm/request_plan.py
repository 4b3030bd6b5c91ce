"""The requests `AsyncVirtualLM` puts into vLLM's engine, and how a batch becomes requests.

A logits query is a one-token request whose next-token row the capture
records (`captured_request`). Queries that are prefixes of a longer one in
the same batch (all prefixes of a sequence, the rows a critic asks for) share
one request, a *chain*: the longest context is the prompt, and the others'
rows are read at their prompt positions (`capture.CHAIN_ROWS`), so the
engine computes the sequence once instead of once per prefix (its prefix
cache reuses whole blocks only). `plan_requests` groups a batch into chains.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from genlm.backend.llm.vllm.capture import (
    CAPTURE_OWNER,
    CAPTURE_TAG,
    CHAIN_ROWS,
    InProcessLogits,
    WorkerLogits,
    hook_error,
)
from genlm.backend.llm.vllm.engine_loop import EngineLoop, EngineRequest

logger = logging.getLogger(__name__)

# Capture tags, unique in this process: several models may share one engine and capture.
_tags = itertools.count()
# The startup check compares this many of vLLM's own top log-probabilities with the capture's.
_CHECKED_LOGPROBS = 5
# Largest spread, in nats, of (captured - vLLM's own) over those tokens: both are float32
# log-softmaxes of the same logits (measured spread ~1e-6); a wrong row is off by ~1 or more.
_CHECK_TOLERANCE = 1e-3


def new_tags(count: int) -> list[int]:
    """`count` capture tags never handed out before in this process."""
    return list(itertools.islice(_tags, count))


class SampleRequest(NamedTuple):
    """One `sample` call, as the batcher queues it."""

    lora: Any  # a vLLM `LoRARequest`, or None for the base model
    prompt: tuple[int, ...]
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    temperature: float
    seed: int | None


class Chain(NamedTuple):
    """Queries of one batch served by one request.

    Attributes:
        members: Indices of the queries in the batch; the first is the
            request's prompt, every other one a proper prefix of it.
        reads_prefix_cache: Whether the request may take the prompt's start
            from the engine's prefix cache (positions taken from there get no
            row: their members are asked again).
    """

    members: list[int]
    reads_prefix_cache: bool = True


def plan_requests(
    queries: Sequence[tuple[Hashable, tuple[int, ...]]],
    chains: Callable[[Hashable], bool],
    recompute: bool = False,
    block_size: int = 1,
) -> list[Chain]:
    """Group `(adapter, token ids)` queries into requests.

    Args:
        queries: Distinct queries.
        chains: Whether a request for an adapter (`None`: the base model) may
            serve the queries that are prefixes of its prompt (the engine
            records prompt-position rows for it); else one request per query.
        recompute: The queries' rows were missing from chains that read the
            prefix cache: a chain now recomputes its whole prompt, and is used
            only where that computes fewer tokens than one request per query,
            each of which recomputes from its last cached block
            (`block_size` tokens per block).
        block_size: The engine's key/value block size, in tokens.

    Returns:
        The requests, every query in exactly one of them.
    """
    planned = []
    for members in _prefix_chains(queries):
        if len(members) == 1:  # a request of its own either way
            planned.append(Chain(members))
            continue
        if not recompute:
            chained = chains(queries[members[0]][0])
        else:
            alone = sum((len(queries[i][1]) - 1) % block_size + 1 for i in members)
            chained = chains(queries[members[0]][0]) and len(queries[members[0]][1]) < alone
        if chained:
            planned.append(Chain(members, reads_prefix_cache=not recompute))
        else:
            planned.extend(Chain([i]) for i in members)
    return planned


def _prefix_chains(queries: Sequence[tuple[Hashable, tuple[int, ...]]]) -> list[list[int]]:
    """Indices grouped so that each group's first context extends all its others.

    Within one adapter, sorted contexts put every context right before those
    that extend it, so a context is a prefix of some other one exactly when it
    is a prefix of the next: walking the sorted order backwards, each context
    joins the group of the next one if that extends it. Distinct contexts of
    one length (a sampler's particles in step) extend none of each other:
    each is a group of its own, without the sort, whose comparisons read a
    shared prompt through.
    """
    by_adapter: dict[Hashable, list[int]] = {}
    for index, (adapter, _) in enumerate(queries):
        by_adapter.setdefault(adapter, []).append(index)
    groups: list[list[int]] = []
    for indices in by_adapter.values():
        if len({len(queries[i][1]) for i in indices}) == 1:
            groups.extend([index] for index in indices)
            continue
        indices.sort(key=lambda i: queries[i][1])
        following: tuple[int, ...] | None = None
        for index in reversed(indices):
            context = queries[index][1]
            if following is not None and _extends(following, context):
                groups[-1].append(index)
            else:
                groups.append([index])
            following = context
    return groups


def _extends(longer: tuple[int, ...], context: tuple[int, ...]) -> bool:
    """Whether `longer` extends `context` (the queries of a batch are distinct)."""
    return len(longer) > len(context) and longer[: len(context)] == context


def adapts_output_layer(lora_path: str) -> bool:
    """Whether the PEFT adapter in `lora_path` changes the model's output layer (`lm_head`).

    Read from its `adapter_config.json` (`target_modules`, `modules_to_save`);
    an adapter whose configuration cannot be read counts as changing it.
    """
    try:
        config = json.loads((Path(lora_path) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return True
    for key in ("target_modules", "modules_to_save"):
        names = config.get(key) or []
        if "lm_head" in (names if isinstance(names, str) else " ".join(names)):
            return True
    return False


def captured_request(
    token_ids: Sequence[int],
    lora: Any,
    tag: Hashable,
    owner: int | None,
    logprobs: int | None = None,
    check: Callable[[], BaseException | None] | None = None,
    prompt_rows: Sequence[tuple[int, Hashable]] = (),
    reads_prefix_cache: bool = True,
    prompt_logprobs: int | None = None,
    live: bool = False,
) -> EngineRequest:
    """A one-token request whose next-token row the capture `owner` (`None`: any) records.

    Args:
        token_ids: The prompt (a `TokenIds` for a `live` request).
        lora: Its `LoRARequest`, or `None`.
        tag: The tag its next-token row is recorded under.
        owner: The `capture_id` of the capture that records it (`None`: any).
        logprobs: vLLM's own top log-probabilities to return with the output.
        check: See `EngineRequest`.
        prompt_rows: `(position, tag)` pairs: the row after the prompt's first
            `position + 1` tokens, recorded under `tag`.
        reads_prefix_cache: Whether the engine may take the prompt's start
            from its prefix cache.
        prompt_logprobs: vLLM's own prompt log-probabilities to return.
        live: See `EngineRequest`.
    """
    extra_args: dict[str, Any] = {CAPTURE_TAG: tag}
    if owner is not None:
        extra_args[CAPTURE_OWNER] = owner
    if prompt_rows:
        extra_args[CHAIN_ROWS] = [[position, row_tag] for position, row_tag in prompt_rows]
    params = DeferredParams(
        extra_args,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_reading_prefix_cache=None if reads_prefix_cache else True,
    )
    if not live:
        params = params()
    return EngineRequest(token_ids, params, lora, check, live)


class DeferredParams:
    """The `SamplingParams` of a captured request, made when it enters the engine as a new
    request (calling this makes them): a query fed to a live request uses only their
    `extra_args`, and vLLM's checks of a new `SamplingParams` cost more than the rest of the
    query's way to the engine.

    Attributes:
        extra_args: The request's `extra_args` (its capture tag).

    Args:
        extra_args: See above.
        logprobs: vLLM's own top log-probabilities to return with the output.
        prompt_logprobs: vLLM's own prompt log-probabilities to return.
        skip_reading_prefix_cache: vLLM's option of that name.
    """

    def __init__(
        self,
        extra_args: dict[str, Any],
        logprobs: int | None,
        prompt_logprobs: int | None,
        skip_reading_prefix_cache: bool | None,
    ):
        self.extra_args = extra_args
        self._options = (logprobs, prompt_logprobs, skip_reading_prefix_cache)

    def __call__(self) -> Any:
        """A new `SamplingParams`: greedy, one token, the capture's `extra_args`."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        logprobs, prompt_logprobs, skip_reading_prefix_cache = self._options
        return SamplingParams(
            max_tokens=1,
            # Greedy: the sampled token is never used, and an argmax costs far less than a
            # random sample's noise over every row (the capture records greedy rows too).
            temperature=0.0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            extra_args=self.extra_args,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
            skip_clone=True,  # fresh for this request and never changed: vLLM copies it shallowly
        )


def sample_request(
    request: SampleRequest, check: Callable[[], BaseException | None] | None
) -> EngineRequest:
    """The engine request of a `sample` call (`check`: see `EngineRequest`)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        seed=request.seed,
        stop_token_ids=list(request.eos_token_ids),
        ignore_eos=True,  # stop at `eos_token_ids` only, not at the model's own EOS
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        skip_clone=True,
    )
    return EngineRequest(request.prompt, params, request.lora, check)


def check_capture(
    engine: EngineLoop, source: InProcessLogits | WorkerLogits, chains: bool, max_logprobs: int
) -> bool:
    """Compare captured rows with vLLM's own log-probabilities of the same request.

    The row after a 4-token prompt is compared with vLLM's top
    log-probabilities there. With `chains`, the rows after its first 2 and 3
    tokens, read at prompt positions, are compared with vLLM's prompt
    log-probabilities; if they differ, a warning says that queries stop
    sharing requests. Only differences between tokens are compared, so
    engines that report logits (`logprobs_mode`) pass too.

    Args:
        engine: The engine's loop.
        source: Where the captured rows are read.
        chains: Whether requests may ask for prompt-position rows.
        max_logprobs: The engine's limit on returned log-probabilities
            (negative: none); below 2 nothing can be compared.

    Returns:
        Whether requests may go on asking for prompt-position rows.

    Raises:
        RuntimeError: If the next-token rows differ: the capture reads the wrong rows.
    """
    count = _CHECKED_LOGPROBS if max_logprobs < 0 else min(_CHECKED_LOGPROBS, max_logprobs)
    if count < 2:  # the engine reports too little to compare
        return chains
    tags = new_tags(3)
    prompt_rows = list(zip((1, 2), tags[1:], strict=True)) if chains else []
    request = captured_request(
        range(4),
        None,
        tags[0],
        source.owner,
        logprobs=count,
        prompt_rows=prompt_rows,
        prompt_logprobs=count if prompt_rows else None,
    )

    def finish(outputs: list) -> tuple[list, list[dict]]:
        rows = source.take(tags[: 1 + len(prompt_rows)])
        output = outputs[0]
        reported = [output.prompt_logprobs[position + 1] for position, _ in prompt_rows]
        return rows, [output.outputs[0].logprobs[0], *reported]

    def discard() -> None:
        source.take(tags, discard=True)

    rows, reported = engine.run([request], finish, discard).result()
    if rows[0] is None:
        raise RuntimeError(hook_error("no logits were recorded for its startup check"))
    spread = _spread(rows[0], reported[0])
    if not spread <= _CHECK_TOLERANCE:
        raise RuntimeError(
            hook_error(
                f"its captured log-probabilities differ from vLLM's own by up to "
                f"{spread:.3g} nats (tokens {list(reported[0])}); with the V2 model "
                "runner, try VLLM_USE_V2_MODEL_RUNNER=0"
            )
        )
    spreads = [_spread(row, own) for row, own in zip(rows[1:], reported[1:], strict=True)]
    if all(spread <= _CHECK_TOLERANCE for spread in spreads):
        return chains
    logger.warning(
        "genlm-backend: rows read at prompt positions differ from vLLM's own prompt "
        "log-probabilities (spreads %s nats); every query gets a request of its own",
        spreads,
    )
    return False


def _spread(row: Any, reported: dict) -> float:
    """Spread over the tokens of `reported` (vLLM's `Logprob`s) of `row` minus them."""
    if row is None:
        return float("inf")
    token_ids = list(reported)
    captured = row[token_ids].double().cpu()
    own = torch.tensor([reported[t].logprob for t in token_ids], dtype=torch.float64)
    offsets = captured - own
    return (offsets.max() - offsets.min()).item()


def probe_request() -> EngineRequest:
    """A greedy one-token request with a one-token prompt: whether the engine still runs."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
    )
    return EngineRequest((0,), params, None)


def refused(outcome: Any) -> bool:
    """Whether a request's outcome is the error its check returned (it never ran)."""
    return isinstance(outcome, BaseException)


def raise_first_error(outcomes: list) -> list:
    """`outcomes` if none is an error; else the first error is raised (a sync call's)."""
    for outcome in outcomes:
        if refused(outcome):
            raise outcome
    return outcomes


def until_stop(token_ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """The generated tokens up to the first stopping token, which is left out."""
    stop = set(stop_ids)
    tokens = []
    for token_id in token_ids:
        if token_id in stop:
            break
        tokens.append(int(token_id))
    return tokens
