from hisparse_jax.entrypoints.cli.main import run

if __name__ == "__main__":
  run()
