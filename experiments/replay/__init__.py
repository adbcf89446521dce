"""Agent trajectories and their replay against the embedded engine or over HTTP, shared by the benchmarks."""
