"""Placeholder: being written."""


class OutputCache:
    pass
