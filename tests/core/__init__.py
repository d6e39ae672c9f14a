"""Tests of fzero._core: layouts and units, without communication."""
