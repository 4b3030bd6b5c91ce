"""Exceptions shared by the backends."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The inference engine behind a backend died; the backend cannot serve calls any more.

    Raised by every call that was waiting on the engine when it died and by
    every later call that needs it (`next_token_logprobs`, the batch and sync
    variants, `sample`, adapter and cache operations that reach the engine),
    without touching the engine again. The message says what died and, where
    the engine reported something, what it reported; that exception is
    chained as `__cause__`. The remedy is a new backend (e.g.
    `load_model_by_name` again); `cleanup()` still releases what is left of
    the old one.

    Backends raise it when vLLM's engine or one of its worker processes dies
    (`AsyncVirtualLM`) and when SGLang's scheduler fails in a way it cannot
    recover from (`AsyncSGLTransformer`); see docs/backends.md. It is a
    `RuntimeError`, so code that caught engine failures as `RuntimeError`
    still catches it.
    """
