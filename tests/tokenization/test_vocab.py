"""`decode_vocab` on ten real tokenizers, checked against the original text and each tokenizer's
own (Rust) decoder, plus small in-memory tokenizers for decoder steps the ten do not use."""

import gc

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from genlm.backend import assets
from genlm.backend.tokenization import Token, decode_vocab, vocab
from genlm.backend.tokenization.bytes import (
    ByteDecoderError,
    ByteVocabError,
    byte_level_to_bytes,
    byte_to_unicode,
    get_byte_vocab,
    unicode_to_byte,
)
from genlm.backend.tokenization.vocab import bytes_to_strs

# The two SentencePiece-style tokenizers; the other eight are byte-level BPE.
SENTENCEPIECE = {"llama-spm", "phi-3"}

HARD_TEXTS = [
    "héllo wörld, naïve café, Ærøskøbing",
    "e\u0301 combining accent",
    "👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷 🦙",
    "日本語のテキスト、中文，한국어",
    "a\tb\t\tc\t",
    "line\r\nnext\rcr\nlf\n\n\r\n",
    "a     b      c  ",
    "   leading and trailing   ",
    " ",
    "\u00a0nbsp\u00ad soft hyphen \u200b zero width",
    "\x00\x01\x7f control bytes",
    "<0xE2> looks like a byte piece",
    "▁ a literal SentencePiece space",
    "<|endoftext|> <s></s> <|im_start|>user<|im_end|>",
    "ü õ ÷ ÿ",
    "def f(x):\n    return x  # code\n",
    "",
]


@pytest.fixture(scope="module")
def loaded(tokenizer_path):
    """Factory: name -> (tokenizer, byte_vocab, str_vocab), each loaded and decoded once."""
    cache = {}

    def load(name):
        if name not in cache:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(name))
            cache[name] = (tokenizer, *decode_vocab(tokenizer))
        return cache[name]

    return load


def _anchored_decode(tokenizer, batch):
    """The tokenizer's own decoding of each id list, exactly as it appears inside a text.

    SentencePiece decoders strip the first space of the whole output, so each list is
    decoded after an anchor token ("a") and the anchor's text is cut off again.
    """
    backend = tokenizer.backend_tokenizer
    anchor = tokenizer.encode("a", add_special_tokens=False)
    anchor_text = backend.decode(anchor, skip_special_tokens=False)
    decoded = backend.decode_batch([anchor + ids for ids in batch], skip_special_tokens=False)
    assert all(text.startswith(anchor_text) for text in decoded)
    return anchor_text, [text[len(anchor_text) :] for text in decoded]


def _texts(name, tokenizer):
    """llama.cpp's inputs, the hard strings, and text spelling this tokenizer's added tokens."""
    added = [token.content for _, token in sorted(tokenizer.added_tokens_decoder.items())]
    spelled = [f"x{content}y {content}\n{content}" for content in added[:4] + added[-4:]]
    return [text for text, _ in assets.tokenizer_cases(name, fetch=False)] + HARD_TEXTS + spelled


@pytest.mark.parametrize("name", assets.TOKENIZERS)
def test_vocab_shape_and_ids(name, loaded):
    tokenizer, byte_vocab, str_vocab = loaded(name)
    assert len(byte_vocab) == len(str_vocab) == len(tokenizer)
    assert all(type(token) is Token for token in byte_vocab)
    assert [token.token_id for token in byte_vocab] == list(range(len(tokenizer)))
    assert all(type(text) is str for text in str_vocab)


@pytest.mark.parametrize("name", assets.TOKENIZERS)
def test_encoded_bytes_spell_the_text(name, loaded):
    tokenizer, byte_vocab, _ = loaded(name)
    texts = _texts(name, tokenizer)
    encodings = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    joined = [b"".join(byte_vocab[i] for i in ids) for ids in encodings]
    if name not in SENTENCEPIECE:
        # Byte-level BPE is lossless: the bytes are the original text, after the tokenizer's
        # normaliser if it has one (qwen2's NFC composes the "e\u0301" above).
        normalizer = tokenizer.backend_tokenizer.normalizer
        for text, spelled in zip(texts, joined, strict=True):
            expected = normalizer.normalize_str(text) if normalizer else text
            assert spelled == expected.encode(), text
        return
    # SentencePiece normalises the text before encoding: it adds a dummy-prefix space (per
    # segment between special tokens, for phi-3) and reads a typed "▁" as a space. The
    # reference is then the tokenizer's own decoding of the ids, with the first space that its
    # decoder strips kept; and apart from spaces the bytes must still be the original text.
    _, decoded = _anchored_decode(tokenizer, encodings)
    for text, spelled, reference in zip(texts, joined, decoded, strict=True):
        assert spelled == reference.encode(), text
        assert spelled.decode().replace(" ", "") == text.replace(" ", "").replace("▁", ""), text


