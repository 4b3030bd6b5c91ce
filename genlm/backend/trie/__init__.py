"""Token-character tries: token distributions to character-level ones."""

from genlm.backend.trie.async_impl import AsyncTokenCharacterTrie
from genlm.backend.trie.base import TokenCharacterTrie
from genlm.backend.trie.parallel import ParallelTokenCharacterTrie

__all__ = ["AsyncTokenCharacterTrie", "ParallelTokenCharacterTrie", "TokenCharacterTrie"]
