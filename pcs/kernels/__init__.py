"""Hand-written device kernels, each with the torch path it replaces beside it where the kernel is unavailable."""