@pytest.mark.parametrize("name", assets.TOKENIZERS)
def test_every_token_decodes_like_the_tokenizer(name, loaded):
    tokenizer, byte_vocab, _ = loaded(name)
    anchor_text, decoded = _anchored_decode(tokenizer, [[i] for i in range(len(tokenizer))])
    anchor_bytes = anchor_text.encode()
    garbled = []
    for token, reference in zip(byte_vocab, decoded, strict=True):
        # Rust's lossy UTF-8 decoding and Python's errors="replace" both put one U+FFFD per
        # maximal invalid subsequence, so this also covers tokens that are not valid UTF-8.
        ours = (anchor_bytes + token).decode("utf-8", errors="replace")[len(anchor_text) :]
        if ours != reference:
            garbled.append(token)
    # The only disagreements allowed: added tokens whose content the tokenizer's byte-level
    # decoder garbles (DeepSeek's "õ" read as the single byte 0xF5). Their reference is the
    # text that encodes to them: their content, which must encode to exactly that token.
    added = tokenizer.added_tokens_decoder
    for token in garbled:
        assert token.token_id in added, token
        assert "\ufffd" in decoded[token.token_id]
        content = added[token.token_id].content
        assert token.decode() == content
        assert tokenizer.encode(content, add_special_tokens=False) == [token.token_id]


@pytest.mark.parametrize("name", assets.TOKENIZERS)
def test_str_vocab_follows_each_fallback(name, loaded):
    tokenizer, byte_vocab, default_strs = loaded(name)
    invalid = []
    for token, text in zip(byte_vocab, default_strs, strict=True):
        try:
            assert text == token.decode("utf-8")
        except UnicodeDecodeError:
            invalid.append(token)
    assert invalid  # every family here has tokens that are a lone byte of a longer character
    invalid_ids = [token.token_id for token in invalid]
    tokenizer_strings = tokenizer.convert_ids_to_tokens(invalid_ids)
    assert [default_strs[i] for i in invalid_ids] == tokenizer_strings
    for fallback, decode in [
        ("latin1", lambda b: b.decode("latin-1")),
        ("replace", lambda b: b.decode("utf-8", errors="replace")),
    ]:
        other_bytes, strs = decode_vocab(tokenizer, byte2str_fallback=fallback)
        assert list(map(bytes, other_bytes)) == list(map(bytes, byte_vocab))
        assert [strs[i] for i in invalid_ids] == [decode(token) for token in invalid]
        invalid_set = set(invalid_ids)
        assert all(text == default_strs[i] for i, text in enumerate(strs) if i not in invalid_set)


