"""Pallas kernels for paged attention over a device-resident block array, each with a pure-jnp reference."""
