"""Exact byte vocabularies of Hugging Face tokenizers."""

from genlm.backend.tokenization.token import Token
from genlm.backend.tokenization.vocab import decode_vocab

__all__ = ["Token", "decode_vocab"]
