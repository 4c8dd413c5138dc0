"""Slow tests (soak runs, long benchmarks) are opt-in: `pytest --runslow`."""
import subprocess

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


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)`` mounts a tmpfs of ``size`` (mount's syntax: "64k") and returns its path; unmounted
    after the test; skipped where mounting needs a root the run does not have."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()

    def make(size: str):
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        return mount

    yield make
    subprocess.run(["umount", str(mount)], capture_output=True)
