"""Tests of fzero.checkpoint: resharding, resume, crashes, exports."""
