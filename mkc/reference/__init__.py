"""Pure-JAX reference models: independent oracles for the kernels (they share no code with them)."""
