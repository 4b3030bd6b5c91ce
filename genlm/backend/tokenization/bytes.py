"""The bytes every token of a tokenizer stands for.

Byte-level BPE tokenizers (GPT-2 and its descendants) spell every byte as one
printable character. Printable latin-1 bytes spell themselves; the other 68
bytes (control characters, space, NBSP, soft hyphen...) are shifted, in byte
order, to the code points from U+0100 up. SentencePiece tokenizers spell a
space as `▁` and, with byte fallback, a raw byte as a piece such as `<0xE2>`.

`get_byte_vocab` follows the tokenizer's own decoder, step by step, so it is
exact for every family that decoder supports; `get_byte_tokens_from_byte_decoder`
and `get_byte_tokens_from_sp` apply one of the two spellings above, whatever
the decoder says. All of them work on a whole vocabulary at once: one
`str.translate` and one `encode` over all token strings joined together run at
C speed, and only the rare tokens that do not fit the scheme get per-token work.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from collections.abc import Mapping
from itertools import accumulate
from typing import Any, NamedTuple


class ByteDecoderError(ValueError):
    """The byte strings of a tokenizer's tokens cannot be recovered.

    Raised by `check_byte_decoder` and `get_byte_tokens_from_byte_decoder` (a
    byte decoder that cannot round-trip the tokenizer) and, as its subclass
    `ByteVocabError`, by `decode_vocab` and `get_byte_vocab`; the message
    starts "Could not decode byte representation" and says which tokens and why.
    """


class ByteVocabError(ByteDecoderError):
    """A tokenizer's vocabulary cannot be turned into bytes.

    Raised by `decode_vocab` and `get_byte_vocab` when the tokenizer has no
    `tokenizers` backend, or a decoder whose tokens do not stand for fixed
    bytes (one that is neither byte-level nor SentencePiece-style, such as
    WordPiece, or no decoder at all); by the other functions of this module
    when the tokenizer has no `tokenizers` backend. A `ByteDecoderError`,
    hence a `ValueError`; the message starts "Could not decode byte
    representation".
    """


_PRINTABLE_LATIN1 = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]

# Marks a character that is not a byte-level character once the table has been applied.
_NOT_A_BYTE = "\u0100"
_NON_LATIN1 = re.compile("[^\x00-\xff]")


def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: the character that spells each byte.

    Returns:
        A dict from each byte value (0-255) to its one-character spelling.
    """
    spelling = {byte: chr(byte) for byte in _PRINTABLE_LATIN1}
    shifted = (byte for byte in range(256) if byte not in spelling)
    for offset, byte in enumerate(shifted):
        spelling[byte] = chr(0x100 + offset)
    return dict(sorted(spelling.items()))


def unicode_to_byte() -> dict[str, int]:
    """The inverse of `byte_to_unicode`: the byte each byte-level character spells.

    Returns:
        A dict from each of the 256 byte-level characters to its byte value.
    """
    return {char: byte for byte, char in byte_to_unicode().items()}


def _byte_level_translation() -> dict[int, str]:
    # Every byte-level character becomes the latin-1 character of its byte;
    # every other latin-1 character becomes a character outside latin-1, so that
    # after translation "outside latin-1" means exactly "not a byte-level character".
    table = {ord(char): chr(byte) for char, byte in unicode_to_byte().items()}
    for code_point in range(256):
        table.setdefault(code_point, _NOT_A_BYTE)
    return table


_BYTE_LEVEL_TRANSLATION = _byte_level_translation()


def _cut(blob: bytes, ends: list[int]) -> list[bytes]:
    """`blob` cut into pieces that end at `ends` (running totals of the piece lengths)."""
    return list(map(blob.__getitem__, map(slice, [0, *ends[:-1]], ends)))


def byte_level_to_bytes(token_strings: list[str]) -> list[bytes]:
    """Decode the strings of a byte-level BPE vocabulary to bytes.

    A string made only of byte-level characters stands for the bytes they
    spell. A string holding any other character is taken as plain text and
    stands for its UTF-8 encoding (this is what the Hugging Face `ByteLevel`
    decoder does with it).

    Args:
        token_strings: The token strings, e.g. `["Hello", "Ġworld", "âĢĶ"]`.

    Returns:
        The bytes of each string, in order, e.g. `[b"Hello", b" world", b"\\xe2\\x80\\x94"]`.
    """
    translated = "".join(token_strings).translate(_BYTE_LEVEL_TRANSLATION)
    # One byte per character: a character outside latin-1 becomes b"?", and every
    # token holding one is re-encoded below, so the offsets of the others stay right.
    blob = translated.encode("latin-1", errors="replace")
    ends = list(accumulate(map(len, token_strings)))
    token_bytes = _cut(blob, ends)
    for match in _NON_LATIN1.finditer(translated):
        index = bisect_right(ends, match.start())
        token_bytes[index] = token_strings[index].encode("utf-8")
    return token_bytes


