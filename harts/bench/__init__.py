"""Benchmarks of the execution layer (the library behind `harts bench` and the GPU suites
under benchmarks/): `step` (update-step timings, tree against its baselines, with the
ideal speedup), `ops` (per-op timings: KDA, tree attention, GEMMs), `memory` (the planned
peak memory of a step), `timing` (CUDA-event timing, prefetched steps) and `provenance`
(where a result comes from). Above harts.exec and harts.sim; only the CLI and the
experiments import it."""
