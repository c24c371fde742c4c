"""Distributed execution on torch.distributed: the mesh and launch checks (`mesh`), the
parallelisms as `apply_*` functions composed in `parallelize`, and the distributed step
(`runner`). Above harts/exec, below harts/verify."""
