"""How `AsyncTransformer` evaluates a batch of queries: `ForwardPasses`.

A batch runs in the passes `passes.plan_passes` plans (contexts that are
prefixes of others are read from the longer rows, long shared uncached
prefixes run once first), each pass in as many sub-batches as padding and the
working-memory bound (`max_batch_bytes`) want. One sub-batch is one forward
pass:

1. Each query looks up the longest cached prefix of its context in the
   `KVPrefixCache` (a radix tree of key/value segments, one per adapter).
2. The matched segments are gathered into one buffer per batch, laid out as
   `[past (right-padded to the longest past) | new tokens]` for every row.
   A 2-D attention mask hides the padding and explicit position ids give
   every token its true position, so rows with different past lengths share
   the pass (RoPE and learned position embeddings alike).
3. The model writes the new tokens' keys/values in place into that buffer
   (`batch_kv.BatchLayer`); the logits at the positions the row's queries
   end at become their results, copied into the `OutputCache` in one operation.
4. A batch without padding keeps its buffer for the next ones (`KVWorkspace`
   in `kv_workspace` remembers the two most recent, one per storage); other
   batches insert their new key/values into the tree.

A sampler's next step extends every row of one remembered batch by the same
number of tokens: it runs in that batch's buffer (the new tokens go into spare
slots; after resampling, a row whose ancestor is another row gets one copy of
it) without touching the tree. Two such sequences of batches that alternate
(a sampler's and an LLM critic's) both continue in place.
Rows no batch continues are inserted into the tree: those a continuing batch
drops, and a remembered batch's rows before its storage is reused; a batch
that runs from the tree first inserts every remembered batch's rows (`spill`),
so the tree then holds every evaluated context.
"""

from __future__ import annotations

import bisect
import inspect
import logging
import threading
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from genlm.backend.cache import KVPrefixCache, OutputCache, PrefixMatch
from genlm.backend.llm.base import LoraRegistry
from genlm.backend.llm.hf.batch_kv import BatchKV
from genlm.backend.llm.hf.query import Query
from genlm.backend.llm.kv_workspace import KVWorkspace, RememberedBatch
from genlm.backend.llm.passes import Row, plan_passes, sub_batches

_log = logging.getLogger(__name__)

# Rows read by one forward pass and the query each answers.
Chunk = tuple[torch.Tensor, list[int]]


