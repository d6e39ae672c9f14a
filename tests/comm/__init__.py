"""Tests of fzero._comm: the ledger's volumes and int8 quantization."""
