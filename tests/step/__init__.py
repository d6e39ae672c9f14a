"""Tests of fzero._step: steps end to end, accumulation, clipping, uneven work, errors."""