_BYTE_PIECES = {
    spelling: bytes([byte])
    for byte in range(256)
    for spelling in {f"<0x{byte:02X}>", f"<0x{byte:02x}>"}
}


def byte_pieces_to_bytes(token_strings: list[str | bytes]) -> list[str | bytes]:
    """Replace SentencePiece byte-fallback pieces (`<0xNN>`) by the byte they stand for.

    Args:
        token_strings: Token strings (items that are already bytes are kept).

    Returns:
        The list with every `<0xNN>` piece replaced by its single byte; the
        other items unchanged.
    """
    return [_BYTE_PIECES.get(piece, piece) for piece in token_strings]


_SPACE_MARK = "▁".encode()


def _encoded(pieces: list[str | bytes]) -> list[bytes]:
    return [piece if isinstance(piece, bytes) else piece.encode("utf-8") for piece in pieces]


class _TokenStrings(NamedTuple):
    """A tokenizer's `tokenizers` backend, its token strings by id, and its added tokens."""

    backend: Any
    strings: list[str]
    # Added (and special) tokens stand for their content, as UTF-8: the text
    # that encodes to them, not a decoding of their string.
    added: dict[int, bytes]

    def with_added(self, token_bytes: list[bytes]) -> list[bytes]:
        """`token_bytes` (changed in place) with each added token's entry set to its content."""
        for token_id, content in self.added.items():
            token_bytes[token_id] = content
        return token_bytes


def _token_strings(tokenizer: Any) -> _TokenStrings:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        raise ByteVocabError(
            f"Could not decode byte representation of the tokens of {type(tokenizer).__name__}: "
            "it needs a tokenizer backed by the `tokenizers` library (a fast tokenizer)"
        )
    vocab_size = len(tokenizer)
    # One C-level pass; an id the tokenizer does not know (a hole) stands for nothing.
    strings = list(map(backend.id_to_token, range(vocab_size)))
    if None in strings:
        strings = ["" if string is None else string for string in strings]
    added = {
        token_id: token.content.encode("utf-8")
        for token_id, token in backend.get_added_tokens_decoder().items()
        if token_id < vocab_size
    }
    return _TokenStrings(backend, strings, added)


def get_byte_vocab(tokenizer: Any) -> list[bytes]:
    """The byte strings of a tokenizer's vocabulary, by token id.

    The bytes of `decode_vocab(tokenizer)[0]`, as plain `bytes` (no `Token`s
    and no string vocabulary are built): each token's string run through the
    tokenizer's own decoder on its own, and each added or special token's
    content as UTF-8.

    Args:
        tokenizer: A Hugging Face tokenizer backed by the `tokenizers` library.

    Returns:
        A list of length `len(tokenizer)`: item `i` is the bytes token `i`
        contributes to decoded text.

    Raises:
        ByteVocabError: (a `ByteDecoderError` and a `ValueError`) If the
            vocabulary cannot be turned into bytes (see `decode_vocab`).
    """
    vocab = _token_strings(tokenizer)
    try:
        token_bytes = _apply_decoder(vocab.backend, vocab.strings)
    except _UndecodableError as error:
        raise ByteVocabError(
            f"Could not decode byte representation of any of the {len(vocab.strings)} tokens "
            f"of {type(tokenizer).__name__}: {error}"
        ) from None
    return vocab.with_added(token_bytes)


def _with_this_byte_decoder(tokenizer: Any) -> str:
    return (
        f"Could not decode byte representation of the tokens of {type(tokenizer).__name__} "
        "with this byte decoder"
    )


