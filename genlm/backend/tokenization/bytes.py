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
from itertools import accumulate


class ByteDecoderError(ValueError):
    """The byte strings of a tokenizer's tokens cannot be recovered.

    Raised by `decode_vocab`; the message starts "Could not decode byte
    representation" and says which tokens and why.
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
