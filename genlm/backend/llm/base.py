"""The asynchronous language-model interface and a model-free mock."""

from __future__ import annotations

import array
import asyncio
import hashlib
import numbers
import operator
import sys
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import numpy as np
import torch

from genlm.backend.tokenization import decode_vocab

if TYPE_CHECKING:
    from genlm.backend.cache import OutputCache


# The output cache's memory budget where the backend sizes it: `AsyncTransformer`'s and
# `AsyncMlxLM`'s default, and what `from_name` of `AsyncVirtualLM` and `AsyncSGLTransformer`
# give unless told otherwise.
DEFAULT_OUTPUT_CACHE_BYTES = 256 * 1024**2
# Contexts at least this long have their ids' range checked packed into an array (one C
# pass, then numpy's max): 9.5 against 21 us for 430 ids, 26 against 97 us for 2,000;
# Python's `min` and `max` are faster below about 100 ids.
_PACKED_RANGE_CHECK = 128


def with_default_output_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Constructor `kwargs` with an output cache bounded in bytes, unless they size it.

    For backends whose constructor takes `cache_size` (entries, `0` = off) and
    `cache_opts` (further `OutputCache` options): without `cache_size`, the cache
    holds as many rows as `DEFAULT_OUTPUT_CACHE_BYTES` (or `cache_opts["max_bytes"]`)
    allow.
    """
    if "cache_size" in kwargs:
        return kwargs
    cache_opts = {"max_bytes": DEFAULT_OUTPUT_CACHE_BYTES, **(kwargs.get("cache_opts") or {})}
    return {**kwargs, "cache_size": sys.maxsize, "cache_opts": cache_opts}


async def rows_through_cache(
    cache: OutputCache,
    keys: Sequence[Hashable],
    compute: Callable[[int], Awaitable[torch.Tensor]],
) -> torch.Tensor:
    """The rows of `keys` in one new tensor, copied from the output cache at once.

    The rows not cached are computed first (awaited concurrently; the backend
    stores them in `cache`), the cached ones marked recently used meanwhile.
    When every row was computed, they are the result (`stack_rows`: the
    backend's tensor itself when they are all its rows, in order). Otherwise
    every row is copied out of `cache` in one operation per run of rows stored
    apart, not one per row. Rows the cache no longer holds (evicted while the
    others were computed, or never stored) are computed again if needed and
    copied one by one.

    Args:
        cache: The backend's output cache.
        keys: One cache key per row.
        compute: `compute(i)` gives the row of `keys[i]` (e.g. a batcher's `submit`).

    Returns:
        A 2-D tensor, row `i` for `keys[i]`.
    """

    async def computed_rows(indices: list[int]) -> dict[int, torch.Tensor]:
        results = await asyncio.gather(*(compute(i) for i in indices))
        return dict(zip(indices, results, strict=True))

    computed = await computed_rows(cache.touch(keys))
    if keys and len(computed) == len(keys):
        return stack_rows([computed[i] for i in range(len(keys))])
    rows, lost = cache.get_rows(keys)
    computed.update(await computed_rows([i for i in lost if i not in computed]))
    if rows is None:
        return torch.stack([computed[i] for i in range(len(keys))])
    for i in lost:
        rows[i].copy_(computed[i])
    return rows


def stack_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """`rows` (one shape, dtype and device) as one tensor, row `i` being `rows[i]`.

    When the rows are, in this order, all the rows of one tensor (a backend's
    result for exactly these contexts), that tensor is returned without a copy:
    give only rows the caller owns. Otherwise they are stacked into a new one.
    """
    first = rows[0]
    row_numel, storage = first.numel(), first.untyped_storage()
    whole = storage.nbytes() == len(rows) * row_numel * first.element_size()
    for i, row in enumerate(rows if whole else ()):
        same_memory = row.untyped_storage().data_ptr() == storage.data_ptr()
        if not (same_memory and row.is_contiguous() and row.storage_offset() == i * row_numel):
            whole = False
            break
    if not whole:
        return torch.stack(rows)
    return first.as_strided((len(rows), *first.shape), (row_numel, *first.stride()), 0)


class TokenIds(tuple):
    """A checked context: a tuple of token ids that hashes once.

    A tuple's hash is recomputed at every dict lookup, in time linear in its
    length; a context is looked up in several dicts per query (the output
    cache, the batcher, vLLM's live requests), so this one keeps its hash,
    and its `prefix` (all ids but the last), once made. It equals, and hashes
    like, the plain tuple of its ids; it compares as a tuple does, in C (a
    Python `__eq__` is a call from every dict lookup that meets an equal key).
    """

    _hash: int | None = None
    _prefix: TokenIds | None = None

    def __hash__(self) -> int:
        value = self._hash
        if value is None:
            value = self._hash = tuple.__hash__(self)
        return value

    @property
    def prefix(self) -> TokenIds:
        """The context less its last token id (made on first use, then kept)."""
        prefix = self._prefix
        if prefix is None:
            prefix = self._prefix = TokenIds(self[:-1])
        return prefix

    def adopt_prefix(self, prefix: TokenIds) -> None:
        """Keep `prefix`, which must equal this context less its last id, as `prefix`: where
        the two meet as dict keys they are then compared by identity, not id by id."""
        self._prefix = prefix

    def drop_prefix(self) -> None:
        """Forget the kept `prefix` (made again if asked): a context that adopted an earlier
        one, which adopted one earlier still, would otherwise keep them all alive."""
        self._prefix = None


# Checked per call: tuples, not unions, which each `isinstance` would build anew.
_ARRAYS, _TEXT = (torch.Tensor, np.ndarray), (str, bytes)


def check_token_ids(
    token_ids: Sequence[int], vocab_size: int, max_length: int | None = None
) -> TokenIds:
    """Validate a context of token ids at the API boundary.

    Args:
        token_ids: The context; a sequence of ints (a 1-D tensor or array works too).
        vocab_size: Ids must lie in `[0, vocab_size)`.
        max_length: Longest accepted context, if the model has one.

    Returns:
        The ids as a tuple of Python ints (a `TokenIds`).

    Raises:
        ValueError: If the context is empty, too long, not a flat sequence, or
            holds an id that is not an integer or lies outside the vocabulary.
    """
    if isinstance(token_ids, _ARRAYS):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, _TEXT) or not isinstance(token_ids, Sequence):
        raise ValueError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise ValueError("token_ids is empty: a context needs at least one token (e.g. BOS)")
    ids = tuple(token_ids)
    # Plain ints in range (the usual case) pass in one sweep (counting the types that are
    # `int`: 27 ns an id, against 45 for the set of the types); anything else is looked at
    # one by one, to convert other integer types or to say which id is wrong.
    if not (operator.countOf(map(type, ids), int) == len(ids) and _in_range(ids, vocab_size)):
        for position, token_id in enumerate(ids):
            if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
                raise ValueError(
                    f"token_ids[{position}] = {token_id!r} is not an integer "
                    f"({type(token_id).__name__})"
                )
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"token_ids[{position}] = {token_id} is outside the vocabulary "
                    f"[0, {vocab_size})"
                )
        ids = tuple(int(t) for t in ids)
    if max_length is not None and len(ids) > max_length:
        raise ValueError(f"token_ids has {len(ids)} tokens; the model accepts at most {max_length}")
    return TokenIds(ids)


def _in_range(ids: tuple[int, ...], vocab_size: int) -> bool:
    """Whether all of `ids` (Python ints, in a plain tuple: `array` reads one of a subclass item
    by item, 8 times slower) lie in `[0, vocab_size)`."""
    if len(ids) < _PACKED_RANGE_CHECK:
        return 0 <= min(ids) and max(ids) < vocab_size
    try:
        packed = array.array("I", ids)  # unsigned C ints: a negative id overflows
    except OverflowError:
        return False
    return int(np.frombuffer(packed, dtype=packed.typecode).max()) < vocab_size


AdapterT = TypeVar("AdapterT")


class LoraRegistry(Generic[AdapterT]):
    """The LoRA adapters a backend has registered, by name, and the active one.

    Every backend keeps one; it holds whatever the engine needs per adapter
    (a name for peft, a `LoRARequest` for vLLM, ...). `select` turns a call's
    `lora_name` into the adapter name to use: `None` means the adapter made
    active by `set_lora`, else the base model (also `None`).

    Attributes:
        active: Name of the adapter `lora_name=None` selects, or `None`.
    """

    def __init__(self) -> None:
        self._adapters: dict[str, AdapterT] = {}
        self.active: str | None = None

    @property
    def names(self) -> list[str]:
        """Names of the registered adapters, in registration order."""
        return list(self._adapters)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __getitem__(self, name: str) -> AdapterT:
        return self._adapters[self.check(name)]

    def add(self, name: str, adapter: AdapterT) -> None:
        """Register `adapter` under `name` (replacing an adapter of that name).

        Raises:
            TypeError: If `name` is not a string.
        """
        if not isinstance(name, str):
            raise TypeError(f"lora_name must be a str, got {type(name).__name__}")
        self._adapters.pop(name, None)
        self._adapters[name] = adapter

    def remove(self, name: str) -> AdapterT:
        """Unregister `name` (deactivating it if active) and return its adapter.

        Raises:
            ValueError: If no adapter is registered under `name`.
        """
        adapter = self._adapters.pop(self.check(name))
        if self.active == name:
            self.active = None
        return adapter

    def check(self, name: str) -> str:
        """Return `name` if an adapter is registered under it.

        Raises:
            ValueError: If none is; the message lists the registered adapters.
        """
        if not isinstance(name, str) or name not in self._adapters:
            registered = ", ".join(map(repr, self._adapters)) or "none"
            raise ValueError(
                f"no LoRA adapter named {name!r}; registered adapters: {registered} "
                "(register one with add_new_lora(lora_path, lora_name))"
            )
        return name

    def removed_error(self, name: str) -> ValueError:
        """The error of a query queued under adapter `name`, since removed.

        Backends check a batch's adapters when it runs and give this error to
        the queries of a removed one, instead of running them on whatever the
        engine has left under that name.
        """
        registered = ", ".join(map(repr, self._adapters)) or "none"
        return ValueError(
            f"LoRA adapter {name!r} was removed while this query waited; "
            f"registered adapters: {registered}"
        )

    def select(self, lora_name: str | None) -> str | None:
        """The adapter a call with `lora_name` uses (`None`: the base model).

        Args:
            lora_name: A registered adapter's name, or `None` for the active
                adapter (the base model when none is active).

        Raises:
            ValueError: If `lora_name` is not registered.
        """
        return self.active if lora_name is None else self.check(lora_name)


class AsyncLM(ABC):
    """A language model that answers next-token log-probability queries.

    Concurrent `await`s of `next_token_logprobs` are batched by the backend.

    Every backend's rows follow one contract: a float32 tensor on `device`
    with exactly `vocab_size == len(str_vocab)` columns, column `i` holding
    `log P(next token = i | context)` as the model computes it over its whole
    output layer. A padded output layer (wider than the tokenizer) is cut to
    the tokenizer's ids, so a row's `logsumexp` is the log-probability that
    the next token is one of the tokenizer's (0 up to float32 rounding for a
    model without padding); ids the output layer lacks (tokens added to the
    tokenizer past it) are `-inf`.

    Every query method takes `lora_name=None`: `None` uses the adapter made
    active by `set_lora` (the base model when none is), a registered adapter's
    name uses that adapter for this call only.

    Args:
        tokenizer: A Hugging Face tokenizer; its exact byte vocabulary becomes
            `byte_vocab` (and `str_vocab`), see `decode_vocab`.

    Attributes:
        tokenizer: The tokenizer.
        byte_vocab: `byte_vocab[i]` is the `Token` of id `i`.
        str_vocab: `str_vocab[i]` is the text of token `i`.
        vocab_size: Length of a logprobs row: `len(str_vocab)` (the tokenizer's
            length); set by each backend.
        device: The `torch.device` its rows live on (the CPU unless a backend
            computes them elsewhere); draws from them (`genlm.backend.draw`)
            run there.
        loras: The registered LoRA adapters (none for backends without LoRA).
    """

    vocab_size: int
    device: torch.device = torch.device("cpu")

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_vocab, self.str_vocab = decode_vocab(tokenizer)
        self.loras: LoraRegistry[Any] = LoraRegistry()

    @abstractmethod
    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token after `token_ids`.

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 1-D float32 tensor of `vocab_size` log-probabilities on
            `device` (see the class), owned by the caller.
        """

    @abstractmethod
    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Synchronous `next_token_logprobs`.

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 1-D float32 tensor of `vocab_size` log-probabilities on
            `device` (see the class), owned by the caller.
        """

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Next-token log-probabilities of several contexts, computed concurrently.

        Args:
            token_ids_list: The contexts (may be empty).
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 2-D tensor, one row per context, in input order (`(0, vocab_size)`
            for no context).
        """
        if len(token_ids_list) == 0:
            self.loras.select(lora_name)
            return torch.empty((0, self.vocab_size))
        rows = await asyncio.gather(
            *(self.next_token_logprobs(ids, lora_name=lora_name) for ids in token_ids_list)
        )
        return torch.stack(rows)

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Synchronous `batch_next_token_logprobs`.

        Args:
            token_ids_list: The contexts (may be empty).
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 2-D tensor, one row per context, in input order (`(0, vocab_size)`
            for no context).
        """
        if len(token_ids_list) == 0:
            self.loras.select(lora_name)
            return torch.empty((0, self.vocab_size))
        return torch.stack(
            [self.next_token_logprobs_sync(ids, lora_name=lora_name) for ids in token_ids_list]
        )

    async def sample(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Ancestral sampling from the model.

        Args:
            prompt_token_ids: The prompt.
            max_tokens: Most tokens to generate.
            eos_token_ids: Sampling stops at the first of these (not returned).
            temperature: Divides the logits; must be positive.
            seed: Seeds the sampler; the same seed gives the same tokens.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            The generated token ids, without the prompt or the stopping token.

        Raises:
            ValueError: If `max_tokens` is negative, `temperature` is not
                positive or `lora_name` is not registered.
        """
        check_sampling_args(max_tokens, temperature)
        self.loras.select(lora_name)
        generator = torch.Generator()
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
        stop = set(eos_token_ids)
        context, generated = list(prompt_token_ids), []
        for _ in range(max_tokens):
            logprobs = await self.next_token_logprobs(context, lora_name=lora_name)
            token_id = draw_token(logprobs, temperature, generator)
            if token_id in stop:
                break
            generated.append(token_id)
            context.append(token_id)
        return generated

    async def batch_sample(
        self,
        prompt_token_ids_list: Sequence[Sequence[int]],
        max_tokens: int,
        eos_token_ids: Sequence[int],
        temperature: float = 1.0,
        seed: int | None = None,
        lora_name: str | None = None,
    ) -> list[list[int]]:
        """Sample a continuation of each prompt, concurrently.

        Args:
            prompt_token_ids_list: The prompts.
            max_tokens: Most tokens to generate per prompt.
            eos_token_ids: Sampling stops at the first of these (not returned).
            temperature: Divides the logits; must be positive.
            seed: Seeds the samplers (prompt `i` uses `seed + i`).
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            One list of generated token ids per prompt, in input order.
        """
        return list(
            await asyncio.gather(
                *(
                    self.sample(
                        prompt,
                        max_tokens,
                        eos_token_ids,
                        temperature,
                        None if seed is None else seed + i,
                        lora_name=lora_name,
                    )
                    for i, prompt in enumerate(prompt_token_ids_list)
                )
            )
        )

    def clear_cache(self) -> None:  # noqa: B027 - a backend without caches has nothing to clear
        """Drop cached results (backends with caches override this)."""

    def cleanup(self) -> None:  # noqa: B027 - a backend without an engine has nothing to release
        """Release the engine the backend drives (backends with one override this).

        Leaving a `with` or `async with` block over the backend calls it.
        """

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.cleanup()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.cleanup()

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Register a LoRA adapter (not supported by this backend)."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        """Activate a LoRA adapter (not supported by this backend)."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def clear_lora(self) -> None:
        """Deactivate LoRA adapters (not supported by this backend)."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")

    def remove_lora(self, lora_name: str) -> None:
        """Unregister a LoRA adapter (not supported by this backend)."""
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")


def check_sampling_args(max_tokens: int, temperature: float) -> None:
    """Raise `ValueError` for a negative `max_tokens` or a non-positive `temperature`."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral):
        raise ValueError(f"max_tokens must be an int, got {max_tokens!r}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be non-negative, got {max_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def draw_token(logprobs: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Draw one token id from `softmax(logprobs / temperature)` with `generator`."""
    probs = torch.softmax(logprobs.detach().to("cpu", torch.float64) / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class MockAsyncLM(AsyncLM):
    """A model-free `AsyncLM` for tests.

    Its log-probabilities are pseudo-random but a pure function of the token
    ids: the same ids give the same tensor in every instance and process.

    Args:
        tokenizer: A Hugging Face tokenizer; the vocabulary size is `len(tokenizer)`.
    """

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self.vocab_size = len(tokenizer)

    @classmethod
    def from_name(cls, model_name: str, **kwargs: Any) -> MockAsyncLM:
        """Load only the tokenizer of `model_name` (a hub name or a folder).

        Args:
            model_name: Passed to `AutoTokenizer.from_pretrained`.
            **kwargs: Passed to `AutoTokenizer.from_pretrained`.

        Returns:
            A `MockAsyncLM` over that tokenizer.
        """
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_name, **kwargs))

    def _logprobs(self, token_ids: Sequence[int], lora_name: str | None) -> torch.Tensor:
        self.loras.select(lora_name)
        ids = check_token_ids(token_ids, self.vocab_size)
        digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        logits = torch.randn(self.vocab_size, generator=generator)
        return torch.log_softmax(logits, dim=-1)

    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Pseudo-random log-probabilities determined by `token_ids`.

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: Must be `None`: the mock has no adapters.

        Returns:
            A 1-D tensor of length `len(tokenizer)` with `logsumexp == 0`.

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or any `lora_name`.
        """
        return self._logprobs(token_ids, lora_name)

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Synchronous `next_token_logprobs`.

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: Must be `None`: the mock has no adapters.

        Returns:
            A 1-D tensor of length `len(tokenizer)` with `logsumexp == 0`.

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or any `lora_name`.
        """
        return self._logprobs(token_ids, lora_name)
