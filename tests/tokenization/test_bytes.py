"""The 0.3.x surface of `genlm.backend.tokenization.bytes`: `ByteVocabError`, `get_byte_vocab`,
`check_byte_decoder`, `get_byte_tokens_from_byte_decoder` and `get_byte_tokens_from_sp`, on real
tokenizers and on small in-memory ones."""

import re

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from genlm.backend import assets
from genlm.backend.tokenization import decode_vocab
from genlm.backend.tokenization.bytes import (
    ByteDecoderError,
    ByteVocabError,
    check_byte_decoder,
    get_byte_tokens_from_byte_decoder,
    get_byte_tokens_from_sp,
    get_byte_vocab,
)

BYTE_LEVEL = [name for name in assets.TOKENIZERS if name not in {"llama-spm", "phi-3"}]


@pytest.fixture(scope="module")
def load(tokenizer_path):
    """Factory: tokenizer family name -> tokenizer, each loaded once."""
    cache = {}

    def tokenizer(name):
        if name not in cache:
            cache[name] = AutoTokenizer.from_pretrained(tokenizer_path(name))
        return cache[name]

    return tokenizer


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte decoder, as OpenAI's encoder defines it (transformers' copy of the table)."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _wrap(backend):
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _wordpiece():
    # A decoder that is neither byte-level nor SentencePiece: it inserts spaces between tokens.
    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "##lo": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    return _wrap(backend)


# ByteVocabError


def test_byte_vocab_error_is_an_exception_and_a_value_error():
    assert issubclass(ByteVocabError, Exception)
    assert issubclass(ByteVocabError, ValueError)
    assert issubclass(ByteVocabError, ByteDecoderError)  # what decode_vocab raised before


@pytest.mark.parametrize("function", [decode_vocab, get_byte_vocab])
def test_undecodable_vocabularies_raise_byte_vocab_error(function):
    no_decoder = _wrap(Tokenizer(models.BPE({"a": 0}, [])))
    for tokenizer, reason in [
        (_wordpiece(), "WordPiece"),
        (no_decoder, "no decoder"),
        (object(), "`tokenizers` library"),
    ]:
        with pytest.raises(ByteVocabError) as raised:
            function(tokenizer)
        error = raised.value
        assert isinstance(error, ValueError) and isinstance(error, ByteDecoderError)
        assert str(error).startswith("Could not decode byte representation")
        assert reason in str(error)
    try:  # code written for 0.3.x's decode_vocab catches a ValueError
        function(_wordpiece())
    except ValueError as error:
        assert type(error) is ByteVocabError
    else:
        pytest.fail("no error")


# get_byte_vocab


@pytest.mark.parametrize("name", assets.TOKENIZERS)
def test_get_byte_vocab_is_the_bytes_of_decode_vocab(name, load):
    tokenizer = load(name)
    byte_vocab = get_byte_vocab(tokenizer)
    assert isinstance(byte_vocab, list) and len(byte_vocab) == len(tokenizer)
    assert all(type(token) is bytes for token in byte_vocab)  # plain bytes, not Tokens
    assert byte_vocab == [bytes(token) for token in decode_vocab(tokenizer)[0]]


def test_get_byte_vocab_spells_the_original_text(load):
    tokenizer = load("gpt-2")
    byte_vocab = get_byte_vocab(tokenizer)
    texts = [text for text, _ in assets.tokenizer_cases("gpt-2", fetch=False)]
    texts += ["héllo wörld 👍🏽 日本語\n\t\x00 <|endoftext|>", " ", ""]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(byte_vocab[i] for i in ids) == text.encode(), text
    assert byte_vocab[tokenizer.convert_tokens_to_ids("Ġworld")] == b" world"
    assert byte_vocab[tokenizer.convert_tokens_to_ids("âĢ")] == b"\xe2\x80"


def test_get_byte_vocab_returns_a_new_list_each_call(load):
    tokenizer = load("gpt-2")
    first = get_byte_vocab(tokenizer)
    first[0] = b"changed"
    assert get_byte_vocab(tokenizer)[0] == b"!"


# check_byte_decoder


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_the_gpt2_byte_decoder_round_trips_byte_level_tokenizers(name, load):
    assert check_byte_decoder(load(name), gpt2_byte_decoder()) is None


