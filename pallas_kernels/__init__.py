"""Pallas kernels for jllm, each shipped as a kit: kernel, reference, validation, cache shape."""
