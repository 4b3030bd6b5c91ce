"""Placeholder: being written."""


class AsyncVirtualLM:
    pass


class GlobalLogprobsCapture:
    pass
