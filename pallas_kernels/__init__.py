"""Pallas kernels for dspec: one package per op."""
