"""kvlab.sim: cost-model executor and workload generators (no torch)."""