def _corrupted() -> dict[str, dict]:
    missing = gpt2_byte_decoder()
    del missing["Ġ"]
    wrong_byte = gpt2_byte_decoder()
    wrong_byte["Ġ"] = ord("x")
    swapped = gpt2_byte_decoder()
    swapped["a"], swapped["b"] = swapped["b"], swapped["a"]
    not_a_byte = gpt2_byte_decoder()
    not_a_byte["Ġ"] = 288
    long_key = gpt2_byte_decoder()
    long_key["ab"] = 1
    return {
        "missing": (missing, "no byte for 1 character"),
        "wrong byte": (wrong_byte, "token 220 'Ġ' maps to b'x', the tokenizer's bytes are b' '"),
        "swapped": (swapped, "map to other bytes than the tokenizer's"),
        "not a byte": (not_a_byte, "maps 'Ġ' to 288"),
        "long key": (long_key, "maps 'ab' to 1"),
        "empty": ({}, "no byte for"),
    }


@pytest.mark.parametrize("case", list(_corrupted()))
def test_a_corrupted_byte_decoder_raises(case, load):
    byte_decoder, reason = _corrupted()[case]
    with pytest.raises(ByteDecoderError) as raised:
        check_byte_decoder(load("gpt-2"), byte_decoder)
    message = str(raised.value)
    assert message.startswith("Could not decode byte representation")
    assert reason in message
    assert not isinstance(raised.value, ByteVocabError)  # the tokenizer itself is fine


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_the_gpt2_byte_decoder_does_not_round_trip_sentencepiece(name, load):
    with pytest.raises(ByteDecoderError, match="no byte for"):
        check_byte_decoder(load(name), gpt2_byte_decoder())


def test_check_byte_decoder_on_an_undecodable_vocabulary():
    with pytest.raises(ByteDecoderError) as raised:
        check_byte_decoder(_wordpiece(), gpt2_byte_decoder())
    assert isinstance(raised.value, ByteVocabError)


# get_byte_tokens_from_byte_decoder


def _added_contents(tokenizer) -> dict[int, bytes]:
    return {i: token.content.encode() for i, token in tokenizer.added_tokens_decoder.items()}


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_byte_decoder_spells_each_token_string(name, load):
    tokenizer = load(name)
    byte_decoder = gpt2_byte_decoder()
    byte_tokens = get_byte_tokens_from_byte_decoder(tokenizer, byte_decoder)
    assert isinstance(byte_tokens, list) and len(byte_tokens) == len(tokenizer)
    assert all(type(token) is bytes for token in byte_tokens)
    # The reference, one token at a time: each character of the token's string is one byte;
    # an added token is its text.
    added = _added_contents(tokenizer)
    strings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    expected = [
        added[i] if i in added else bytes(byte_decoder[char] for char in string)
        for i, string in enumerate(strings)
    ]
    assert byte_tokens == expected
    # A byte-level tokenizer's tokens spell the original text.
    for text in [text for text, _ in assets.tokenizer_cases(name, fetch=False)][:20]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        normalizer = tokenizer.backend_tokenizer.normalizer
        text = normalizer.normalize_str(text) if normalizer else text
        assert b"".join(byte_tokens[i] for i in ids) == text.encode(), text


def test_byte_decoder_results_known_by_hand(load):
    tokenizer = load("deepseek-coder")
    byte_tokens = get_byte_tokens_from_byte_decoder(tokenizer, gpt2_byte_decoder())
    assert byte_tokens[tokenizer.convert_tokens_to_ids("Ġworld")] == b" world"
    # An added token stands for its text: "õ" is not the byte 0xF5 that its string spells.
    assert byte_tokens[32000] == "õ".encode() == b"\xc3\xb5"
    assert byte_tokens[32257] == "<｜begin▁of▁sentence｜>".encode()


def test_byte_decoder_follows_the_decoder_it_is_given(load):
    tokenizer = load("gpt-2")
    byte_decoder = gpt2_byte_decoder()
    byte_decoder["Ġ"] = ord("_")
    byte_tokens = get_byte_tokens_from_byte_decoder(tokenizer, byte_decoder)
    assert byte_tokens[tokenizer.convert_tokens_to_ids("Ġworld")] == b"_world"
    assert byte_tokens[50256] == b"<|endoftext|>"


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_byte_decoder_without_a_character_of_the_tokens_raises(name, load):
    # genlm-backend 0.3.1 raised a bare KeyError here.
    with pytest.raises(
        ByteDecoderError, match="^Could not decode byte representation.*no byte for"
    ):
        get_byte_tokens_from_byte_decoder(load(name), gpt2_byte_decoder())


