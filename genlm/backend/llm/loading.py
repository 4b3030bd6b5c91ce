"""Placeholder: being written."""


def load_model_by_name(name, backend=None, llm_opts=None):
    raise NotImplementedError
