"""The Hydra config tree (a package, so that Hydra finds it by module as well as by path)."""
