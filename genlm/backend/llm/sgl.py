"""Placeholder: being written."""


class AsyncSGLTransformer:
    pass
