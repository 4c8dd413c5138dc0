"""Slow tests (soak runs, long benchmarks) are opt-in: `pytest --runslow`."""
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def float64_default():
    """Build tensors in fp64 for the test (exactness checks at atol 1e-10), then restore the default."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(scope="session")
def lightning_reference():
    """``tests.helpers.run_reference``, trained once a session per set of arguments: the plain-Lightning runs
    that several tests compare greedysnake against. Callers read the returned states, never modify them."""
    from tests.helpers import run_reference

    cache = {}

    def get(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in cache:
            cache[key] = run_reference(*args, **kwargs)
        return cache[key]

    return get
