"""Suite-wide fixtures."""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test module ends. XLA:CPU maps each executable's code into its own memory
    regions; one process compiling the whole suite's programs (several thousand) reached the kernel's map limit
    (vm.max_map_count, 65,530) near the 600th test, and the next compilation died with a segmentation fault."""
    yield
    jax.clear_caches()
    gc.collect()
