"""What the families' pure-JAX references share: where a kernel rounds (`rounding`)."""
