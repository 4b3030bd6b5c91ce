"""What of the MLX backend (`AsyncMlxLM`) needs MLX: the batch cache and LoRA adapters.

A batch's cached prefixes are laid out per layer in one key and one value array
`[rows, kv_heads, slots, head_dim]`, right-padded to the longest prefix and
followed by slots for the new tokens, as in the transformers backend
(`hf.batch_kv`). `BatchLayerCache` stands in for an mlx-lm cache layer: the model
writes the new tokens' key/values into the spare slots, and the batch's mask
and per-row positions make rows with different prefix lengths share one pass.
The layer caches outlive their batch, so a batch whose rows extend the last
one's continues in the same arrays.

`read_logits` runs batches through the model and returns the logits at the
positions read only: for the usual architectures it applies the output
projection once for all of them, at those positions alone, not at every
(padded) position.

`LoraSwitch` wraps a linear layer of the model with any number of LoRA
adapters (mlx-lm's or peft's format) and applies the one that `LoraSelection`
names when the forward pass is built.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

_SPARE_SLOTS = 32  # token slots a batch keeps free, so following steps append in place

# mlx-lm architectures whose `Model.__call__` is the body (`model.model`), then the output
# projection: `lm_head` where the model has one, else the tied input embeddings. (Others
# do more there, e.g. gemma2's soft-capping, cohere's and granite's scaling.)
_PLAIN_HEADS = frozenset(
    f"mlx_lm.models.{name}"
    for name in (
        "gemma",
        "gemma3_text",
        "internlm3",
        "llama",  # mistral too: mlx-lm loads it as llama
        "ministral3",
        "mixtral",
        "olmo2",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "smollm3",
        "starcoder2",
    )
)


def to_torch(array: mx.array) -> torch.Tensor:
    """A CPU tensor holding `array`'s values (bfloat16 travels as 16-bit integers)."""
    if array.dtype == mx.bfloat16:
        return torch.from_numpy(np.asarray(array.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.asarray(array))


def to_mlx(tensor: torch.Tensor) -> mx.array:
    """An MLX array holding a CPU tensor's values (a copy)."""
    if tensor.dtype == torch.bfloat16:
        return mx.array(tensor.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(tensor.numpy())


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's `TokenizerWrapper` (others as they are)."""
    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def check_supported(model: Any) -> None:
    """Raise `ValueError` unless every layer of `model` caches plain attention key/values."""
    kinds = {type(layer) for layer in make_prompt_cache(model)}
    if not kinds <= {KVCache, RotatingKVCache}:
        names = ", ".join(sorted(kind.__name__ for kind in kinds))
        raise ValueError(
            f"AsyncMlxLM serves attention-only models; this one's layers cache {names}"
        )


def read_logits(
    model: Any, batches: Sequence[tuple[mx.array, list[Any], list[int], list[int]]]
) -> mx.array:
    """The logits of forward passes at the positions read, `[reads, vocab]`.

    For the architectures of `_PLAIN_HEADS` the output projection runs once,
    at the positions read of every pass alone; any other model runs whole and
    the positions are gathered from its logits.

    Args:
        model: An mlx-lm model.
        batches: Per forward pass, its token ids (`[rows, tokens]`), one cache
            per layer, and the row of each position read with its index among
            the row's input tokens.

    Returns:
        The logits at the positions read, pass by pass, in the model's dtype.
    """
    plain = type(model).__module__ in _PLAIN_HEADS
    run = model.model if plain else model
    read = [
        run(inputs, cache=caches)[mx.array(rows, dtype=mx.int32), mx.array(columns, dtype=mx.int32)]
        for inputs, caches, rows, columns in batches
    ]
    read = read[0] if len(read) == 1 else mx.concatenate(read)
    if not plain:
        return read
    if "lm_head" in model:
        return model.lm_head(read)
    return model.model.embed_tokens.as_linear(read)


class Batch:
    """The geometry of one batch: per-row prefix and new-token lengths, mask, positions.

    Args:
        past_lengths: Tokens of each row's cached prefix.
        new_lengths: New tokens of each row.
    """

    def __init__(self, past_lengths: Sequence[int], new_lengths: Sequence[int]):
        self.past_length = max(past_lengths)
        self.n_new = max(new_lengths)
        self.rows = len(past_lengths)
        self.ragged = min(past_lengths) != self.past_length or min(new_lengths) != self.n_new
        self._past = mx.array(past_lengths)
        self._new = mx.array(new_lengths)
        # RoPE takes one offset for the batch, or one per row.
        self.offset: int | mx.array = self._past if self.ragged else self.past_length
        self._masks: dict[int | None, Any] = {}

    def mask(self, window: int | None, as_array: bool = False) -> Any:
        """The attention mask: `None`, `"causal"`, or `[rows, 1, n_new, slots]` booleans.

        Args:
            window: The layer's sliding window, if it has one.
            as_array: Always return booleans.
        """
        if window is not None and window >= self.past_length + self.n_new:
            window = None
        if not (as_array or self.ragged or window is not None):
            return None if self.n_new == 1 else "causal"
        if window not in self._masks:
            self._masks[window] = self._build_mask(window)
        return self._masks[window]

    def _build_mask(self, window: int | None) -> mx.array:
        past, new = self._past[:, None, None], self._new[:, None, None]
        query = mx.arange(self.n_new)[None, :, None]
        slot = mx.arange(self.past_length + self.n_new)[None, None, :]
        fresh = slot - self.past_length  # index among the new tokens
        allowed = (slot < past) | ((fresh >= 0) & (fresh <= query) & (fresh < new))
        if window is not None:
            key_position = mx.where(slot < self.past_length, slot, past + fresh)
            allowed = allowed & (past + query - key_position < window)
        return allowed[:, None]


class BatchLayerCache:
    """One layer's key/values for the rows of a batch, in the shape of an mlx-lm cache layer.

    Slots `[0, batch.past_length)` hold each row's prefix (right-padded),
    the model writes the new tokens to `[batch.past_length, + batch.n_new)`.
    Spare slots after them take the next steps' tokens.

    Args:
        batch: The batch served first.
        keys: `[rows, kv_heads, capacity, head_dim]`, or `None` when no row
            has a cached prefix (allocated at the first update).
        values: Same layout (`None` with `keys`).
    """

    def __init__(self, batch: Batch, keys: mx.array | None = None, values: mx.array | None = None):
        self.batch = batch
        self.keys = keys
        self.values = values

    @property
    def offset(self) -> int | mx.array:
        return self.batch.offset

    def start(self, batch: Batch, rows: mx.array | None) -> None:
        """Serve `batch`: keep only `rows` (in that order; `None`: all), make room for it."""
        self.batch = batch
        if rows is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]
        needed = batch.past_length + batch.n_new
        if needed > self.keys.shape[2]:
            spare = needed // 4 + _SPARE_SLOTS
            self.keys = _resize(self.keys, batch.past_length, needed + spare)
            self.values = _resize(self.values, batch.past_length, needed + spare)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start, end = self.batch.past_length, self.batch.past_length + keys.shape[2]
        if self.keys is None:
            slots = end + _SPARE_SLOTS
            self.keys = mx.zeros((*keys.shape[:2], slots, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((*values.shape[:2], slots, values.shape[3]), values.dtype)
        # The arrays are referenced only here, so MLX writes in place.
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return self.batch.mask(window_size, return_array)

    def new_key_values(self) -> tuple[mx.array, mx.array]:
        """The key/values the batch wrote, `[rows, kv_heads, n_new, head_dim]` each."""
        start, end = self.batch.past_length, self.batch.past_length + self.batch.n_new
        return self.keys[:, :, start:end], self.values[:, :, start:end]


def _resize(array: mx.array, keep: int, slots: int) -> mx.array:
    """`array` with its first `keep` slots and zeros up to `slots` slots."""
    rows, heads, _, dim = array.shape
    spare = mx.zeros((rows, heads, slots - keep, dim), array.dtype)
    return mx.concatenate([array[:, :, :keep], spare], axis=2)


def gather_layers(
    segments: list[tuple[torch.Tensor, ...]], batch: Batch, n_layers: int
) -> list[BatchLayerCache]:
    """Fresh layer caches holding each row's cached prefix.

    Args:
        segments: Per row, its prefix's key/values as `[layers, 2, kv_heads,
            tokens, head_dim]` pieces in order (`PrefixMatch.segments`).
        batch: The batch they serve.
        n_layers: Layers of the model.

    Returns:
        One cache per layer, with room for the batch and spare slots.
    """
    like = next((piece for pieces in segments for piece in pieces), None)
    if like is None:
        return [BatchLayerCache(batch) for _ in range(n_layers)]
    _, _, heads, _, dim = like.shape
    slots = batch.past_length + batch.n_new + _SPARE_SLOTS
    buffer = like.new_zeros((n_layers, 2, batch.rows, heads, slots, dim))
    for row, pieces in enumerate(segments):
        offset = 0
        for piece in pieces:
            buffer[:, :, row, :, offset : offset + piece.shape[-2]].copy_(piece)
            offset += piece.shape[-2]
    return [
        BatchLayerCache(batch, to_mlx(buffer[layer, 0]), to_mlx(buffer[layer, 1]))
        for layer in range(n_layers)
    ]


class LoraSelection:
    """The adapter the LoRA layers apply in the forward pass being built (`None`: none)."""

    def __init__(self) -> None:
        self.name: str | None = None


class LoraSwitch(nn.Module):
    """A linear layer plus LoRA adapters, of which the selected one (if any) is added.

    `y = base(x) + scale * (x @ a) @ b` with `a: [in, rank]`, `b: [rank, out]`;
    without a selected adapter of its own the layer is `base` unchanged.

    Args:
        base: The model's linear layer (plain or quantised).
        selection: Shared by every `LoraSwitch` of the model.
    """

    def __init__(self, base: nn.Module, selection: LoraSelection):
        super().__init__()
        self.base = base
        self._selection = selection
        self._adapters: dict[str, tuple[mx.array, mx.array, float]] = {}

    def add(self, name: str, a: mx.array, b: mx.array, scale: float) -> None:
        self._adapters[name] = (a, b, scale)

    def remove(self, name: str) -> None:
        self._adapters.pop(name, None)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        adapter = self._adapters.get(self._selection.name)
        if adapter is None:
            return y
        a, b, scale = adapter
        return y + (scale * ((x @ a.astype(x.dtype)) @ b.astype(x.dtype))).astype(y.dtype)


def read_adapter(path: str | Path) -> tuple[dict[str, tuple[mx.array, mx.array]], float]:
    """Read a LoRA adapter folder written by mlx-lm (`mlx_lm.lora`) or by peft.

    Args:
        path: The folder: `adapter_config.json` with `adapters.safetensors`
            (mlx-lm) or `adapter_model.safetensors` (peft).

    Returns:
        `({module path: (a, b)}, scale)` with `a: [in, rank]`, `b: [rank, out]`,
        module paths as in the mlx-lm model (e.g. `model.layers.0.self_attn.q_proj`).

    Raises:
        ValueError: For an adapter that is not a LoRA (DoRA, full fine-tuning, ...).
        FileNotFoundError: If the folder lacks the files above.
    """
    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    if "peft_type" in config:
        if config["peft_type"] != "LORA" or config.get("use_dora"):
            raise ValueError(f"{path} is a peft {config['peft_type']} adapter, not a LoRA")
        rank = config["r"]
        alpha = config.get("lora_alpha", rank)
        scale = alpha / (rank**0.5 if config.get("use_rslora") else rank)
        weights = mx.load(str(path / "adapter_model.safetensors"))
        pairs: dict[str, dict[str, mx.array]] = {}
        for key, value in weights.items():
            module, _, leaf = key.removeprefix("base_model.model.").rpartition(".lora_")
            pairs.setdefault(module, {})[leaf.split(".")[0]] = value.T
        return {module: (pair["A"], pair["B"]) for module, pair in pairs.items()}, scale
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValueError(f"{path} is an mlx-lm {kind!r} adapter, not a LoRA")
    scale = config["lora_parameters"]["scale"]
    weights = mx.load(str(path / "adapters.safetensors"))
    pairs = {}
    for key, value in weights.items():
        module, _, leaf = key.rpartition(".")
        pairs.setdefault(module, {})[leaf] = value
    return {module: (pair["lora_a"], pair["lora_b"]) for module, pair in pairs.items()}, scale


def attach_adapter(
    model: nn.Module,
    selection: LoraSelection,
    name: str,
    weights: dict[str, tuple[mx.array, mx.array]],
    scale: float,
) -> None:
    """Add adapter `name` to the linear layers it targets (wrapping them in `LoraSwitch`).

    Raises:
        ValueError: If the adapter targets a module the model does not have.
    """
    modules = dict(model.named_modules())
    missing = [path for path in weights if path not in modules]
    if missing:
        raise ValueError(f"the LoRA adapter targets modules this model lacks: {missing[:3]}")
    wrapped = []
    for path, (a, b) in weights.items():
        module = modules[path]
        if not isinstance(module, LoraSwitch):
            module = LoraSwitch(module, selection)
            wrapped.append((path, module))
        module.add(name, a, b, scale)
    if wrapped:
        model.update_modules(tree_unflatten(wrapped))


def detach_adapter(model: nn.Module, name: str) -> None:
    """Remove adapter `name` from every `LoraSwitch` of the model."""
    for _, module in model.named_modules():
        if isinstance(module, LoraSwitch):
            module.remove(name)
