"""Maintainer tools: mutation testing (mutation, mutation_worker, mutation_hook), the GPU check,
the bf16 noise measurement, the loader of overlay files from this checkout and the Triton
interpreter as a CPU driver (the torch kernels' oracle)."""
