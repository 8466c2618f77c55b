import os

import pytest
import torch

# Two cores on CI: one thread per test process keeps runs predictable.
TEST_THREADS = int(os.environ.get("DRAFTHEADS_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(autouse=True)
def _restore_threads():
    """CLI entry points under test set their own thread count; put it back so later tests stay predictable."""
    yield
    torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def tiny_target():
    """A tiny random Llama (6 layers, hidden 64) with the in-memory byte tokenizer; no downloads."""
    from models.target import Target, tiny_random_llama

    model, tok = tiny_random_llama(num_layers=6)
    return Target(model, tok, "tiny-random-llama")


@pytest.fixture(scope="session")
def smollm2():
    """The real default target (slow tests only)."""
    from models.target import load_target

    return load_target()
