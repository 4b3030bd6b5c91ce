"""`decode_vocab`: the exact bytes every token of a Hugging Face tokenizer stands for."""

from __future__ import annotations

import gc
import json
import re
from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate, repeat
from typing import Any, NamedTuple

from genlm.backend.tokenization.bytes import (
    ByteVocabError,
    byte_level_to_bytes,
    byte_pieces_to_bytes,
)
from genlm.backend.tokenization.token import Token

BYTE2STR_FALLBACKS = ("tokenizer", "latin1", "replace")

_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


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
            the message starts "Could not decode byte representation".
    """
    if byte2str_fallback not in BYTE2STR_FALLBACKS:
        raise ValueError(
            f"byte2str_fallback must be one of {BYTE2STR_FALLBACKS}, got {byte2str_fallback!r}"
        )
    with _garbage_collection_paused():
        token_bytes, token_strings, _ = _vocab_bytes(tokenizer)
        byte_vocab = list(map(Token, range(len(token_bytes)), token_bytes))
        str_vocab = _bytes_to_strings(token_bytes, token_strings, byte2str_fallback)
    return byte_vocab, str_vocab


class _VocabBytes(NamedTuple):
    """What `_vocab_bytes` recovers from a tokenizer, indexed by token id."""

    token_bytes: list[bytes]
    token_strings: list[str]
    added_ids: frozenset[int]


def _vocab_bytes(tokenizer: Any) -> _VocabBytes:
    """The bytes of every token (what `decode_vocab` and `get_byte_vocab` return).

    Also returns the tokenizer's own token strings, and the ids of its added
    tokens (their bytes are their content as UTF-8, not a decoding of their
    string). Raises `ByteVocabError` as described in `decode_vocab`.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        raise ByteVocabError(
            f"Could not decode byte representation of the tokens of {type(tokenizer).__name__}: "
            "it needs a tokenizer backed by the `tokenizers` library (a fast tokenizer)"
        )
    vocab_size = len(tokenizer)
    token_strings = _token_strings(backend, vocab_size)
    try:
        token_bytes = _apply_decoder(backend, token_strings)
    except _UndecodableError as error:
        raise ByteVocabError(
            f"Could not decode byte representation of any of the {vocab_size} tokens of "
            f"{type(tokenizer).__name__}: {error}"
        ) from None
    added_ids = []
    for token_id, added_token in backend.get_added_tokens_decoder().items():
        if token_id < vocab_size:
            token_bytes[token_id] = added_token.content.encode("utf-8")
            added_ids.append(token_id)
    return _VocabBytes(token_bytes, token_strings, frozenset(added_ids))


class _UndecodableError(Exception):
    """Why the decoder's steps give no fixed bytes per token (becomes a `ByteVocabError`)."""


def _token_strings(backend: Any, vocab_size: int) -> list[str]:
    # One C-level pass; an id the tokenizer does not know (a hole) decodes to nothing.
    token_strings = list(map(backend.id_to_token, range(vocab_size)))
    if None in token_strings:
        token_strings = ["" if string is None else string for string in token_strings]
    return token_strings


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


def _decoder_steps(backend: Any) -> list[dict]:
    if backend.decoder is None:
        raise _UndecodableError("it has no decoder, so it joins tokens with spaces")
    return _flatten(json.loads(backend.decoder.__getstate__()))


def _flatten(config: dict) -> list[dict]:
    if config["type"] == "Sequence":
        return [step for part in config["decoders"] for step in _flatten(part)]
    return [config]


def _apply_decoder(backend: Any, token_strings: list[str]) -> list[bytes]:
    """Run the tokenizer's decoder steps on each token separately.

    Steps that act on the text as a whole (after `Fuse`, e.g. SentencePiece's
    strip of the first space) shape the start or end of a decoded text, not
    what a token contributes, and are skipped.
    """
    pieces: list[str | bytes] = list(token_strings)
    fused = has_bytes = False
    for step in _decoder_steps(backend):
        kind = step["type"]
        if fused and kind not in ("Fuse", "Strip"):
            raise _UndecodableError(f"its decoder has a {kind} step after fusing the tokens")
        if kind == "ByteLevel":
            if has_bytes:
                raise _UndecodableError("its decoder has two byte steps")
            pieces = byte_level_to_bytes(pieces)
            fused = True
        elif kind == "ByteFallback":
            pieces = byte_pieces_to_bytes(pieces)
            has_bytes = True
        elif kind == "Replace":
            pieces = _replace(pieces, step["pattern"], step["content"])
        elif kind == "Metaspace":
            pieces = _replace(pieces, {"String": step["replacement"]}, " ")
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip":
            if not fused:
                pieces = [_strip(piece, step) for piece in pieces]
        else:
            raise _UndecodableError(
                f"its decoder has a {kind} step, so its tokens do not stand for fixed bytes"
            )
    return [piece if isinstance(piece, bytes) else piece.encode("utf-8") for piece in pieces]


def _replace(pieces: list[str | bytes], pattern: dict, content: str) -> list[str | bytes]:
    if "String" in pattern:
        old = pattern["String"]

        def replace(text: str) -> str:
            return text.replace(old, content)
    else:
        regex = re.compile(pattern["Regex"])

        def replace(text: str) -> str:
            return regex.sub(lambda _match: content, text)

    return [piece if isinstance(piece, bytes) else replace(piece) for piece in pieces]


def _strip(piece: str | bytes, step: dict) -> str | bytes:
    if isinstance(piece, bytes):
        return piece
    content, start, stop = step["content"], step["start"], step["stop"]
    for _ in range(start):
        if piece.startswith(content):
            piece = piece[len(content) :]
    for _ in range(stop):
        if piece.endswith(content):
            piece = piece[: -len(content)]
    return piece


def _bytes_to_strings(
    token_bytes: list[bytes], token_strings: list[str], byte2str_fallback: str
) -> list[str]:
    # Decode everything in C; bytes that are not valid UTF-8 come out as lone
    # surrogates, which a single regex scan over the joined text then locates.
    texts = list(map(bytes.decode, token_bytes, repeat("utf-8"), repeat("surrogateescape")))
    joined = "".join(texts)
    ends = list(accumulate(map(len, texts)))
    invalid = {bisect_right(ends, match.start()) for match in _ESCAPED_BYTE.finditer(joined)}
    for token_id in invalid:
        if byte2str_fallback == "tokenizer":
            texts[token_id] = token_strings[token_id]
        elif byte2str_fallback == "latin1":
            texts[token_id] = token_bytes[token_id].decode("latin-1")
        else:
            texts[token_id] = token_bytes[token_id].decode("utf-8", errors="replace")
    return texts
