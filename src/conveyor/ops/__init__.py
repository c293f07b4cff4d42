"""Operators built on Conveyor: grouped matmul (gmm, tgmm)."""
