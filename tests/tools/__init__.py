"""Tests of fzero._tools: the command line, the demo, fzero.testing, simulate."""
