"""Distributed execution on torch.distributed: the mesh and launch checks (`mesh`), the
parallelisms as `apply_*` functions composed in `parallelize` (pipeline stages from
`pipeline`), the distributed step (`runner`) and checkpoints (`checkpoint`). Above
harts/exec, below harts/verify."""
