"""The MLX backend: `AsyncMlxLM`, on Apple silicon or MLX's Linux CPU build.

The same machinery as the transformers backend (`llm.hf`), with MLX as the engine:

1. Concurrent queries are batched by the shared `AutoBatcher`; results are
   kept in an `OutputCache` and the key/values of every evaluated context in a
   `KVPrefixCache` (one tree per adapter, as CPU tensors).
2. A batch lays its rows' cached prefixes out per layer as
   `[past (right-padded) | new tokens]` (`runtime.BatchLayerCache`, which
   takes the place of mlx-lm's cache layers); a mask and per-row RoPE offsets
   let rows with different prefix lengths share one forward pass.
3. The new tokens' key/values go into the tree, and the logits at each
   position read become its result (log-softmax in float32); the output
   projection runs at those positions only (`runtime.read_logits`).

Batches are planned as `AsyncTransformer`'s (`passes.plan_passes`), and a pass
whose rows differ much in length runs in `passes.sub_batches`, so that padding
at most about doubles its work.

A sampler's next step usually extends every row of the last batch by a token:
it then continues in the last batch's arrays (`KVWorkspace`, shared with the transformers backend,
tells which row holds each new row's prefix), rows reordered only after
resampling, so a step costs about one token of compute per particle.

Released clients import `AsyncMlxLM` whether or not they use it, so this
module imports without MLX; MLX itself is imported when a model is built.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from genlm.backend.batching import AutoBatcher
from genlm.backend.cache import KVPrefixCache, OutputCache, PrefixMatch
from genlm.backend.llm.base import DEFAULT_OUTPUT_CACHE_BYTES, AsyncLM, check_token_ids
from genlm.backend.llm.kv_workspace import KVWorkspace
from genlm.backend.llm.passes import Row, plan_passes, sub_batches
from genlm.backend.llm.rows import fit_width

DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
# Padding new tokens a sub-batch may add per real one (`sub_batches`), beyond the few it
# always may: MLX's CPU build computes padding at full cost, through every layer.
_PADDING = 0.0
# What a one-token row costs in tokens of a longer row (`plan_passes`): its token, and a
# sub-batch slot whose past is gathered from the tree and padded to its sub-batch's longest.
_ALONE_COST = 2.0
_INSTALL_HINT = "the MLX backend needs MLX and mlx-lm: pip install 'genlm-backend[mlx]'"

Request = tuple[str | None, tuple[int, ...]]  # (adapter, token ids): also its batching key


def _runtime() -> Any:
    """The `runtime` module (importing MLX), or an `ImportError` naming the extra."""
    try:
        return importlib.import_module("genlm.backend.llm.mlx.runtime")
    except ImportError as error:
        raise ImportError(_INSTALL_HINT) from error


class AsyncMlxLM(AsyncLM):
    """An mlx-lm language model with automatic batching and prefix caching.

    Concurrent `next_token_logprobs` calls are batched (see `batch_size`,
    `timeout`); a batch runs the model over the tokens that no cached prefix
    covers, in as few forward passes as padding allows. Key/values of every
    evaluated context are kept in a radix tree bounded by `kv_cache_bytes`;
    results in an `OutputCache` bounded by `output_cache_bytes` (and
    `cache_size` rows, if given). Batches are planned as `AsyncTransformer`'s:
    a context that is a prefix of another one of its batch is read from the
    longer one's row. Attention-only models (the usual decoder families); not
    state-space or hybrid ones.

    Args:
        mlx_lm_model: A model as loaded by `mlx_lm.load`.
        tokenizer: Its tokenizer (mlx-lm's `TokenizerWrapper` or the Hugging
            Face tokenizer it wraps).
        batch_size: A batch runs as soon as this many distinct queries wait (or
            when the event loop goes quiet; see `genlm.backend.batching`).
        timeout: ... or this many seconds after the oldest waiting query arrived.
        kv_cache_bytes: Memory budget of the key/value prefix cache, in bytes.
        cache_size: Most results (log-probability rows) kept; `None`: as many
            as `output_cache_bytes` holds.
        output_cache_bytes: Memory budget of the kept results, in bytes.

    Attributes:
        model: The mlx-lm model (also `mlx_lm_model`, its name in 0.3.x).
        device: The CPU: rows come out of MLX as CPU tensors.
        vocab_size: Length of a logprobs row: the tokenizer's length (see `AsyncLM`).
        kv_cache: The `KVPrefixCache`, one tree per adapter.
        output_cache: The `OutputCache` of results, keyed by `(adapter, token_ids)`.

    Raises:
        ImportError: If MLX or mlx-lm is not installed (the message names the
            extra `genlm-backend[mlx]`).
        ValueError: If the model is not attention-only.
    """

    def __init__(
        self,
        mlx_lm_model: Any,
        tokenizer: Any,
        batch_size: int = 20,
        timeout: float = 0.02,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        cache_size: int | None = None,
        output_cache_bytes: int = DEFAULT_OUTPUT_CACHE_BYTES,
    ):
        engine = _runtime()
        engine.check_supported(mlx_lm_model)
        super().__init__(engine.hf_tokenizer(tokenizer))
        self.model = mlx_lm_model
        args = getattr(mlx_lm_model, "args", None)
        self._max_length = getattr(args, "max_position_embeddings", None)
        self.vocab_size = len(self.byte_vocab)
        # Ids a context may hold: the tokenizer's, less those past the input embeddings.
        self._id_bound = min(self.vocab_size, getattr(args, "vocab_size", None) or sys.maxsize)
        self.kv_cache = KVPrefixCache(kv_cache_bytes)
        self.output_cache = OutputCache(
            sys.maxsize if cache_size is None else cache_size, max_bytes=output_cache_bytes
        )
        self._batcher: AutoBatcher[Request, torch.Tensor] = AutoBatcher(
            self._evaluate, batch_size, timeout, key=lambda request: request
        )
        self._workspaces: dict[str | None, KVWorkspace] = {}  # the last batch, per adapter
        self._selection = engine.LoraSelection()
        # Batches of event loops in different threads, and sync calls, take turns.
        self._model_lock = threading.RLock()

    @classmethod
    def from_name(
        cls, model_name: str, mlx_lm_opts: dict[str, Any] | None = None, **kwargs: Any
    ) -> AsyncMlxLM:
        """Load a model and its tokenizer with `mlx_lm.load`.

        A configuration in the format of transformers 5 (`rope_parameters`
        instead of `rope_theta`) is translated for mlx-lm, which would
        otherwise use its default RoPE base.

        Args:
            model_name: A local folder or a hub name.
            mlx_lm_opts: Keyword arguments of `mlx_lm.load` (e.g. `model_config`).
            **kwargs: Passed to the constructor (`batch_size`, `timeout`, ...).

        Returns:
            The loaded `AsyncMlxLM`.

        Raises:
            ImportError: If MLX or mlx-lm is not installed.
        """
        _runtime()
        import mlx_lm

        opts = dict(mlx_lm_opts or {})
        opts["model_config"] = {**_rope_config(model_name), **opts.get("model_config", {})}
        model, tokenizer = mlx_lm.load(model_name, **opts)
        return cls(model, tokenizer, **kwargs)

    @property
    def mlx_lm_model(self) -> Any:
        """The mlx-lm model (`model`), by its 0.3.x name."""
        return self.model

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

    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token; concurrent calls are batched.

        Args:
            token_ids: The context, a non-empty sequence of token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Returns:
            A 1-D float32 tensor of `vocab_size` log-probabilities (see `AsyncLM`).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
        """
        request = (self.loras.select(lora_name), self._check(token_ids))
        cached = self.output_cache.get(request)
        if cached is not None:
            return cached
        return await self._batcher.submit(request)

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
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
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
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
        """
        adapter = self.loras.select(lora_name)
        if len(token_ids_list) == 0:
            return torch.empty((0, self.vocab_size))
        requests = [(adapter, self._check(ids)) for ids in token_ids_list]
        distinct = list(dict.fromkeys(requests))
        results = dict(zip(distinct, self._evaluate(distinct), strict=True))
        for result in results.values():
            if isinstance(result, Exception):
                raise result
        return torch.stack([results[request] for request in requests])

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
        import mlx.core as mx

        adapter = self.loras.select(lora_name)
        ids = self._check(token_ids)
        with self._model_lock:
            self._selection.name = adapter
            logits = self.model(mx.array([ids]))[0, -1].astype(mx.float32)
            mx.eval(logits)
        return fit_width(torch.log_softmax(_runtime().to_torch(logits), dim=-1), self.vocab_size)

    def cache_kv(self, prompt_tokens: Sequence[int], lora_name: str | None = None) -> None:
        """Compute and keep the key/values (and the result) of a prompt.

        Later queries that extend the prompt (under the same adapter) then only
        run the model on their new tokens (as long as the prompt is not evicted).

        Args:
            prompt_tokens: The prompt's token ids.
            lora_name: The adapter for this call (`None`: the active one, if any).

        Raises:
            ValueError: For bad token ids (see `check_token_ids`) or an unknown `lora_name`.
        """
        self.next_token_logprobs_sync(prompt_tokens, lora_name=lora_name)

    def reset_async_queries(self) -> None:
        """Drop the queued queries; their callers get `asyncio.CancelledError`."""
        self._batcher.reset()

    def clear_cache(self) -> None:
        """Drop every cached result and key/value, and the last batches' arrays."""
        import mlx.core as mx

        with self._model_lock:
            self.output_cache.clear()
            self.kv_cache.clear()
            self._workspaces.clear()
            mx.clear_cache()

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Load a LoRA adapter under `lora_name` (it is not activated).

        Both mlx-lm's adapters (`adapter_config.json` and `adapters.safetensors`,
        as `mlx_lm.lora` writes them) and peft's (`adapter_model.safetensors`)
        are read; the adapter's modules must be named as in the mlx-lm model.

        Args:
            lora_path: Folder of the adapter.
            lora_name: Name to select it by (`set_lora`, or `lora_name=` per
                call). Loading an adapter under a name in use replaces it and
                drops what was cached for the old one.

        Raises:
            ValueError: If the folder holds no LoRA adapter for this model.
        """
        engine = _runtime()
        weights, scale = engine.read_adapter(lora_path)
        with self._model_lock:
            if lora_name in self.loras:
                engine.detach_adapter(self.model, lora_name)
                self._forget_adapter(lora_name)
            engine.attach_adapter(self.model, self._selection, lora_name, weights, scale)
            self.loras.add(lora_name, lora_path)

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
        """Unload an adapter and drop every result and key/value cached for it.

        Args:
            lora_name: A registered adapter (if active, the base model becomes active).

        Raises:
            ValueError: If no adapter is registered under `lora_name`.
        """
        with self._model_lock:
            self.loras.remove(lora_name)
            _runtime().detach_adapter(self.model, lora_name)
            self._forget_adapter(lora_name)

    def _forget_adapter(self, adapter: str) -> None:
        self.output_cache.remove_if(lambda key: key[0] == adapter)
        self.kv_cache.drop(adapter)
        self._workspaces.pop(adapter, None)

    def _check(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        return check_token_ids(token_ids, self._id_bound, self._max_length)

    def _evaluate(self, requests: list[Request]) -> list[torch.Tensor | Exception]:
        """The batch evaluator: one result per request, in order (callers own them).

        A request whose adapter was removed while it waited gets a `ValueError`
        in place of its result; an error of a forward pass reaches the requests
        of that pass's adapter only.
        """
        with self._model_lock:
            results: list[torch.Tensor | Exception | None] = [
                self.output_cache.get(r) for r in requests
            ]
            todo: dict[str | None, list[int]] = {}
            for i, (adapter, _) in enumerate(requests):
                if results[i] is None:
                    todo.setdefault(adapter, []).append(i)
            for adapter, indices in todo.items():
                try:
                    if adapter is not None and adapter not in self.loras:
                        raise self.loras.removed_error(adapter)
                    rows_read, order = self._evaluate_adapter(
                        adapter, [requests[i][1] for i in indices]
                    )
                except Exception as error:  # delivered to this adapter's requests
                    for i in indices:
                        results[i] = error
                    continue
                keys = [requests[indices[q]] for q in order]
                self.output_cache.store_rows(keys, rows_read)
                for q, row in zip(order, rows_read.unbind(0), strict=True):
                    results[indices[q]] = row  # a view of this batch's own tensor
            return results

    def _evaluate_adapter(
        self, adapter: str | None, contexts: list[tuple[int, ...]]
    ) -> tuple[torch.Tensor, list[int]]:
        """The rows of one adapter's contexts, in the passes `plan_passes` plans, and the
        context each row answers."""
        passes = plan_passes(
            contexts, lambda ids: self.kv_cache.match(ids, adapter).length, alone_cost=_ALONE_COST
        )
        outputs, order = [], []
        for rows in passes:
            output, rows_run = self._run_pass(adapter, rows)
            outputs.append(output)
            order += [q for row in rows_run for q in row.queries]
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), order

    def _run_pass(self, adapter: str | None, rows: list[Row]) -> tuple[torch.Tensor, list[Row]]:
        """One pass of `plan_passes`, in `sub_batches` evaluated together: each row from its
        longest cached prefix, before its first read's last token (that token's logits are a
        result); the new tokens' key/values go into the cache.

        Returns:
            The rows read, row by row and read by read (this pass's own tensor), and the
            rows in that order.
        """
        import mlx.core as mx

        engine = _runtime()
        pasts = [
            self.kv_cache.match(
                row.context, adapter, (row.reads[0] if row.reads else len(row.context)) - 1
            )
            for row in rows
        ]
        for past in pasts:
            self.kv_cache.lock(past.node)
        try:
            # Fewest new tokens first: the last sub-batch, whose arrays the next pass may
            # continue in, is the one with this pass's trunks (they have the most).
            groups = sub_batches(rows, [past.length for past in pasts], padding=_PADDING)[::-1]
            batches = [
                self._start(adapter, [rows[g] for g in group], [pasts[g] for g in group])
                for group in groups
            ]
            self._selection.name = adapter
            read = engine.read_logits(self.model, [run for _, run in batches]).astype(mx.float32)
            new_kv = [
                mx.stack([mx.stack(cache.new_key_values()) for cache in caches])
                for _, (_, caches, _, _) in batches
            ]
            mx.eval(read, new_kv)
            workspace = self._workspaces[adapter]
            for group, (batch, (_, caches, _, _)), written in zip(
                groups, batches, new_kv, strict=True
            ):
                key_values = engine.to_torch(written)  # [layers, 2, rows, kv_heads, new, head_dim]
                for row, g in enumerate(group):
                    ids, length = rows[g].context, pasts[g].length
                    self.kv_cache.insert(
                        ids, length, key_values[:, :, row, :, : len(ids) - length], adapter
                    )
                if not batch.ragged:
                    workspace.remember(adapter, [rows[g].context for g in group], caches)
        finally:
            for past in pasts:
                self.kv_cache.unlock(past.node)
        # MLX's float32 `logsumexp` sums 10^4-10^5 terms less accurately than torch's
        # (~1e-4 nats on SmolLM2), so torch normalises. A trunk nobody asked for reads nothing.
        read_rows = fit_width(torch.log_softmax(engine.to_torch(read), dim=-1), self.vocab_size)
        return read_rows, [rows[g] for group in groups for g in group]

    def _start(
        self, adapter: str | None, rows: list[Row], pasts: list[PrefixMatch]
    ) -> tuple[Any, tuple[Any, list[Any], list[int], list[int]]]:
        """A sub-batch of `rows` ready to run: its geometry, and for `read_logits` its input
        ids, its layer caches holding each row's past (the last batch's arrays where the
        rows continue them), and the row and input index of each position read."""
        import mlx.core as mx

        engine = _runtime()
        contexts = [row.context for row in rows]
        past_lengths = [past.length for past in pasts]
        new_tokens = [ids[length:] for ids, length in zip(contexts, past_lengths, strict=True)]
        batch = engine.Batch(past_lengths, [len(tokens) for tokens in new_tokens])
        workspace = self._workspaces.setdefault(adapter, KVWorkspace())
        previous = workspace.recall(adapter, contexts, past_lengths)
        if previous is not None:
            caches, sources = previous
            identity = sources == list(range(caches[0].keys.shape[0]))
            source_rows = None if identity else mx.array(sources)
            for cache in caches:
                cache.start(batch, source_rows)
        else:
            segments = [past.segments for past in pasts]
            caches = engine.gather_layers(segments, batch, len(self.model.layers))
        inputs = mx.array([tokens + (0,) * (batch.n_new - len(tokens)) for tokens in new_tokens])
        read_rows = [index for index, row in enumerate(rows) for _ in row.reads]
        columns = [
            length - 1 - past_length
            for row, past_length in zip(rows, past_lengths, strict=True)
            for length in row.reads
        ]
        return batch, (inputs, caches, read_rows, columns)


def _rope_config(model_name: str) -> dict[str, Any]:
    """mlx-lm's `rope_theta`/`rope_scaling` for a transformers 5 `rope_parameters` config."""
    path = Path(model_name) / "config.json"
    if not path.is_file():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(model_name, "config.json"))
    config = json.loads(path.read_text())
    parameters = config.get("rope_parameters")
    if not isinstance(parameters, dict) or "rope_theta" in config:
        return {}
    overrides: dict[str, Any] = {"rope_theta": parameters.get("rope_theta", 10000.0)}
    if parameters.get("rope_type", "default") != "default":
        overrides["rope_scaling"] = {k: v for k, v in parameters.items() if k != "rope_theta"}
    return overrides
