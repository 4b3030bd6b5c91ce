"""`decode_vocab` on a tokenizer (qwen2: 151,936 tokens). Floor: the per-token decode, each token's
string mapped through the GPT-2 byte table (added tokens: their UTF-8); both checked identical."""

import argparse
from typing import Any

from benchmarks.core import Figure, median_ms, record

OPTIONS = {"name": ("qwen2", "a byte-level BPE tokenizer of the assets"), "repeats": 5}


def reference_decode_vocab(tokenizer: Any) -> tuple[list, list[str]]:
    """Per-token decoding of a byte-level BPE vocabulary (the obvious version)."""
    from genlm.backend.tokenization import Token
    from genlm.backend.tokenization.bytes import unicode_to_byte

    table, added = unicode_to_byte(), tokenizer.added_tokens_decoder
    byte_vocab, str_vocab = [], []
    for token_id in range(len(tokenizer)):
        string = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in added:
            data = added[token_id].content.encode()
        elif all(char in table for char in string):
            data = bytes(table[char] for char in string)
        else:
            data = string.encode()
        byte_vocab.append(Token(token_id, data))
        try:
            str_vocab.append(data.decode())
        except UnicodeDecodeError:
            str_vocab.append(string)
    return byte_vocab, str_vocab


def run(args: argparse.Namespace) -> None:
    """Check, time and record `decode_vocab` against the floor."""
    from transformers import AutoTokenizer

    from genlm.backend import assets
    from genlm.backend.tokenization import decode_vocab

    tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer(args.name))
    ours, floor = decode_vocab(tokenizer), reference_decode_vocab(tokenizer)
    assert [(t.token_id, bytes(t)) for t in ours[0]] == [(t.token_id, bytes(t)) for t in floor[0]]
    assert ours[1] == floor[1]
    wall, cpu = median_ms(lambda: decode_vocab(tokenizer), args.repeats)
    floor_wall, floor_cpu = median_ms(lambda: reference_decode_vocab(tokenizer), args.repeats)
    label = f"`decode_vocab`, {args.name} ({len(tokenizer):,} tokens)"
    notes = {"CPU s": cpu / 1e3, "floor CPU s": floor_cpu / 1e3}
    seconds = wall / 1e3, floor_wall / 1e3
    record(Figure(f"decode_vocab/{args.name}", label, "s", *seconds, target="≤ 0.6 s", notes=notes))
