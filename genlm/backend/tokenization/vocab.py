"""`decode_vocab`: a tokenizer's vocabulary as `Token`s and strings."""

from __future__ import annotations

import gc
import re
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate, repeat
from typing import Any

from genlm.backend.tokenization.bytes import ByteVocabError, get_byte_vocab
from genlm.backend.tokenization.token import Token

BYTE2STR_FALLBACKS = ("tokenizer", "latin1", "replace")

_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")
_UNDECODABLE = "Could not decode byte representation"


def decode_vocab(
    tokenizer: Any, byte2str_fallback: str = "tokenizer"
) -> tuple[list[Token], list[str]]:
    """Decode a tokenizer's whole vocabulary to the bytes each token contributes.

    The decoding follows the tokenizer's own decoder (read from its
    `backend_tokenizer`), so it is exact for every family it supports:
    byte-level BPE (GPT-2, Llama 3, Qwen2, ...), SentencePiece-style
    vocabularies with or without byte fallback (Llama 2, Phi-3: `▁` is a space,
    `<0xNN>` is one byte), and added and special tokens, which contribute
    their content as UTF-8 text (the text that encodes to them). A
    SentencePiece space is kept on every token, including the first of a text,
    where the tokenizer's `decode` strips it.

    The bytes come from this module's `get_byte_vocab` (looked up when called,
    so replacing `genlm.backend.tokenization.vocab.get_byte_vocab` changes
    them) and the strings from `bytes_to_strs`.

    Args:
        tokenizer: A Hugging Face tokenizer backed by the `tokenizers` library
            (any `PreTrainedTokenizerFast` / `TokenizersBackend`).
        byte2str_fallback: What `str_vocab` holds for a token whose bytes are
            not valid UTF-8: `"tokenizer"` the tokenizer's own token string
            (e.g. `"<0xE2>"` or `"âĢ"`), `"latin1"` the latin-1 decoding of the
            bytes, `"replace"` the UTF-8 decoding with every invalid sequence
            replaced by U+FFFD.

    Returns:
        `(byte_vocab, str_vocab)`, both of length `len(tokenizer)`:
        `byte_vocab[i]` is `Token(i, bytes of token i)`, `str_vocab[i]` the
        UTF-8 decoding of those bytes (or the fallback above).

    Raises:
        ValueError: If `byte2str_fallback` is not one of the above.
        ByteVocabError: (a `ByteDecoderError` and a `ValueError`) If the
            vocabulary cannot be turned into bytes: the tokenizer has no
            `tokenizers` backend, or a decoder that is neither byte-level nor
            SentencePiece-style, whose per-token bytes are not defined (e.g.
            WordPiece, which inserts spaces between tokens, or no decoder);
            the message starts "Could not decode byte representation", also
            when a replaced `get_byte_vocab` raised `ByteVocabError` with
            another message.
    """
    _check_fallback(byte2str_fallback)
    with _garbage_collection_paused():
        try:
            token_bytes = get_byte_vocab(tokenizer)
        except ByteVocabError as error:
            if str(error).startswith(_UNDECODABLE):
                raise
            raise ByteVocabError(
                f"{_UNDECODABLE} of the tokens of {type(tokenizer).__name__}: {error}"
            ) from error
        byte_vocab = list(map(Token, range(len(token_bytes)), token_bytes))
        str_vocab = bytes_to_strs(tokenizer, token_bytes, byte2str_fallback)
    return byte_vocab, str_vocab


def bytes_to_strs(tokenizer: Any, byte_vocab: Sequence[bytes], byte2str_fallback: str) -> list[str]:
    """The string of every token: the UTF-8 decoding of its bytes, or a fallback.

    Args:
        tokenizer: The Hugging Face tokenizer the bytes belong to (its
            `convert_ids_to_tokens` gives the `"tokenizer"` fallback).
        byte_vocab: The bytes of each token, by id (plain `bytes` or `Token`s).
        byte2str_fallback: What stands for bytes that are not valid UTF-8:
            `"tokenizer"` the tokenizer's own token string, `"latin1"` the
            latin-1 decoding, `"replace"` the UTF-8 decoding with every invalid
            sequence replaced by U+FFFD.

    Returns:
        A list as long as `byte_vocab`: item `i` the string of token `i`.
        Distinct tokens may have equal strings.

    Raises:
        ValueError: If `byte2str_fallback` is not one of the above.
    """
    _check_fallback(byte2str_fallback)
    # Decode everything in C; bytes that are not valid UTF-8 come out as lone
    # surrogates, which a single regex scan over the joined text then locates.
    texts = list(map(bytes.decode, byte_vocab, repeat("utf-8"), repeat("surrogateescape")))
    joined = "".join(texts)
    ends = list(accumulate(map(len, texts)))
    invalid = sorted(
        {bisect_right(ends, match.start()) for match in _ESCAPED_BYTE.finditer(joined)}
    )
    if byte2str_fallback == "tokenizer":
        fallbacks = tokenizer.convert_ids_to_tokens(invalid)
    elif byte2str_fallback == "latin1":
        fallbacks = [byte_vocab[token_id].decode("latin-1") for token_id in invalid]
    else:
        fallbacks = [byte_vocab[token_id].decode("utf-8", errors="replace") for token_id in invalid]
    for token_id, text in zip(invalid, fallbacks, strict=True):
        texts[token_id] = text
    return texts


def _check_fallback(byte2str_fallback: str) -> None:
    if byte2str_fallback not in BYTE2STR_FALLBACKS:
        raise ValueError(
            f"byte2str_fallback must be one of {BYTE2STR_FALLBACKS}, got {byte2str_fallback!r}"
        )


@contextmanager
def _garbage_collection_paused() -> Iterator[None]:
    # Each Token carries a __dict__, so building a vocabulary allocates ~1e5
    # tracked objects; with the collector running, repeated scans of the growing
    # list would cost more than all the decoding.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
