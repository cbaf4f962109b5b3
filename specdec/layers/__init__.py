"""Attention backends and the C++ CPU kernels (csrc/) with their loader."""
