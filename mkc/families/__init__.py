"""The shipped model families, one subpackage each. `mkc.model.registry` finds them (and any
installed package that declares an `mkc.families` entry point); nothing else names them."""
