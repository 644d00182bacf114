"""Pallas kernels for paged attention over a device-resident block array.

Each kernel file ends with its pure-jnp reference.
"""
