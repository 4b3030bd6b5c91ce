"""The peft LoRA adapters of the transformers backend: `PeftAdapters`.

The first adapter loaded wraps the backend's model in a `peft.PeftModel`, and
removing the last one unwraps it; replacing or removing an adapter drops
every result and key/value cached for it.
"""

from __future__ import annotations

import threading
from typing import Any

from genlm.backend.cache import KVPrefixCache, OutputCache
from genlm.backend.llm.base import LoraRegistry
from genlm.backend.llm.hf.forward import ForwardPasses


class PeftAdapters:
    """Loads, activates and unloads the LoRA adapters of the model a `ForwardPasses` runs.

    Args:
        passes: The backend's batch evaluation: its `model_pass` holds the model
            the adapters wrap, and its remembered batches are forgotten with an adapter.
        loras: The backend's registry of LoRA adapters, which this keeps up to date.
        kv_cache: The key/value prefix tree (one tree per adapter).
        output_cache: The results, keyed by `(adapter, token_ids)`.
        lock: Held around every batch; held here around every change of the model.
    """

    def __init__(
        self,
        passes: ForwardPasses,
        loras: LoraRegistry[Any],
        kv_cache: KVPrefixCache,
        output_cache: OutputCache,
        lock: threading.RLock,
    ):
        self._passes = passes
        self._loras = loras
        self._kv_cache = kv_cache
        self._output_cache = output_cache
        self._lock = lock

    def add(self, lora_path: str, lora_name: str) -> None:
        """Load a peft LoRA adapter under `lora_name` (it is not activated).

        Args:
            lora_path: Folder of the adapter (as written by `save_pretrained`).
            lora_name: Name to select it by; loading an adapter under a name in
                use replaces it and drops what was cached for the old one.

        Raises:
            ImportError: If peft is not installed.
        """
        try:
            from peft import PeftModel
        except ImportError as error:
            raise ImportError("LoRA needs peft: pip install 'genlm-backend[lora]'") from error
        runner = self._passes.model_pass
        with self._lock:
            if not isinstance(runner.model, PeftModel):
                runner.model = PeftModel.from_pretrained(
                    runner.model, lora_path, adapter_name=lora_name
                )
            else:
                if lora_name in self._loras:
                    runner.model.delete_adapter(lora_name)
                    self._forget(lora_name)
                runner.model.load_adapter(lora_path, adapter_name=lora_name)
            runner.model.eval()
            self._loras.add(lora_name, lora_path)

    def activate(self, lora_path: str | None, lora_name: str) -> None:
        """Make `lora_name` the active adapter, loading it from `lora_path` first if it is new.

        Args:
            lora_path: Folder of the adapter; needed only if `lora_name` was not added.
            lora_name: The adapter that calls with `lora_name=None` use from now on.

        Raises:
            ValueError: If `lora_name` was never added and no `lora_path` is given.
        """
        if lora_name not in self._loras and lora_path is not None:
            self.add(lora_path, lora_name)
        self._loras.active = self._loras.check(lora_name)

    def deactivate(self) -> None:
        """Make the base model the active one (calls with `lora_name=None` use it)."""
        self._loras.active = None

    def remove(self, lora_name: str) -> None:
        """Unload an adapter and drop every result and key/value cached for it.

        Args:
            lora_name: A registered adapter (if active, the base model becomes active).

        Raises:
            ValueError: If no adapter is registered under `lora_name`.
        """
        runner = self._passes.model_pass
        with self._lock:
            self._loras.remove(lora_name)
            if self._loras.names:
                runner.model.delete_adapter(lora_name)
            else:  # peft cannot run without an adapter: back to the plain model
                runner.model = runner.model.unload().eval()
            self._forget(lora_name)

    def _forget(self, adapter: str) -> None:
        """Drop the results, key/values and remembered batches of `adapter`."""
        self._output_cache.remove_if(lambda key: key[0] == adapter)
        self._kv_cache.drop(adapter)
        self._passes.forget_batches()
