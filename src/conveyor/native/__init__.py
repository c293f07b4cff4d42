"""Native CPU kernels, compiled on first use (see `build`)."""
