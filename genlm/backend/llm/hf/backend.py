"""The transformers backend: `AsyncTransformer` (and the `Query` it batches, from `query`).

How a batch is evaluated (planned passes, the batch buffer, the prefix tree,
the working-memory bound) is `forward.ForwardPasses`, and the LoRA adapters
are `adapters.PeftAdapters`, both of which the backend owns; this module is
the public surface: queries, caches, adapters.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

from genlm.backend.batching import AutoBatcher
from genlm.backend.cache import KVPrefixCache, OutputCache, PrefixMatch, PrefixNode
from genlm.backend.llm.base import AsyncLM, check_token_ids, rows_through_cache
from genlm.backend.llm.hf.adapters import PeftAdapters
from genlm.backend.llm.hf.forward import ForwardPasses
from genlm.backend.llm.hf.query import Query
from genlm.backend.llm.rows import fit_width

DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
# Results of recent queries: 256 MiB holds 1,365 rows of a 49,152-token vocabulary (float32),
# enough for an LLM critic that rescores every prefix of 32 particles' contexts for 32 steps
# without recomputing one (`python -m benchmarks scoring`).
DEFAULT_OUTPUT_CACHE_BYTES = 256 * 1024**2
DEFAULT_MAX_BATCH_BYTES = 2 * 1024**3


class AsyncTransformer(AsyncLM):
    """A Hugging Face causal LM with automatic batching and prefix caching.

    Concurrent `next_token_logprobs` calls are batched (see `batch_size`,
    `timeout`); a batch runs the model once over the tokens of the tree its
    contexts spell that no cached prefix covers: a context that is a prefix of
    another one of the batch is read from the longer one's row, at its own
    position. Key/values of every evaluated context are kept in a radix
    tree bounded by `kv_cache_bytes` (least recently used, unlocked entries are
    evicted first; a sampler's last step, and that of a second sequence of
    batches such as an LLM critic's, stays in a batch buffer until no batch
    continues it); results are kept in an `OutputCache` bounded
    by `output_cache_bytes` (and by `cache_size` rows, if given); a batch's
    working memory stays within `max_batch_bytes`.
    Results agree with `next_token_logprobs_uncached` (a plain forward pass).

    Args:
        hf_model: A `transformers` causal LM (e.g. from `AutoModelForCausalLM`).
        hf_tokenizer: Its tokenizer.
        batch_size: A batch runs as soon as this many distinct queries wait (or
            when the event loop goes quiet; see `genlm.backend.batching`).
        timeout: ... or this many seconds after the oldest waiting query arrived.
        kv_cache_bytes: Memory budget of the key/value prefix cache, in bytes.
        cache_size: Most results (log-probability rows) kept; `None`: as many
            as `output_cache_bytes` holds.
        output_cache_bytes: Memory budget of the kept results, in bytes.
        max_batch_bytes: Bound on the working memory of batches, in bytes: the
            two key/value buffers successive batches reuse, and the
            activations and logits of the running one. A batch that would need
            more runs as several sub-batches (results identical, in order), and
            a row too big alone (all prefixes of a long document, say) as
            consecutive segments of its context; on an accelerator a sub-batch
            also fits the memory free there. A pass that runs out of memory
            anyway is retried in halves, down to one token of one row.

    A query that cannot run fails its own callers only: a context whose
    key/values alone pass the bound is a `ValueError` when queried; one that
    the bound cannot hold when its batch runs, a query whose adapter was
    removed while it waited, or a row that runs out of memory by itself gets
    its error in place of its result, while the rest of the batch runs. Any
    other error of a forward pass reaches the queries of that pass's adapter.

    Raises:
        ValueError: If `max_batch_bytes` cannot hold a batch of one one-token
            context.
        TypeError: If `max_batch_bytes` is not an int.

    Attributes:
        model: The model (wrapped in a `peft.PeftModel` once an adapter is added).
        vocab_size: Length of a logprobs row: the tokenizer's length (see `fit_width`).
        kv_cache: The `KVPrefixCache`, one tree per adapter.
        output_cache: The `OutputCache` of results, keyed by `(adapter, token_ids)`.
    """

    def __init__(
        self,
        hf_model: Any,
        hf_tokenizer: Any,
        batch_size: int = 20,
        timeout: float = 0.02,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        cache_size: int | None = None,
        output_cache_bytes: int = DEFAULT_OUTPUT_CACHE_BYTES,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    ):
        super().__init__(hf_tokenizer)
        self.kv_cache = KVPrefixCache(kv_cache_bytes)
        self.output_cache = OutputCache(
            sys.maxsize if cache_size is None else cache_size, max_bytes=output_cache_bytes
        )
        # Batches of event loops in different threads, and sync calls, take turns.
        self._model_lock = threading.RLock()
        self._passes = ForwardPasses(
            hf_model.eval(),
            self.loras,
            self.kv_cache,
            self.output_cache,
            max_batch_bytes,
            self._model_lock,
            row_width=len(self.byte_vocab),
        )
        self._adapters = PeftAdapters(
            self._passes, self.loras, self.kv_cache, self.output_cache, self._model_lock
        )
        self.vocab_size = len(self.byte_vocab)
        # Ids a context may hold: the tokenizer's, less those past the input embeddings.
        self._id_bound = min(self.vocab_size, self._passes.model_pass.n_embeddings)
        self._batcher: AutoBatcher[Query, torch.Tensor] = AutoBatcher(
            self._passes.evaluate, batch_size, timeout, key=lambda query: query.key
        )

    @classmethod
    def from_name(
        cls,
        model_id: str,
        bitsandbytes_opts: dict[str, Any] | None = None,
        hf_opts: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> AsyncTransformer:
        """Load a model and its tokenizer with `from_pretrained`.

        Args:
            model_id: A hub name or a local folder.
            bitsandbytes_opts: Options of a `transformers.BitsAndBytesConfig`
                (e.g. `{"load_in_8bit": True}`) to load the weights quantised.
            hf_opts: Keyword arguments of `AutoModelForCausalLM.from_pretrained`;
                defaults `device_map="auto"`, `dtype="auto"`.
            **kwargs: Passed to the constructor (`batch_size`, `timeout`, ...).

        Returns:
            The loaded `AsyncTransformer`.

        Raises:
            ImportError: If `bitsandbytes_opts` is given and bitsandbytes is not installed.
        """
        model, tokenizer = _load_pretrained(model_id, bitsandbytes_opts, hf_opts)
        return cls(model, tokenizer, **kwargs)

    @property
    def batch_size(self) -> int:
        """A batch runs as soon as this many distinct queries wait."""
        return self._batcher.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batcher.batch_size = value

    @property
    def timeout(self) -> float:
        """A batch runs this many seconds after the oldest waiting query arrived."""
        return self._batcher.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._batcher.timeout = value

    @property
    def model(self) -> Any:
        """The model (wrapped in a `peft.PeftModel` once an adapter is added)."""
        return self._passes.model_pass.model

    @property
    def device(self) -> torch.device:
        """Where rows live: the device of the model's output layer (its logits)."""
        head = self.model.get_output_embeddings()
        return head.weight.device if head is not None else self.model.device

    @model.setter
    def model(self, value: Any) -> None:
        self._passes.model_pass.model = value

    @property
    def max_batch_bytes(self) -> int:
        """Bound on the working memory of batches, in bytes (see the constructor).

        Raises:
            ValueError: On assignment, if it cannot hold a batch of one one-token context.
            TypeError: On assignment, if it is not an int.
        """
        return self._passes.memory.max_batch_bytes

    @max_batch_bytes.setter
    def max_batch_bytes(self, value: int) -> None:
        self._passes.memory.max_batch_bytes = value

    @property
    def queries(self) -> list[Query]:
        """The queries waiting for a batch, oldest first.

        Assigning a list keeps only the queued queries in it: `lm.queries = []`
        drops every queued query, and the callers of dropped queries get
        `asyncio.CancelledError` (nobody is left waiting).

        Raises:
            ValueError: On assignment, if the list holds a query that is not
                queued (queue queries with `add_query`).
        """
        return self._batcher.pending

    @queries.setter
    def queries(self, value: Sequence[Query]) -> None:
        queued = {id(query) for query in self._batcher.pending}
        kept = {id(query) for query in value}
        if not kept <= queued:
            raise ValueError(
                "lm.queries may only be set to a selection of the queued queries "
                "(e.g. []); queue new ones with add_query(token_ids, future, past)"
            )
        self._batcher.retain(lambda query: id(query) in kept)

    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token; concurrent calls are batched.

        Calls for different adapters in one batching window are served by
        one forward pass per adapter.

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 1-D float32 tensor of `vocab_size` log-probabilities (see `AsyncLM`).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`), a context whose
                key/values alone pass `max_batch_bytes`, or an unknown `lora_name`.
        """
        query = Query(self._check(token_ids), self.loras.select(lora_name))
        cached = self.output_cache.get(query.key)
        if cached is not None:
            return cached
        return await self._batcher.submit(query)

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Next-token log-probabilities of several contexts, batched with concurrent calls.

        The contexts without a cached result are queued like `next_token_logprobs`
        calls (one batch with whatever else is waiting), so scoring every prefix
        of a context that grew by a token computes only the new prefix. Then
        every row is copied from the output cache, where the computed ones were
        stored, into the returned tensor at once (one operation per run of rows
        stored apart, not one per row); when every row was computed by one pass
        that computed nothing else, that pass's tensor is returned as it is.

        Args:
            token_ids_list: The contexts (may be empty).
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 2-D tensor, one row per context, in input order (`(0, vocab_size)`
            for no context), owned by the caller.

        Raises:
            ValueError: For bad token ids (see `check_token_ids`), a context whose
                key/values alone pass `max_batch_bytes`, or an unknown `lora_name`.
        """
        queries = self._queries(token_ids_list, lora_name)
        if not queries:
            return torch.empty((0, self.vocab_size))
        keys = [query.key for query in queries]
        submit = self._batcher.submit
        return await rows_through_cache(self.output_cache, keys, lambda i: submit(queries[i]))

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token, computed now (no batching; caches used).

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 1-D float32 tensor of `vocab_size` log-probabilities (see `AsyncLM`).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`), a context whose
                key/values alone pass `max_batch_bytes`, or an unknown `lora_name`.
        """
        return self.batch_next_token_logprobs_sync([token_ids], lora_name=lora_name)[0]

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities after each context, computed now in one batch.

        Args:
            token_ids_list: The contexts (may be empty).
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 2-D tensor, one row per context, in input order (`(0, vocab_size)`
            for no context).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`), a context whose
                key/values alone pass `max_batch_bytes`, or an unknown `lora_name`.
        """
        queries = self._queries(token_ids_list, lora_name)
        if not queries:
            return torch.empty((0, self.vocab_size))
        distinct = {query.key: query for query in queries}
        results = dict(zip(distinct, self._passes.evaluate(list(distinct.values())), strict=True))
        for result in results.values():
            if isinstance(result, Exception):
                raise result
        return torch.stack([results[query.key] for query in queries])

    def next_token_logprobs_uncached(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token from a plain forward pass, no cache of any kind.

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 1-D float32 tensor of `vocab_size` log-probabilities (see `AsyncLM`).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
        """
        adapter = self.loras.select(lora_name)
        model_pass = self._passes.model_pass
        ids = check_token_ids(token_ids, self._id_bound, model_pass.max_length)
        input_ids = torch.tensor([ids], dtype=torch.long, device=model_pass.device)
        with self._model_lock, torch.no_grad():
            logits = model_pass.call_model(adapter, input_ids=input_ids, use_cache=False)
        return fit_width(torch.log_softmax(logits.logits[0, -1].float(), dim=-1), self.vocab_size)

    def cache_kv(self, prompt_tokens: Sequence[int], lora_name: str | None = None) -> None:
        """Compute and keep the key/values (and the result) of a prompt.

        Later queries that extend the prompt (under the same adapter) then only
        run the model on their new tokens (as long as the prompt is not evicted).

        Args:
            prompt_tokens: The prompt's token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`), a context whose
                key/values alone pass `max_batch_bytes`, or an unknown `lora_name`.
        """
        with self._model_lock:
            self.next_token_logprobs_sync(prompt_tokens, lora_name=lora_name)
            self._passes.spill()

    def walk_cache(
        self, token_ids: Sequence[int]
    ) -> tuple[PrefixNode, int, PrefixMatch | None, int]:
        """Find the longest cached prefix of `token_ids` (under the active adapter).

        Args:
            token_ids: The context.

        Returns:
            `(node, next_token_index, past, base)`: the deepest cache node the
            prefix reaches (its `past_key_values` holds its edge's key/values,
            `None` at the root; the match may end inside the edge), the number
            of tokens matched, the matched key/value state (a `PrefixMatch`,
            `None` when nothing matched) and the index where that state ends.
            Every cached token carries key/values, so `next_token_index == base`.
        """
        with self._model_lock:
            self._passes.spill()
            found = self.kv_cache.match(token_ids, self.loras.active)
        return found.node, found.length, found if found.length else None, found.length

    def add_query(
        self,
        query: Query | Sequence[int],
        future: asyncio.Future,
        past: PrefixMatch | None,
        lora_name: str | None = None,
    ) -> None:
        """Queue a query; `future` receives its log-probabilities when its batch has run.

        Only the tokens not covered by `past` (or by a longer cached prefix) are
        run through the model.

        Args:
            query: The context's token ids (as in 0.3.x), or a `Query`.
            future: A future of the running event loop.
            past: A cached prefix of the query's tokens, e.g. from `walk_cache`.
            lora_name: The adapter for token ids (`None`: the active one, if
                any); for a `Query`, replaces its adapter unless `None`.

        Raises:
            ValueError: For bad token ids (see `check_token_ids`), a context whose
                key/values alone pass `max_batch_bytes`, or an unknown `lora_name`.
        """
        if isinstance(query, Query):
            query.token_ids = self._check(query.token_ids)
            if lora_name is not None:
                query.adapter = self.loras.check(lora_name)
        else:
            query = Query(self._check(query), self.loras.select(lora_name))
        if past is not None:
            query.past = past
        self._batcher.add(query, future)

    def batch_evaluate_queries(self) -> None:
        """Evaluate every queued query now (nothing queued: no-op)."""
        self._batcher.flush()

    def reset_async_queries(self) -> None:
        """Drop the queued queries; their callers get `asyncio.CancelledError`."""
        self._batcher.reset()

    def clear_cache(self) -> None:
        """Drop every cached result and key/value, and the batches' reusable buffers."""
        self.output_cache.clear()
        self.kv_cache.clear()
        self._passes.release()

    def clear_kv_cache(self) -> None:
        """Drop every cached key/value (cached results stay)."""
        self.kv_cache.clear()
        self._passes.forget_batches()

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Load a peft LoRA adapter under `lora_name` (it is not activated).

        Args:
            lora_path: Folder of the adapter (as written by `save_pretrained`).
            lora_name: Name to select it by (`set_lora`, or `lora_name=` per
                call). Loading an adapter under a name in use replaces it and
                drops what was cached for the old one.

        Raises:
            ImportError: If peft is not installed.
        """
        self._adapters.add(lora_path, lora_name)

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        """Activate an adapter, loading it from `lora_path` first if it is new.

        Args:
            lora_path: Folder of the adapter; needed only if `lora_name` was not added.
            lora_name: The adapter that calls with `lora_name=None` use from now on.

        Raises:
            ValueError: If `lora_name` was never added and no `lora_path` is given.
        """
        self._adapters.activate(lora_path, lora_name)

    def clear_lora(self) -> None:
        """Deactivate LoRA adapters: calls with `lora_name=None` use the base model."""
        self._adapters.deactivate()

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter and drop every result and key/value cached for it.

        Args:
            lora_name: A registered adapter (if active, the base model becomes active).

        Raises:
            ValueError: If no adapter is registered under `lora_name`.
        """
        self._adapters.remove(lora_name)

    def _queries(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None
    ) -> list[Query]:
        """Checked queries of a batch call (the adapter is checked even for no context)."""
        adapter = self.loras.select(lora_name)
        return [Query(self._check(ids), adapter) for ids in token_ids_list]

    def _check(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Checked token ids of a context that the working-memory bound can hold."""
        ids = check_token_ids(token_ids, self._id_bound, self._passes.model_pass.max_length)
        self._passes.memory.check_fits(ids)
        return ids


def _load_pretrained(
    model_id: str, bitsandbytes_opts: dict[str, Any] | None, hf_opts: dict[str, Any] | None
) -> tuple[Any, Any]:
    """A model and its tokenizer from `from_pretrained` (see `AsyncTransformer.from_name`).

    Args:
        model_id: A hub name or a local folder.
        bitsandbytes_opts: Options of a `transformers.BitsAndBytesConfig`, or `None`.
        hf_opts: Keyword arguments of `AutoModelForCausalLM.from_pretrained`;
            defaults `device_map="auto"`, `dtype="auto"`.

    Returns:
        The model and the tokenizer.

    Raises:
        ImportError: If `bitsandbytes_opts` is given and bitsandbytes is not installed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_opts = {"device_map": "auto", "dtype": "auto", **(hf_opts or {})}
    if bitsandbytes_opts is not None:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "bitsandbytes_opts needs bitsandbytes: pip install 'genlm-backend[quantization]'"
            ) from error
        from transformers import BitsAndBytesConfig

        model_opts["quantization_config"] = BitsAndBytesConfig(**bitsandbytes_opts)
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    model = AutoModelForCausalLM.from_pretrained(model_id, **model_opts)
    return model, tokenizer