class ForwardPasses:
    """The batch evaluation of `AsyncTransformer`, which owns one.

    Args:
        model: A `transformers` causal LM in eval mode.
        loras: The backend's registry of LoRA adapters (read, never changed).
        kv_cache: The key/value prefix tree batches read and fill.
        output_cache: Where results are stored.
        max_batch_bytes: Bound on the working memory of batches, in bytes.
        lock: Held around every batch; whoever changes `model` holds it too.

    Attributes:
        model: The model; the backend replaces it when it wraps it for LoRA.
        vocab_size: Length of a logprobs row (the model's input embeddings).
        max_length: Longest context the model accepts (`None`: no limit known).
        device: Where the model's input embeddings live (inputs go there).

    Raises:
        ValueError: If `max_batch_bytes` cannot hold a batch of one one-token context.
        TypeError: If `max_batch_bytes` is not an int.
    """

    def __init__(
        self,
        model: Any,
        loras: LoraRegistry[Any],
        kv_cache: KVPrefixCache,
        output_cache: OutputCache,
        max_batch_bytes: int,
        lock: threading.RLock,
    ):
        self.model = model
        self._loras = loras
        self._kv_cache = kv_cache
        self._output_cache = output_cache
        self._lock = lock
        config = model.config.get_text_config(decoder=True)
        self._n_layers = config.num_hidden_layers
        self.max_length: int | None = getattr(config, "max_position_embeddings", None)
        self._aligned_pasts = has_sliding_window(config)
        embeddings = model.get_input_embeddings()
        self.vocab_size: int = embeddings.num_embeddings
        self.device = embeddings.weight.device
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._heads, self._token_kv_bytes, self._token_activation_bytes = token_sizes(
            config, self._n_layers, embeddings.weight.element_size()
        )
        self.max_batch_bytes = max_batch_bytes
        self._workspace = KVWorkspace(batches=2, spill=self._insert)
        self._warned_out_of_memory = False

    @property
    def max_batch_bytes(self) -> int:
        """The working-memory bound, in bytes.

        Raises:
            ValueError: On assignment, if it cannot hold a batch of one one-token context.
            TypeError: On assignment, if it is not an int.
        """
        return self._max_batch_bytes

    @max_batch_bytes.setter
    def max_batch_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"max_batch_bytes must be an int, got {value!r}")
        smallest = 2 * self.working_set(1, 1, 1, 1)
        if value < smallest:
            raise ValueError(
                f"max_batch_bytes={value} cannot hold a batch of one one-token "
                f"context of this model (about {smallest} bytes, two buffers)"
            )
        self._max_batch_bytes = value

    def call_model(self, adapter: str | None, **inputs: Any) -> Any:
        """Run the model under `adapter` (`None`: the base model, adapters disabled)."""
        if adapter is not None:
            self.model.set_adapter(adapter)
            return self.model(**inputs)
        if self._loras.names:
            with self.model.disable_adapter():
                return self.model(**inputs)
        return self.model(**inputs)

    def check_fits(self, token_ids: tuple[int, ...]) -> None:
        """Raise `ValueError` if the bound cannot hold even one new token of this context.

        That is the least a context needs: its key/value buffer, one new token
        and one row read.
        """
        needed = self.working_set(1, len(token_ids), 1, 1)
        if needed > self.max_batch_bytes // 2:
            raise ValueError(
                f"a context of {len(token_ids)} tokens needs about {needed / 2**20:.0f} MiB of "
                f"batch working memory (its key/values and one new token), more than the "
                f"{self.max_batch_bytes // 2**21} MiB a batch may use (half of max_batch_bytes="
                f"{self.max_batch_bytes}): raise max_batch_bytes"
            )

    def forget_batches(self) -> None:
        """Forget the remembered batches (their rows are recomputed or found in the tree)."""
        self._workspace.forget()

    def release(self) -> None:
        """Free the batch buffers."""
        self._workspace.release()

    def evaluate(self, queries: list[Query]) -> list[torch.Tensor | Exception]:
        """The batch evaluator: one result per query, in order (callers own them).

        A query that cannot be answered gets an exception in place of its result
        (the auto-batcher raises it to that query's callers only).
        """
        with self._lock:
            return self._evaluate_locked(queries)

    def _evaluate_locked(self, queries: list[Query]) -> list[torch.Tensor | Exception]:
        results: list[torch.Tensor | Exception | None] = [None] * len(queries)
        todo: dict[str | None, list[int]] = {}
        for i, query in enumerate(queries):
            results[i] = self._output_cache.get(query.key)
            if results[i] is None:
                todo.setdefault(query.adapter, []).append(i)
        with torch.no_grad():
            for adapter, indices in todo.items():
                answers = self._evaluate_adapter(adapter, [queries[i] for i in indices])
                for i, answer in zip(indices, answers, strict=True):
                    results[i] = answer
        return results

    def _evaluate_adapter(
        self, adapter: str | None, queries: list[Query]
    ) -> list[torch.Tensor | Exception]:
        """The queries of one adapter: a result or an exception for each.

        An error that is not one query's own (a failing model call) reaches
        every query of this adapter, and no other adapter's.
        """
        if adapter is not None and adapter not in self._loras:
            return [self._loras.removed_error(adapter)] * len(queries)
        answers: list[torch.Tensor | Exception | None] = [None] * len(queries)
        try:
            chunks = self._continue_remembered(adapter, queries)
            if chunks is None:
                self.spill()
                chunks = self._evaluate_from_tree(adapter, queries, answers)
        except Exception as error:  # delivered to this adapter's queries
            return [error] * len(queries)
        for rows, order in chunks:  # rows[k] answers queries[order[k]]
            self._output_cache.store_rows([queries[k].key for k in order], rows)
            for k, row in zip(order, rows.unbind(0), strict=True):
                answers[k] = row  # a view of this pass's own tensor
        return answers

    def _continue_remembered(self, adapter: str | None, queries: list[Query]) -> list[Chunk] | None:
        """Run `queries` in a remembered batch's buffer if each extends one of its rows equally.

        This is a sampler's step: no tree lookup, and the buffer's rows join the
        tree only when no batch continues them. Returns the results and the
        query of each row, or `None` when the queries do not fit (or ran out of
        memory: the remembered rows then join the tree, and the step runs from
        there, in halves if it runs out of memory again).
        """
        contexts = [query.token_ids for query in queries]
        found = self._workspace.extension(adapter, contexts)
        if found is None:
            return None
        batch, sources = found
        length = batch.length
        n_new = len(contexts[0]) - length
        if any(len(context) - length != n_new for context in contexts):
            return None
        needed = self.working_set(len(contexts), length + n_new, n_new, len(contexts))
        if needed > self.batch_limit():
            return None  # too big for one batch: sub-batches from the tree instead
        self._insert(batch, keep=set(sources))  # the rows no query continues
        order = sorted(range(len(queries)), key=sources.__getitem__)
        try:
            rows, _ = self._run(
                adapter,
                [contexts[i] for i in order],
                [length] * len(queries),
                None,
                (batch.storage, [sources[i] for i in order]),
            )
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            self._warn_out_of_memory(error, needed)
            # Each row's past is intact in its slots, unless rows were moved (the
            # workspace then forgot them, and they are recomputed from the tree).
            self.spill()
            return None
        self._workspace.forget(batch.storage)  # continued (in its memory: forgotten already)
        return [(rows, order)]

    def _evaluate_from_tree(
        self,
        adapter: str | None,
        queries: list[Query],
        answers: list[torch.Tensor | Exception | None],
    ) -> list[Chunk]:
        """Run `queries` on the longest cached prefixes of their contexts in the tree.

        The batch runs as `plan_passes` plans it: a context that is a prefix of
        another is read from the longer one's row, and a long uncached prefix
        that several rows share runs once, in a pass before theirs.

        Args:
            adapter: The adapter of every query.
            queries: The queries.
            answers: Receives an exception for each query that cannot run.

        Returns:
            The rows read, pass by pass, and the query each answers.
        """
        passes = plan_passes(
            [query.token_ids for query in queries],
            lambda ids: self._kv_cache.match(ids, adapter).length,
        )
        chunks: list[Chunk] = []
        for rows in passes:
            for query, error in self._run_pass(
                adapter, rows, queries, len(passes) == 1, chunks
            ).items():
                answers[query] = error
        return chunks

    def _run_pass(
        self,
        adapter: str | None,
        rows: list[Row],
        queries: list[Query],
        only_pass: bool,
        chunks: list[Chunk],
    ) -> dict[int, Exception]:
        """One pass of `plan_passes`, in as many sub-batches as padding and memory want.

        A row too big for the working-memory bound runs alone, in segments
        (`_run_in_segments`); a sub-batch that runs out of memory is retried in
        halves (`_run_group`).

        Args:
            adapter: The adapter of every row.
            rows: The pass's rows.
            queries: The queries the rows' reads answer (by index).
            only_pass: No other pass of this batch runs after it.
            chunks: Receives the rows read and the query each answers.

        Returns:
            The exception of each query that could not run.
        """
        failures: dict[int, Exception] = {}
        pasts = [self._row_past(adapter, row, queries) for row in rows]
        for past in pasts:
            self._kv_cache.lock(past.node)
        try:
            limit = self.batch_limit()
            alone, batched = [], []  # rows too big for the bound alone, and the others
            for g, (row, past) in enumerate(zip(rows, pasts, strict=True)):
                end = self._longest_fitting(row.reads, past.length, len(row.context), limit)
                (batched if end == len(row.context) else alone).append(g)
            groups = [
                [batched[g] for g in group]
                for group in self._plan([pasts[g] for g in batched], [rows[g] for g in batched])
            ]
            only_batch = only_pass and not alone and len(groups) == 1
            for group in groups:
                self._run_group(adapter, rows, pasts, group, only_batch, chunks, failures)
            for g in alone:
                self._run_in_segments(adapter, rows[g], pasts[g], chunks, failures)
        finally:
            for past in pasts:
                self._kv_cache.unlock(past.node)
        return failures

    def _run_group(
        self,
        adapter: str | None,
        rows: list[Row],
        pasts: list[PrefixMatch],
        group: list[int],
        only_batch: bool,
        chunks: list[Chunk],
        failures: dict[int, Exception],
    ) -> None:
        """One sub-batch of a pass; out of memory, it is retried in halves down to one row."""
        try:
            logprobs, _ = self._run(
                adapter,
                [rows[g].context for g in group],
                [pasts[g].length for g in group],
                [pasts[g].segments for g in group],
                None,
                reads=[rows[g].reads for g in group],
                only_batch=only_batch,
            )
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            needed = self.working_set(
                len(group),
                max(len(rows[g].context) for g in group),
                max(len(rows[g].context) - pasts[g].length for g in group),
                sum(len(rows[g].reads) for g in group),
            )
            self._warn_out_of_memory(error, needed)
            if len(group) == 1:
                row, past = rows[group[0]], pasts[group[0]]
                n_new = len(row.context) - past.length
                if n_new == 1:
                    for query in row.queries:
                        failures[query] = error
                else:
                    self._run_in_segments(adapter, row, past, chunks, failures, n_new // 2)
                return
            middle = len(group) // 2
            for part in (group[:middle], group[middle:]):
                self._run_group(adapter, rows, pasts, part, False, chunks, failures)
            return
        chunks.append((logprobs, [q for g in group for q in rows[g].queries]))

    def _run_in_segments(
        self,
        adapter: str | None,
        row: Row,
        past: PrefixMatch,
        chunks: list[Chunk],
        failures: dict[int, Exception],
        max_new: int | None = None,
    ) -> None:
        """Run one row alone as consecutive segments of its context.

        Each segment is the longest that fits the working-memory bound (and has
        at most `max_new` new tokens) and continues from the key/values of the
        one before, held in the batch buffer; its reads are read from it. A
        segment that runs out of memory is retried with half its tokens. A row
        whose next token cannot run at all fails its remaining reads' queries.
        """
        context, reads, readers = row.context, row.reads, row.queries
        start, segments = past.length, past.segments
        previous: tuple[torch.Tensor, list[int]] | None = None
        max_new = max_new or len(context)
        while start < len(context):
            limit = self.batch_limit()
            end = self._longest_fitting(reads, start, min(len(context), start + max_new), limit)
            if end == start:
                needed = self.working_set(1, start + 1, 1, 1)
                for read, query in zip(reads, readers, strict=True):
                    failures[query] = ValueError(
                        f"a context of {read} tokens cannot run: one token after its "
                        f"{start} computed ones needs about {needed / 2**20:.0f} MiB of batch "
                        f"working memory, more than the {limit / 2**20:.0f} MiB a batch may use "
                        f"now (half of max_batch_bytes={self.max_batch_bytes}, and on an "
                        "accelerator at most its free memory): raise max_batch_bytes"
                    )
                return
            n_reads = bisect.bisect_right(reads, end)
            try:
                logprobs, storage = self._run(
                    adapter,
                    [context[:end]],
                    [start],
                    None if previous is not None else [segments],
                    previous,
                    reads=[reads[:n_reads]],
                    only_batch=False,
                )
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                self._warn_out_of_memory(error, self.working_set(1, end, end - start, n_reads))
                if end - start == 1:
                    for query in readers:
                        failures[query] = error
                    return
                max_new = (end - start) // 2
                continue
            chunks.append((logprobs, readers[:n_reads]))
            reads, readers = reads[n_reads:], readers[n_reads:]
            start, previous = end, (storage, [0])

    def _longest_fitting(self, reads: list[int], start: int, stop: int, limit: int) -> int:
        """The longest prefix of a row (at most `stop` tokens, with `start` computed) whose
        new tokens and reads fit the working-memory bound; `start` if not even one does."""

        def fits(end: int) -> bool:
            n_reads = bisect.bisect_right(reads, end)
            return self.working_set(1, end, end - start, n_reads) <= limit

        if fits(stop):
            return stop
        low, high = start, stop  # fits(low) or low == start; not fits(high)
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

    def _warn_out_of_memory(self, error: BaseException, needed: int) -> None:
        """Log, once per backend, that a pass ran out of memory and what bound avoids it."""
        if self._warned_out_of_memory:
            return
        self._warned_out_of_memory = True
        _log.warning(
            "a forward pass ran out of memory (%s); it is retried in halves. Its working "
            "memory was estimated at %.0f MiB: max_batch_bytes=%d (passes of at most half "
            "of it) or less would have avoided it.",
            str(error).splitlines()[0] if str(error) else type(error).__name__,
            needed / 2**20,
            needed,
        )

    def spill(self) -> None:
        """Insert every remembered batch's rows into the tree.

        The batches stay remembered: the next batch may still continue one in place.
        """
        for batch in self._workspace.remembered:
            self._insert(batch)

    def _insert(self, batch: RememberedBatch, keep: AbstractSet[int] = frozenset()) -> None:
        """Insert a remembered batch's rows (but those in `keep`) into the tree."""
        if batch.in_tree:
            return
        for context, row in batch.rows.items():
            if row not in keep:
                key_values = batch.storage[:, :, row, :, : batch.length]
                self._kv_cache.insert(context, 0, key_values, batch.adapter)
        batch.in_tree = not keep

    def _row_past(self, adapter: str | None, row: Row, queries: list[Query]) -> PrefixMatch:
        """The longest cached prefix a row may start from: it runs its first read's last token."""
        first_read = row.reads[0] if row.reads else len(row.context)
        found = self._kv_cache.match(row.context, adapter, first_read - 1)
        given = queries[row.queries[0]].past if row.reads == [len(row.context)] else None
        if given is not None and found.length < given.length < len(row.context):
            return PrefixMatch(found.node, given.length, given.node_tokens, given.segments)
        return found

    def _plan(self, pasts: list[PrefixMatch], rows: list[Row]) -> list[list[int]]:
        """Split a pass into `sub_batches` whose working memory fits the batch budget
        (each row fits it alone)."""
        limit = self.batch_limit()
        groups = sub_batches(
            rows,
            [past.length for past in pasts],
            self._aligned_pasts,
            lambda n_rows, max_new, max_past, n_reads: (
                self.working_set(n_rows, max_new + max_past, max_new, n_reads) <= limit
            ),
        )
        for group in groups:  # rows with common prefixes side by side (see `BatchKV`)
            group.sort(key=lambda g: rows[g].context)
        return groups

    def working_set(self, n_rows: int, slots: int, n_new: int, n_reads: int) -> int:
        """Bytes a batch of `n_rows` rows of `slots` tokens, `n_new` of them new, may use:
        its key/value buffer (with spare slots), activations and logits (an estimate)."""
        buffer_slots = KVWorkspace.storage_slots(slots)
        per_row = buffer_slots * self._token_kv_bytes + n_new * (
            self._token_activation_bytes + 4 * self._heads * slots
        )
        return n_rows * per_row + n_reads * self.vocab_size * 8  # logits, and float32 rows

    def batch_limit(self) -> int:
        """Working memory one sub-batch may use: half the budget (two buffers are kept),
        and on an accelerator at most what is free there now."""
        limit = self.max_batch_bytes // 2
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # Memory torch's allocator holds but does not use is free for the batch too.
            idle = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
                self.device
            )
            limit = min(limit, free + idle)
        return limit

    def _run(
        self,
        adapter: str | None,
        contexts: list[tuple[int, ...]],
        past_list: list[int],
        segments: list[tuple[torch.Tensor, ...]] | None,
        previous: tuple[torch.Tensor, list[int]] | None,
        reads: list[list[int]] | None = None,
        only_batch: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward pass over the tokens of `contexts` after their pasts; keeps the key/values.

        Args:
            adapter: The adapter of every row.
            contexts: The rows' token ids.
            past_list: Tokens of each row whose key/values are at hand.
            segments: Those key/values, as tree segments (`None` with `previous`).
            previous: The storage the rows' pasts are in (a remembered batch's, or the
                segment's before) and each row's source row in it.
            reads: For each row, the lengths of its prefixes whose next-token rows
                are read (each past the row's past); `None`: each row's whole context.
            only_batch: No other pass runs before the next batch: an unpadded
                batch's buffer is remembered for it, its rows join the tree later.

        Returns:
            The rows read, row by row and read by read (this batch's own tensor),
            and the storage of the batch's key/value buffer (`None` if the model
            wrote no key/value), from which a following pass may continue.
        """
        new_tokens = [ids[past:] for ids, past in zip(contexts, past_list, strict=True)]
        new_list = [len(tokens) for tokens in new_tokens]
        past_length, n_new = max(past_list), max(new_list)
        same_new = min(new_list) == n_new
        aligned = same_new and min(past_list) == past_length  # no padding slot anywhere
        if reads is None:
            reads = [[len(ids)] for ids in contexts]
        # Every row reads only its last token, in the last column.
        last_only = same_new and all(
            len(lengths) == 1 and lengths[0] == len(ids)
            for lengths, ids in zip(reads, contexts, strict=True)
        )

        inputs: dict[str, Any] = {}
        if aligned:  # without a mask the model attends to every slot, causally
            input_ids = torch.tensor(new_tokens)
            positions = torch.arange(past_length, past_length + n_new, device=self.device)
            position_ids = positions.expand(len(contexts), n_new)  # made there: no copy to it
        else:
            input_ids = torch.tensor(
                [tokens + (0,) * (n_new - len(tokens)) for tokens in new_tokens]
            )
            past_lengths = torch.tensor(past_list)
            position_ids = past_lengths[:, None] + torch.arange(n_new)
            if self.max_length is not None:
                position_ids.clamp_(max=self.max_length - 1)  # only padding slots get clamped
            new_lengths = torch.tensor(new_list)
            slots = torch.arange(past_length + n_new)
            attention_mask = (slots < past_lengths[:, None]) | (
                (slots >= past_length) & (slots < past_length + new_lengths[:, None])
            )
            inputs["attention_mask"] = attention_mask.long().to(self.device)
        read_rows = [row for row, lengths in enumerate(reads) for _ in lengths]
        columns = torch.tensor(
            [
                length - 1 - past
                for lengths, past in zip(reads, past_list, strict=True)
                for length in lengths
            ],
            dtype=torch.long,
        )
        if self._keeps_logits:
            if last_only or not read_rows:
                inputs["logits_to_keep"] = 1
            else:
                kept, columns = torch.unique(columns, return_inverse=True)
                inputs["logits_to_keep"] = kept.to(self.device)

        batch = BatchKV(segments, past_length, n_new, self._n_layers, self._workspace, previous)
        output = self.call_model(
            adapter,
            input_ids=input_ids.to(self.device),
            position_ids=position_ids.to(self.device),
            past_key_values=batch.as_cache(),
            use_cache=True,
            **inputs,
        )
        if last_only:
            logits = output.logits[:, -1]
        else:
            device = output.logits.device
            rows = torch.tensor(read_rows, dtype=torch.long, device=device)
            logits = output.logits[rows, columns.to(device)]
        logits = logits.float()
        # In place on the CPU (exact there; the CPU kernel reads a row before writing it):
        # a second fresh tensor per step would cost as much in page faults as the work.
        logprobs = torch.log_softmax(logits, dim=-1, out=logits if logits.is_cpu else None)

        if batch.buffer is not None:
            storage = batch.storage
            self._token_kv_bytes = (
                storage[:, :, 0, :, 0].numel() * storage.element_size()
            )  # measured: the model's own key/value shape and dtype
            if aligned and only_batch:
                self._workspace.remember(adapter, contexts, storage)
            else:
                for row, (ids, past) in enumerate(zip(contexts, past_list, strict=True)):
                    new_kv = batch.buffer[:, :, row, :, past_length : past_length + new_list[row]]
                    self._kv_cache.insert(ids, past, new_kv, adapter)
        return logprobs, batch.storage


def token_sizes(config: Any, n_layers: int, element_size: int) -> tuple[int, int, int]:
    """Attention heads, and bytes per token of a model's key/values and of its activations.

    Estimates from the config (the key/value size is measured at the first
    batch): grouped-query heads and `head_dim` where the config has them.
    """
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    kv_bytes = 2 * n_layers * kv_heads * head_dim * element_size
    # The residual stream, attention projections and the MLP's inputs and outputs of one
    # layer alive at once (no gradients are kept).
    activation_bytes = (8 * hidden + 3 * intermediate) * element_size
    return heads, kv_bytes, activation_bytes


def has_sliding_window(config: Any) -> bool:
    """Whether some attention layer of the model only sees a window of past tokens."""
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return True
    return bool(getattr(config, "sliding_window", None)) and getattr(
        config, "use_sliding_window", True
    )


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation failure: torch's out-of-memory error (CUDA),
    Python's `MemoryError`, or the CPU allocator's `RuntimeError`."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
