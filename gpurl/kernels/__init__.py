"""Compute kernels, each beside its pure-jnp reference."""
