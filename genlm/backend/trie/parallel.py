"""Placeholder: being written."""


class ParallelTokenCharacterTrie:
    pass
