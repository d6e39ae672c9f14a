"""Tests of fzero._engine: units, bursts, prefetch, resharding, the pool, remat, the primitives."""
