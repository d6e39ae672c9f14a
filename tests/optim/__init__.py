"""Tests of fzero.optim: bitwise agreement with torch.optim."""
