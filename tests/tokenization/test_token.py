"""`Token`: bytes that carry a token id, compared between themselves by id."""

import copy
import pickle

import pytest

from genlm.backend.tokenization import Token


def test_behaves_as_its_bytes():
    hello, space, world = Token(1, b"hello"), Token(2, b" "), Token(3, b"w\xc3\xb6rld")
    assert isinstance(hello, bytes)
    assert b"".join([hello, space, world]) == b"hello w\xc3\xb6rld"
    assert len(world) == 6
    assert world.decode() == "wörld"
    assert hello[1:3] == b"el" and type(hello[1:3]) is bytes
    assert hello.startswith(b"he") and b"ll" in hello
    assert hello + b"!" == b"hello!"
    assert hello == b"hello" and hello != b"world"


def test_attributes():
    token = Token(7, bytearray(b"ab"))
    assert token.token_id == 7
    assert token.byte_string == b"ab" and type(token.byte_string) is bytes
    assert Token(0, memoryview(b"xy")).byte_string == b"xy"


def test_equality_and_hash_use_the_id_only():
    assert Token(5, b"a") == Token(5, b"b")
    assert Token(5, b"a") != Token(6, b"a")
    assert hash(Token(5, b"a")) == hash(Token(5, b"b"))
    # Different ids sharing bytes (a special token and its plain-text spelling) stay distinct.
    assert len({Token(5, b"<s>"), Token(6, b"<s>"), Token(5, b"<s>")}) == 2
    assert {Token(5, b"a"): "x"}[Token(5, b"zzz")] == "x"


def test_ordering_uses_the_id_between_tokens():
    tokens = [Token(3, b"a"), Token(1, b"z"), Token(2, b"m")]
    assert [token.token_id for token in sorted(tokens)] == [1, 2, 3]
    assert Token(1, b"z") < Token(2, b"a") and Token(2, b"a") > Token(1, b"z")
    assert Token(1, b"z") <= Token(1, b"a") and Token(1, b"a") >= Token(1, b"z")
    # Against plain bytes a Token orders as its bytes.
    assert Token(9, b"b") < b"c" and Token(9, b"b") > b"a"
    assert Token(9, b"b") <= b"b" and Token(9, b"b") >= b"b"


def test_repr_shows_id_and_bytes():
    assert repr(Token(42, b"hello")) == "Token(token_id=42, byte_string=b'hello')"
    assert repr(Token(7, b"\xe2\x80 x")) == "Token(token_id=7, byte_string=b'\\xe2\\x80 x')"


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickles(protocol):
    token = Token(11, b"\x00\xff tok")
    restored = pickle.loads(pickle.dumps(token, protocol=protocol))
    assert type(restored) is Token
    assert restored.token_id == 11 and restored.byte_string == b"\x00\xff tok"


def test_copies():
    tokens = [Token(1, b"a"), Token(2, b"a")]
    for copied in [copy.deepcopy(tokens), [copy.copy(token) for token in tokens]]:
        assert all(type(token) is Token for token in copied)
        assert [(t.token_id, t.byte_string) for t in copied] == [(1, b"a"), (2, b"a")]


def test_as_bytes():
    plain = Token.as_bytes(Token(3, b"abc"))
    assert plain == b"abc" and type(plain) is bytes
    assert Token.as_bytes(bytearray(b"x")) == b"x"
    assert Token.as_bytes(b"y") == b"y"
    for wrong in ["abc", 3, None, [1, 2]]:
        with pytest.raises(TypeError):
            Token.as_bytes(wrong)


def test_is_plain_bytes():
    assert Token.is_plain_bytes(b"a")
    assert not Token.is_plain_bytes(Token(0, b"a"))
    assert not Token.is_plain_bytes(bytearray(b"a"))
    assert not Token.is_plain_bytes("a")


@pytest.mark.parametrize(
    ("token_id", "byte_string"),
    [("1", b"a"), (1.0, b"a"), (True, b"a"), (None, b"a"), (1, "a"), (1, 5), (1, None)],
)
def test_wrong_argument_types_raise(token_id, byte_string):
    with pytest.raises(TypeError):
        Token(token_id, byte_string)
