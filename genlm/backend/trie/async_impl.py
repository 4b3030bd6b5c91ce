"""Placeholder: being written."""


class AsyncTokenCharacterTrie:
    pass
