"""Maintainer tools: mutation testing (mutation, mutation_worker, mutation_hook), the GPU check,
the bf16 noise measurement and the loader of overlay files from this checkout."""
