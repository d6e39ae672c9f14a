"""The benchmark scripts, run small so they cannot rot."""