@pytest.mark.parametrize("case", ["not a byte", "long key"])
def test_byte_decoder_with_a_bad_entry_raises(case, load):
    byte_decoder, reason = _corrupted()[case]
    with pytest.raises(ByteDecoderError, match=re.escape(reason)):
        get_byte_tokens_from_byte_decoder(load("gpt-2"), byte_decoder)


# get_byte_tokens_from_sp

_BYTE_PIECE = re.compile("<0x([0-9A-Fa-f]{2})>")


@pytest.mark.parametrize("name", assets.TOKENIZERS)
def test_sentencepiece_spelling_of_each_token(name, load):
    tokenizer = load(name)
    byte_tokens = get_byte_tokens_from_sp(tokenizer)
    assert isinstance(byte_tokens, list) and len(byte_tokens) == len(tokenizer)
    assert all(type(token) is bytes for token in byte_tokens)
    # The reference, one token at a time: a whole byte piece of the model's vocabulary is its
    # byte; otherwise the text (an added token's being its content), with "▁" as a space.
    added = {i: token.content for i, token in tokenizer.added_tokens_decoder.items()}
    expected = []
    for i, string in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        piece = _BYTE_PIECE.fullmatch(string)
        if piece and i not in added:
            expected.append(bytes([int(piece[1], 16)]))
        else:
            expected.append(added.get(i, string).replace("▁", " ").encode())
    assert byte_tokens == expected


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_sentencepiece_spelling_is_the_vocabulary_of_sentencepiece_tokenizers(name, load):
    tokenizer = load(name)
    byte_tokens = get_byte_tokens_from_sp(tokenizer)
    assert byte_tokens == get_byte_vocab(tokenizer)
    assert byte_tokens[tokenizer.convert_tokens_to_ids("▁Hello")] == b" Hello"
    assert byte_tokens[tokenizer.convert_tokens_to_ids("<0xE2>")] == b"\xe2"
    assert byte_tokens[1] == b"<s>"


def test_sentencepiece_spelling_of_a_byte_level_tokenizer(load):
    # The decoder is not consulted: a byte-level string is read as text, and "▁" is a space
    # even inside DeepSeek's special tokens (genlm-backend 0.3.1 gives the same).
    gpt2 = load("gpt-2")
    assert get_byte_tokens_from_sp(gpt2)[gpt2.convert_tokens_to_ids("Ġworld")] == b"\xc4\xa0world"
    deepseek = load("deepseek-coder")
    byte_tokens = get_byte_tokens_from_sp(deepseek)
    assert byte_tokens[32257] == "<｜begin of sentence｜>".encode()
    assert byte_tokens[32000] == "õ".encode()


def test_byte_tokens_need_a_fast_tokenizer():
    for function in [get_byte_tokens_from_sp, lambda t: get_byte_tokens_from_byte_decoder(t, {})]:
        with pytest.raises(ByteVocabError, match="`tokenizers` library"):
            function(object())


def test_byte_tokens_of_in_memory_tokenizers():
    # A hole (an id the model does not know) stands for nothing; only a whole byte piece is a
    # byte, in either case of hex digits; the decoder, even WordPiece, is not consulted.
    vocab = {"<0x4a>": 0, "<0x4A>x": 1, "##c": 2, "a▁b": 4, "d": 5}  # 5 tokens: id 3 is a hole
    backend = Tokenizer(models.WordPiece(vocab, unk_token="a▁b"))
    backend.decoder = decoders.WordPiece()
    tokenizer = _wrap(backend)
    assert get_byte_tokens_from_sp(tokenizer) == [b"J", b"<0x4A>x", b"##c", b"", b"a b"]
    byte_decoder = {char: ord(char) for char in "<0x4aA>#c"} | {"▁": 32, "b": 98}
    byte_tokens = get_byte_tokens_from_byte_decoder(tokenizer, byte_decoder)
    assert byte_tokens == [b"<0x4a>", b"<0x4A>x", b"##c", b"", b"a b"]
