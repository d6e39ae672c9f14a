"""Tests of fzero._state: deferred init, precision and loss scaling, frozen parameters."""
