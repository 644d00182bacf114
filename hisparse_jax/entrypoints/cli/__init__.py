"""The `hisparse-jax` command line (see main.py). Kept import-free so that `--help` and
flag errors never load jax."""
