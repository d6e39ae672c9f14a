"""Test configuration: hypothesis profiles and the test directory on sys.path."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from fzero._tools._equivalence import _compile_here_once

# "ci" is what the README's test command runs: derandomized, so CI is repeatable.
# "dev" explores more: HYPOTHESIS_PROFILE=dev python -m pytest
settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The parent process stays single-threaded so forked simulated ranks never inherit a
# busy OpenMP pool; it also keeps two-core CI machines from oversubscribing.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _compile_warmed_before_forking(request: pytest.FixtureRequest) -> None:
    """Before the first test that forks ranks, this process compiles a trivial function.

    A process's first `torch.compile` spends about 2 s importing and setting up dynamo
    and AOTAutograd; forked ranks inherit that from their parent, so they no longer each
    pay it in every compiled test (a minute of the suite's time). It is what a parent that
    had already run a compiled one-process test gave its ranks anyway.
    """
    if request.node.get_closest_marker("multiprocess") is not None:
        _compile_here_once()  # fzero.testing's own, once a process
