"""End-to-end tests: every stage against one process, real gloo, torchrun, devices, notebooks."""
