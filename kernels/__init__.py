"""Pallas / jax-triton / TE-JAX kernels, installed as `triage_jax.kernels` and registered as quant backends."""
