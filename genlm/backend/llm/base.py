"""Placeholder: being written."""


class AsyncLM:
    pass


class MockAsyncLM:
    pass
