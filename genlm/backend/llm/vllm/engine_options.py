"""How `AsyncVirtualLM.from_name` configures the vLLM engines it starts."""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from genlm.backend.llm.vllm.capture import EXTENSION


def engine_options(engine_opts: dict[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM`: the backend's defaults updated by `engine_opts`.

    The defaults are `enable_prefix_caching=True`, the capture's
    `worker_extension_cls` and, on vLLM's CPU build, `block_size=32` and
    `kv_cache_memory_bytes` (a quarter of the memory available now, at most
    2 GiB) unless `VLLM_CPU_KVCACHE_SPACE` is set or `engine_opts` size the
    memory themselves.

    Args:
        engine_opts: The caller's `vllm.LLM` keyword arguments (`None`: none).

    Returns:
        A new dict.
    """
    from vllm.platforms import current_platform

    options: dict[str, Any] = {"enable_prefix_caching": True, "worker_extension_cls": EXTENSION}
    engine_opts = engine_opts or {}
    if current_platform.is_cpu():
        options["block_size"] = 32
        sized = {"kv_cache_memory_bytes", "gpu_memory_utilization"} & engine_opts.keys()
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE") and not sized:
            import psutil

            available = psutil.virtual_memory().available
            options["kv_cache_memory_bytes"] = min(2 << 30, available // 4)
    options.update(engine_opts)
    return options


def use_v1_runner_from_now() -> None:
    """Make later engines of this process use vLLM's V1 model runner.

    Call it once the engine to replace is unreferenced: its device memory is
    freed first, so that the next engine's memory check sees it free.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    from vllm import envs as vllm_envs

    vllm_envs.disable_envs_cache()  # its first engine froze the settings it had read
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
