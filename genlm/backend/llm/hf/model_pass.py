"""One forward pass of the transformers backend's model over a batch: `ModelPass`.

A pass runs the new tokens of its rows after their pasts (gathered into one
`batch_kv.BatchKV` buffer, or a remembered batch's), with a 2-D attention
mask and explicit position ids when the rows are padded, reads the
log-probability rows its queries ask for, and keeps the new key/values: an
unpadded batch's buffer is remembered in the `KVWorkspace`, other rows are
inserted into the `KVPrefixCache`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from genlm.backend.cache import KVPrefixCache
from genlm.backend.llm.base import LoraRegistry
from genlm.backend.llm.hf.batch_kv import BatchKV
from genlm.backend.llm.hf.memory import WorkingMemory
from genlm.backend.llm.kv_workspace import KVWorkspace
from genlm.backend.llm.rows import fit_width


class ModelPass:
    """Runs the model once over a batch's new tokens and keeps their key/values.

    Args:
        model: A `transformers` causal LM in eval mode.
        loras: The backend's registry of LoRA adapters (read, never changed).
        kv_cache: The key/value prefix tree the rows of padded batches join.
        workspace: The batch buffers; an unpadded batch's is remembered there.
        memory: The working-memory bound, told the key/value size each pass measures.
        row_width: Columns of a row: the tokenizer's length (see `fit_width`).

    Attributes:
        model: The model; the backend replaces it when it wraps it for LoRA.
        config: The model's text config.
        n_embeddings: Ids the model's input embeddings accept.
        row_width: Columns of a row: the tokenizer's length.
        max_length: Longest context the model accepts (`None`: no limit known).
        device: Where the model's input embeddings live (inputs go there).
    """

    def __init__(
        self,
        model: Any,
        loras: LoraRegistry[Any],
        kv_cache: KVPrefixCache,
        workspace: KVWorkspace,
        memory: WorkingMemory,
        row_width: int,
    ):
        self.model = model
        self._loras = loras
        self._kv_cache = kv_cache
        self._workspace = workspace
        self._memory = memory
        self.config = model.config.get_text_config(decoder=True)
        self._n_layers = self.config.num_hidden_layers
        self.max_length: int | None = getattr(self.config, "max_position_embeddings", None)
        embeddings = model.get_input_embeddings()
        self.n_embeddings: int = embeddings.num_embeddings
        self.row_width = row_width
        self.device = embeddings.weight.device
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def call_model(self, adapter: str | None, **inputs: Any) -> Any:
        """Run the model under `adapter` (`None`: the base model, adapters disabled)."""
        if adapter is not None:
            self.model.set_adapter(adapter)
            return self.model(**inputs)
        if self._loras.names:
            with self.model.disable_adapter():
                return self.model(**inputs)
        return self.model(**inputs)

    def run(
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
        logprobs = fit_width(logprobs, self.row_width)

        if batch.buffer is not None:
            storage = batch.storage
            self._memory.measure_kv(storage)
            if aligned and only_batch:
                self._workspace.remember(adapter, contexts, storage)
            else:
                for row, (ids, past) in enumerate(zip(contexts, past_list, strict=True)):
                    new_kv = batch.buffer[:, :, row, :, past_length : past_length + new_list[row]]
                    self._kv_cache.insert(ids, past, new_kv, adapter)
        return logprobs, batch.storage