def get_byte_tokens_from_byte_decoder(
    tokenizer: Any, byte_decoder: Mapping[str, int]
) -> list[bytes]:
    """The bytes of every token, spelled with a byte decoder.

    A byte decoder maps each character of a byte-level alphabet to the byte
    it spells (as `unicode_to_byte()` does for the GPT-2 alphabet). Each
    token's string is mapped character by character; added and special
    tokens, which stand for their text, give their content as UTF-8. Unlike
    `get_byte_vocab`, the tokenizer's own decoder is not consulted: use
    `check_byte_decoder` to learn whether the two agree.

    Args:
        tokenizer: A Hugging Face tokenizer backed by the `tokenizers` library.
        byte_decoder: Dict from one-character strings to byte values (0-255).

    Returns:
        A list of length `len(tokenizer)`: item `i` is the bytes of token `i`.

    Raises:
        ByteDecoderError: If an entry of `byte_decoder` is not a character
            mapped to a byte value, or if it has no entry for a character of
            a token (genlm-backend 0.3.1 raised `KeyError` there); the message
            starts "Could not decode byte representation".
        ByteVocabError: If the tokenizer has no `tokenizers` backend.
    """
    prefix = _with_this_byte_decoder(tokenizer)
    table = {}
    for char, byte in byte_decoder.items():
        if not (isinstance(char, str) and len(char) == 1) or not (
            isinstance(byte, int) and not isinstance(byte, bool) and 0 <= byte < 256
        ):
            raise ByteDecoderError(
                f"{prefix}: it must map single characters to byte values 0-255, "
                f"but maps {char!r} to {byte!r}"
            )
        table[ord(char)] = chr(byte)
    vocab = _token_strings(tokenizer)
    strings = list(vocab.strings)
    for token_id in vocab.added:
        strings[token_id] = ""
    joined = "".join(strings)
    missing = sorted(set(joined).difference(byte_decoder))
    if missing:
        raise ByteDecoderError(
            f"{prefix}: it has no byte for {len(missing)} character(s) of the tokens, "
            f"e.g. {''.join(missing[:10])!r}"
        )
    # One character per byte after the translation, so token boundaries stay put.
    blob = joined.translate(table).encode("latin-1")
    return vocab.with_added(_cut(blob, list(accumulate(map(len, strings)))))


def get_byte_tokens_from_sp(tokenizer: Any) -> list[bytes]:
    """The bytes of every token, spelled the SentencePiece way.

    `▁` stands for a space in every token, added and special ones included; a
    token of the model's vocabulary that is a whole byte-fallback piece
    `<0xNN>` stands for the byte it names; the rest is UTF-8 text, and an
    added or special token stands for its content. Unlike `get_byte_vocab`,
    the tokenizer's own decoder is not consulted, so on a byte-level tokenizer
    this gives the UTF-8 of its byte-level spelling (`"Ġ"` is `b"\\xc4\\xa0"`).

    Args:
        tokenizer: A Hugging Face tokenizer backed by the `tokenizers` library.

    Returns:
        A list of length `len(tokenizer)`: item `i` is the bytes of token `i`.

    Raises:
        ByteVocabError: If the tokenizer has no `tokenizers` backend.
    """
    vocab = _token_strings(tokenizer)
    token_bytes = vocab.with_added(_encoded(byte_pieces_to_bytes(vocab.strings)))
    return [token.replace(_SPACE_MARK, b" ") for token in token_bytes]


def check_byte_decoder(tokenizer: Any, byte_decoder: Mapping[str, int]) -> None:
    """Check that a byte decoder round-trips every token of a tokenizer.

    It round-trips the tokenizer when `get_byte_tokens_from_byte_decoder`
    gives exactly the bytes the tokenizer's own decoder gives
    (`get_byte_vocab`) for every token.

    Args:
        tokenizer: A Hugging Face tokenizer backed by the `tokenizers` library.
        byte_decoder: Dict from one-character strings to byte values (0-255).

    Raises:
        ByteDecoderError: If an entry of `byte_decoder` is not a character
            mapped to a byte value, if it has no entry for a character of a
            token, or if a token maps to other bytes than the tokenizer's; the
            message starts "Could not decode byte representation" and names
            examples. Its subclass `ByteVocabError` if the tokenizer's own
            bytes cannot be recovered (see `decode_vocab`).
    """
    token_bytes = get_byte_tokens_from_byte_decoder(tokenizer, byte_decoder)
    expected = get_byte_vocab(tokenizer)
    wrong = [
        token_id
        for token_id, (got, want) in enumerate(zip(token_bytes, expected, strict=True))
        if got != want
    ]
    if wrong:
        token_id = wrong[0]
        raise ByteDecoderError(
            f"{_with_this_byte_decoder(tokenizer)}: {len(wrong)} token(s) map to other bytes "
            f"than the tokenizer's, e.g. token {token_id} "
            f"{tokenizer.convert_ids_to_tokens(token_id)!r} maps to {token_bytes[token_id]!r}, "
            f"the tokenizer's bytes are {expected[token_id]!r}"
        )


# The tokenizer's decoder, token by token.


class _UndecodableError(Exception):
    """Why the decoder's steps give no fixed bytes per token (becomes a `ByteVocabError`)."""


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
    return _encoded(pieces)


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
