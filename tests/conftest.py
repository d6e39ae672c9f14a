"""Test configuration: hypothesis profiles and the test directory on sys.path."""

import os

import torch
from hypothesis import HealthCheck, settings

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
