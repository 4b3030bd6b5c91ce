"""`Token`: the bytes a vocabulary entry contributes, tagged with its id."""

from __future__ import annotations

import numbers
from typing import Any

_BYTES_LIKE = (bytes, bytearray, memoryview)


class Token(bytes):
    """A vocabulary entry: its exact bytes, carrying its token id.

    `Token` is a `bytes` subclass, so `b"".join(tokens)`, `len(token)` and
    `token.decode()` work on the bytes. Between two `Token`s, equality, hashing
    and ordering use `token_id` only, because distinct ids may share bytes (for
    example a special token and the plain text it spells). Compared with
    anything else, a `Token` behaves as its bytes (so `Token(1, b"a") == b"a"`,
    although the two hash differently: do not mix `Token`s and plain bytes as
    keys of one dict or set).

    `Token(token_id, byte_string)` takes the id of the token in its vocabulary
    and the exact bytes the token contributes to decoded text.

    Raises:
        TypeError: If `token_id` is not an int or `byte_string` is not bytes.
    """

    token_id: int

    def __new__(cls, token_id: int, byte_string: bytes) -> Token:
        if type(token_id) is not int:
            if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
                raise TypeError(f"token_id must be an int, got {type(token_id).__name__}")
            token_id = int(token_id)
        if not isinstance(byte_string, _BYTES_LIKE):
            raise TypeError(f"byte_string must be bytes, got {type(byte_string).__name__}")
        token = bytes.__new__(cls, byte_string)
        token.token_id = token_id
        return token

    @property
    def byte_string(self) -> bytes:
        """The token's bytes as a plain `bytes` object."""
        return bytes(self)

    def __repr__(self) -> str:
        return f"Token(token_id={self.token_id}, byte_string={bytes(self)!r})"

    def __hash__(self) -> int:
        return hash(("Token", self.token_id))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id == other.token_id
        return bytes.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __lt__(self, other: Any) -> bool:
        if isinstance(other, Token):
            return self.token_id < other.token_id
        return bytes.__lt__(self, other)

    def __le__(self, other: Any) -> bool:
        if isinstance(other, Token):
            return self.token_id <= other.token_id
        return bytes.__le__(self, other)

    def __gt__(self, other: Any) -> bool:
        if isinstance(other, Token):
            return self.token_id > other.token_id
        return bytes.__gt__(self, other)

    def __ge__(self, other: Any) -> bool:
        if isinstance(other, Token):
            return self.token_id >= other.token_id
        return bytes.__ge__(self, other)

    def __reduce__(self) -> tuple:
        return (Token, (self.token_id, bytes(self)))

    @staticmethod
    def as_bytes(x: bytes) -> bytes:
        """Return the plain bytes of a `Token` or of a bytes-like object.

        Args:
            x: A `Token`, `bytes`, `bytearray` or `memoryview`.

        Returns:
            The bytes as a plain `bytes` object.

        Raises:
            TypeError: If `x` is not bytes-like.
        """
        if isinstance(x, _BYTES_LIKE):
            return bytes(x)
        raise TypeError(f"expected a Token or bytes, got {type(x).__name__}")

    @staticmethod
    def is_plain_bytes(x: object) -> bool:
        """Whether `x` is a `bytes` object that is not a `Token`."""
        return isinstance(x, bytes) and not isinstance(x, Token)
