"""Placeholder: being written."""


class TokenCharacterTrie:
    pass
