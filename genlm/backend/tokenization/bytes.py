"""Byte-level helpers: turn token strings into the bytes they stand for, in bulk.

Byte-level BPE tokenizers (GPT-2 and its descendants) spell every byte as one
printable character. Printable latin-1 bytes spell themselves; the other 68
bytes (control characters, space, NBSP, soft hyphen...) are shifted, in byte
order, to the code points from U+0100 up. SentencePiece tokenizers spell a
space as `▁` and, with byte fallback, a raw byte as a piece such as `<0xE2>`.

The functions here work on a whole vocabulary at once: one `str.translate`
and one `encode` over all token strings joined together run at C speed, and
only the rare tokens that do not fit the scheme get per-token work.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Mapping
from itertools import accumulate
from typing import Any


class ByteDecoderError(ValueError):
    """The byte strings of a tokenizer's tokens cannot be recovered.

    Raised by `check_byte_decoder` (a byte decoder that cannot round-trip the
    tokenizer) and, as its subclass `ByteVocabError`, by `decode_vocab` and
    `get_byte_vocab`; the message starts "Could not decode byte
    representation" and says which tokens and why.
    """


class ByteVocabError(ByteDecoderError):
    """A tokenizer's vocabulary cannot be turned into bytes.

    Raised by `decode_vocab` and `get_byte_vocab` when the tokenizer has no
    `tokenizers` backend, or a decoder whose tokens do not stand for fixed
    bytes (one that is neither byte-level nor SentencePiece-style, such as
    WordPiece, or no decoder at all). A `ByteDecoderError`, hence a
    `ValueError`; the message starts "Could not decode byte representation".
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
    starts = [0, *ends[:-1]]
    token_bytes = list(map(blob.__getitem__, map(slice, starts, ends)))
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


def get_byte_vocab(tokenizer: Any) -> list[bytes]:
    """The byte strings of a tokenizer's vocabulary, by token id.

    The bytes of `decode_vocab(tokenizer)[0]`, as plain `bytes` (no `Token`s
    and no string vocabulary are built).

    Args:
        tokenizer: A Hugging Face tokenizer backed by the `tokenizers` library.

    Returns:
        A list of length `len(tokenizer)`: item `i` is the bytes token `i`
        contributes to decoded text.

    Raises:
        ByteVocabError: (a `ByteDecoderError` and a `ValueError`) If the
            vocabulary cannot be turned into bytes (see `decode_vocab`).
    """
    from genlm.backend.tokenization.vocab import _vocab_bytes

    return _vocab_bytes(tokenizer).token_bytes


def check_byte_decoder(tokenizer: Any, byte_decoder: Mapping[str, int]) -> None:
    """Check that a byte decoder round-trips every token of a tokenizer.

    A byte decoder maps each character of a byte-level alphabet to the byte
    it spells (as `unicode_to_byte()` does for the GPT-2 alphabet). It
    round-trips the tokenizer when, for every token of the model's vocabulary
    (added and special tokens, which stand for their text, are left out),
    mapping the token's string character by character gives exactly the
    bytes the tokenizer's own decoder gives (those of `get_byte_vocab`).

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
    from genlm.backend.tokenization.vocab import _vocab_bytes

    prefix = (
        f"Could not decode byte representation of the tokens of {type(tokenizer).__name__} "
        "with this byte decoder"
    )
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
    vocab = _vocab_bytes(tokenizer)
    ids = [i for i in range(len(vocab.token_bytes)) if i not in vocab.added_ids]
    strings = [vocab.token_strings[i] for i in ids]
    joined = "".join(strings)
    missing = sorted(set(joined).difference(byte_decoder))
    if missing:
        raise ByteDecoderError(
            f"{prefix}: it has no byte for {len(missing)} character(s) of the tokens, "
            f"e.g. {''.join(missing[:10])!r}"
        )
    # One character per byte after the translation, so token boundaries stay put.
    blob = joined.translate(table).encode("latin-1")
    ends = list(accumulate(map(len, strings)))
    starts = [0, *ends[:-1]]
    wrong = [
        (token_id, string, blob[start:end])
        for token_id, string, start, end in zip(ids, strings, starts, ends, strict=True)
        if blob[start:end] != vocab.token_bytes[token_id]
    ]
    if wrong:
        token_id, string, got = wrong[0]
        raise ByteDecoderError(
            f"{prefix}: {len(wrong)} token(s) map to other bytes than the tokenizer's, "
            f"e.g. token {token_id} {string!r} maps to {got!r}, "
            f"the tokenizer's bytes are {vocab.token_bytes[token_id]!r}"
        )
