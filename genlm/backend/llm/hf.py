"""Placeholder: being written."""


class AsyncTransformer:
    pass


class Query:
    pass
