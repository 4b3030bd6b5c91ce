"""pytest plugin for the GPU runbook (`-p scripts.gpu_test_plugin`): leaves out the tests that need
SmolLM2-135M's weights (the `smollm2_path` fixture), which do not travel to the GPU machine."""

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the items that use `smollm2_path`, and say how many."""
    kept = [item for item in items if "smollm2_path" not in getattr(item, "fixturenames", ())]
    left_out = [item for item in items if item not in kept]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        print(f"\ngpu_test_plugin: {len(left_out)} tests need SmolLM2's weights; left out")
    items[:] = kept
