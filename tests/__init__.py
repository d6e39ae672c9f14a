"""fzero's tests: one folder per package area, end-to-end apart (docs/testing.md)."""
