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

Where each part lives: this module plans a batch's passes and sub-batches,
looks up their pasts (step 1), retries passes that run out of memory and
delivers the results; one forward pass (steps 2 to 4) is `ModelPass` in
`model_pass`, whose buffer is `batch_kv.BatchKV`; the working-memory bound
and its estimates are `WorkingMemory` in `memory`.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from genlm.backend.cache import KVPrefixCache, OutputCache, PrefixMatch
from genlm.backend.llm.base import LoraRegistry
from genlm.backend.llm.hf.memory import WorkingMemory, is_out_of_memory
from genlm.backend.llm.hf.model_pass import ModelPass
from genlm.backend.llm.hf.query import Query
from genlm.backend.llm.kv_workspace import KVWorkspace, RememberedBatch
from genlm.backend.llm.passes import Row, plan_passes, sub_batches

# Rows read by one forward pass and the query each answers.
Chunk = tuple[torch.Tensor, list[int]]


class ForwardPasses:
    """The batch evaluation of `AsyncTransformer`, which owns one: plans and runs a batch's passes.

    Args:
        model: A `transformers` causal LM in eval mode.
        loras: The backend's registry of LoRA adapters (read, never changed).
        kv_cache: The key/value prefix tree batches read and fill.
        output_cache: Where results are stored.
        max_batch_bytes: Bound on the working memory of batches, in bytes.
        lock: Held around every batch; whoever changes the model holds it too.

    Attributes:
        memory: The working-memory bound (`max_batch_bytes`) and its estimates.
        model_pass: Runs one forward pass; holds the model, which the backend
            replaces when it wraps it for LoRA.

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
        row_width: int,
    ):
        self._loras = loras
        self._kv_cache = kv_cache
        self._output_cache = output_cache
        self._lock = lock
        self.memory = WorkingMemory(model, max_batch_bytes)
        self._workspace = KVWorkspace(batches=2, spill=self._insert)
        self.model_pass = ModelPass(model, loras, kv_cache, self._workspace, self.memory, row_width)
        self._aligned_pasts = has_sliding_window(self.model_pass.config)

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
        needed = self.memory.working_set(len(contexts), length + n_new, n_new, len(contexts))
        if needed > self.memory.batch_limit():
            return None  # too big for one batch: sub-batches from the tree instead
        self._insert(batch, keep=set(sources))  # the rows no query continues
        order = sorted(range(len(queries)), key=sources.__getitem__)
        try:
            rows, _ = self.model_pass.run(
                adapter,
                [contexts[i] for i in order],
                [length] * len(queries),
                None,
                (batch.storage, [sources[i] for i in order]),
            )
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            self.memory.warn_out_of_memory(error, needed)
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
            limit = self.memory.batch_limit()
            alone, batched = [], []  # rows too big for the bound alone, and the others
            for g, (row, past) in enumerate(zip(rows, pasts, strict=True)):
                end = self.memory.longest_fitting(row.reads, past.length, len(row.context), limit)
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
            logprobs, _ = self.model_pass.run(
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
            needed = self.memory.working_set(
                len(group),
                max(len(rows[g].context) for g in group),
                max(len(rows[g].context) - pasts[g].length for g in group),
                sum(len(rows[g].reads) for g in group),
            )
            self.memory.warn_out_of_memory(error, needed)
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
            limit = self.memory.batch_limit()
            end = self.memory.longest_fitting(
                reads, start, min(len(context), start + max_new), limit
            )
            if end == start:
                needed = self.memory.working_set(1, start + 1, 1, 1)
                for read, query in zip(reads, readers, strict=True):
                    failures[query] = ValueError(
                        f"a context of {read} tokens cannot run: one token after its "
                        f"{start} computed ones needs about {needed / 2**20:.0f} MiB of batch "
                        f"working memory, more than the {limit / 2**20:.0f} MiB a batch may use "
                        f"now (half of max_batch_bytes={self.memory.max_batch_bytes}, and on an "
                        "accelerator at most its free memory): raise max_batch_bytes"
                    )
                return
            n_reads = bisect.bisect_right(reads, end)
            try:
                logprobs, storage = self.model_pass.run(
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
                self.memory.warn_out_of_memory(
                    error, self.memory.working_set(1, end, end - start, n_reads)
                )
                if end - start == 1:
                    for query in readers:
                        failures[query] = error
                    return
                max_new = (end - start) // 2
                continue
            chunks.append((logprobs, readers[:n_reads]))
            reads, readers = reads[n_reads:], readers[n_reads:]
            start, previous = end, (storage, [0])

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
        limit = self.memory.batch_limit()
        groups = sub_batches(
            rows,
            [past.length for past in pasts],
            self._aligned_pasts,
            lambda n_rows, max_new, max_past, n_reads: (
                self.memory.working_set(n_rows, max_new + max_past, max_new, n_reads) <= limit
            ),
        )
        for group in groups:  # rows with common prefixes side by side (see `BatchKV`)
            group.sort(key=lambda g: rows[g].context)
        return groups


def has_sliding_window(config: Any) -> bool:
    """Whether some attention layer of the model only sees a window of past tokens."""
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return True
    return bool(getattr(config, "sliding_window", None)) and getattr(
        config, "use_sliding_window", True
    )
