"""Benchmarks: the scaling matrix (`dptrain bench`), emulated slow networks, synthetic throughput,
the alpha-beta projection (`dptrain simulate`) and their plots."""