def test_known_tokens():
    """A few tokens whose bytes are known by hand."""
    gpt2 = AutoTokenizer.from_pretrained(assets.tokenizer("gpt-2", fetch=False))
    byte_vocab, _ = decode_vocab(gpt2)
    assert byte_vocab[gpt2.convert_tokens_to_ids("Ġworld")] == b" world"
    assert byte_vocab[gpt2.convert_tokens_to_ids("Ċ")] == b"\n"
    assert byte_vocab[gpt2.convert_tokens_to_ids("âĢ")] == b"\xe2\x80"
    assert byte_vocab[50256] == b"<|endoftext|>"
    llama = AutoTokenizer.from_pretrained(assets.tokenizer("llama-spm", fetch=False))
    byte_vocab, str_vocab = decode_vocab(llama)
    assert byte_vocab[llama.convert_tokens_to_ids("▁Hello")] == b" Hello"
    assert byte_vocab[llama.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert byte_vocab[llama.convert_tokens_to_ids("<0xE2>")] == b"\xe2"
    assert str_vocab[llama.convert_tokens_to_ids("<0xE2>")] == "<0xE2>"
    assert byte_vocab[1] == b"<s>"


# The 0.3.x names of `genlm.backend.tokenization.vocab`: `get_byte_vocab` and `bytes_to_strs`.


def test_vocab_module_has_get_byte_vocab():
    assert vocab.get_byte_vocab is get_byte_vocab


def test_decode_vocab_calls_the_get_byte_vocab_of_its_module(monkeypatch, loaded):
    tokenizer, _, _ = loaded("gpt-2")
    calls = []

    def replaced(tokenizer):
        calls.append(tokenizer)
        return [b"x", b"\xe2\x80", b"caf\xc3\xa9"]

    monkeypatch.setattr(vocab, "get_byte_vocab", replaced)
    byte_vocab, str_vocab = decode_vocab(tokenizer)
    assert calls == [tokenizer]
    assert byte_vocab == [Token(0, b"x"), Token(1, b"\xe2\x80"), Token(2, b"caf\xc3\xa9")]
    assert [bytes(token) for token in byte_vocab] == [b"x", b"\xe2\x80", b"caf\xc3\xa9"]
    assert str_vocab == ["x", tokenizer.convert_ids_to_tokens(1), "café"]


def test_decode_vocab_says_what_it_could_not_decode(monkeypatch, loaded):
    tokenizer, _, _ = loaded("gpt-2")
    cause = ByteVocabError("Cannot decode vocabulary")

    def replaced(tokenizer):
        raise cause

    monkeypatch.setattr(vocab, "get_byte_vocab", replaced)
    with pytest.raises(ValueError, match="^Could not decode byte representation") as raised:
        decode_vocab(tokenizer)
    assert type(raised.value) is ByteVocabError
    assert "Cannot decode vocabulary" in str(raised.value)
    assert raised.value.__cause__ is cause


@pytest.mark.parametrize("name", assets.TOKENIZERS)
def test_bytes_to_strs_follows_each_fallback(name, loaded):
    tokenizer, _, _ = loaded(name)
    byte_vocab = get_byte_vocab(tokenizer)
    tokenizer_strings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    fallbacks = {
        "tokenizer": lambda token_id: tokenizer_strings[token_id],
        "latin1": lambda token_id: byte_vocab[token_id].decode("latin-1"),
        "replace": lambda token_id: byte_vocab[token_id].decode("utf-8", errors="replace"),
    }
    for fallback, decode_invalid in fallbacks.items():
        expected = []
        for token_id, token in enumerate(byte_vocab):
            try:
                expected.append(token.decode("utf-8"))
            except UnicodeDecodeError:
                expected.append(decode_invalid(token_id))
        assert bytes_to_strs(tokenizer, byte_vocab, fallback) == expected, fallback


def test_bytes_to_strs_by_hand(loaded):
    tokenizer, _, _ = loaded("llama-spm")
    byte_vocab = [b"<unk>", Token(1, b"\xe2"), b"caf\xc3\xa9", b"\xff\xfe"]
    assert bytes_to_strs(tokenizer, byte_vocab, "tokenizer") == ["<unk>", "<s>", "café", "<0x00>"]
    assert bytes_to_strs(tokenizer, byte_vocab, "latin1") == ["<unk>", "â", "café", "ÿþ"]
    replaced = bytes_to_strs(tokenizer, byte_vocab, "replace")
    assert replaced == ["<unk>", "\ufffd", "café", "\ufffd\ufffd"]
    assert bytes_to_strs(tokenizer, [], "tokenizer") == []
    for fallback in ["strict", "latin-1", None]:
        with pytest.raises(ValueError, match="byte2str_fallback"):
            bytes_to_strs(tokenizer, byte_vocab, fallback)


# In-memory tokenizers: decoder steps and failure modes the ten real tokenizers do not reach.


def _wrap(backend):
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _agrees_with_own_decoder(tokenizer):
    byte_vocab, _ = decode_vocab(tokenizer)
    _, decoded = _anchored_decode(tokenizer, [[i] for i in range(len(tokenizer))])
    return [token.decode() for token in byte_vocab] == decoded


def test_metaspace_unigram_tokenizer():
    pieces = [("<unk>", 0.0), ("a", -1.0), ("▁hello", -2.0), ("▁", -3.0), ("wor▁ld", -4.0)]
    backend = Tokenizer(models.Unigram(pieces, unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = _wrap(backend)
    assert _agrees_with_own_decoder(tokenizer)
    byte_vocab, _ = decode_vocab(tokenizer)
    assert byte_vocab[2] == b" hello" and byte_vocab[4] == b"wor ld"


def test_per_token_strip_and_regex_replace():
    vocab = {"a": 0, "xxab": 1, "__c": 2, "xd_": 3, "<0x41>": 4}
    backend = Tokenizer(models.BPE(vocab, [], unk_token=None))
    backend.decoder = decoders.Sequence(
        [decoders.Replace(Regex("_+"), " "), decoders.Strip("x", 1, 0)]
    )
    tokenizer = _wrap(backend)
    assert _agrees_with_own_decoder(tokenizer)
    byte_vocab, _ = decode_vocab(tokenizer)
    assert byte_vocab[1] == b"xab" and byte_vocab[2] == b" c" and byte_vocab[4] == b"<0x41>"


def test_id_without_a_token_decodes_to_nothing():
    # The model knows ids 0 and 2 only; the tokenizer's length counts two ids, so id 1 is a
    # hole, which the tokenizer's own decoder also turns into no text.
    backend = Tokenizer(models.BPE({"a": 0, "c": 2}, []))
    backend.decoder = decoders.ByteLevel()
    tokenizer = _wrap(backend)
    byte_vocab, str_vocab = decode_vocab(tokenizer)
    assert [(token.token_id, bytes(token)) for token in byte_vocab] == [(0, b"a"), (1, b"")]
    assert str_vocab == ["a", ""]
    assert backend.decode([1]) == ""


def test_garbage_collector_state_is_restored(loaded):
    tokenizer, _, _ = loaded("gpt-2")
    decode_vocab(tokenizer)
    assert gc.isenabled()
    gc.disable()
    try:
        decode_vocab(tokenizer)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_wrong_arguments_raise():
    vocab = {"[UNK]": 0, "hello": 1, "##lo": 2}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    undecodable = r"^Could not decode byte representation of any of the 3 tokens .*WordPiece"
    with pytest.raises(ByteDecoderError, match=undecodable):
        decode_vocab(_wrap(wordpiece))
    no_decoder = Tokenizer(models.BPE({"a": 0}, []))
    with pytest.raises(ByteDecoderError, match="^Could not decode byte representation.*decoder"):
        decode_vocab(_wrap(no_decoder))
    for not_a_tokenizer in [object(), "gpt2", None]:
        with pytest.raises(ByteDecoderError, match="^Could not decode byte representation"):
            decode_vocab(not_a_tokenizer)
    assert issubclass(ByteDecoderError, ValueError)
    byte_level = Tokenizer(models.BPE({"a": 0}, []))
    byte_level.decoder = decoders.ByteLevel()
    for fallback in ["strict", "latin-1", None, 1]:
        with pytest.raises(ValueError, match="byte2str_fallback"):
            decode_vocab(_wrap(byte_level), byte2str_fallback=fallback)


# The byte-level helpers, against the `tokenizers` library's own ByteLevel pieces.


def test_byte_table_matches_the_byte_level_alphabet():
    table = byte_to_unicode()
    assert sorted(table) == list(range(256))
    assert sorted(table.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for byte in range(128):
        [(spelled, _)] = spell.pre_tokenize_str(chr(byte))
        assert table[byte] == spelled
    assert {char: byte for byte, char in table.items()} == unicode_to_byte()


def test_byte_level_to_bytes_matches_the_byte_level_decoder():
    spelled = ["Hello", "Ġworld", "âĢ", "", "Ċ", "<｜begin▁of▁sentence｜>", "a b", "ü", "ĀĠ\u00ad"]
    decoder = decoders.ByteLevel()
    for text, decoded in zip(spelled, byte_level_to_bytes(spelled), strict=True):
        assert decoded.decode("utf-8", errors="replace") == decoder.decode([text])
    assert byte_level_to_bytes(["ĀĠ\u00ad"]) == ["ĀĠ\u00ad".encode()]
    assert byte_level_to_bytes(["Āÿ"]) == [b"\x00\xff"]
