"""genlm.backend: exact, batched, cached next-token log-probabilities and byte vocabularies."""

from genlm.backend.errors import EngineDeadError
from genlm.backend.llm import (
    AsyncLM,
    AsyncMlxLM,
    AsyncSGLTransformer,
    AsyncTransformer,
    AsyncVirtualLM,
    MockAsyncLM,
    load_model_by_name,
)
from genlm.backend.tokenization import Token, decode_vocab
from genlm.backend.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
)

__all__ = [
    "AsyncLM",
    "AsyncMlxLM",
    "AsyncSGLTransformer",
    "AsyncTokenCharacterTrie",
    "AsyncTransformer",
    "AsyncVirtualLM",
    "EngineDeadError",
    "MockAsyncLM",
    "ParallelTokenCharacterTrie",
    "Token",
    "TokenCharacterTrie",
    "decode_vocab",
    "load_model_by_name",
]
