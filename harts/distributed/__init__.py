"""Distributed execution on torch.distributed: the mesh and launch checks (`mesh`), the
parallelisms as `apply_*` functions composed in `parallelize` (the one entry point;
pipeline stages from `pipeline`), the distributed step (`runner`, whose
`distributed_trainer` builds it or the pipeline's trainer of `pipeline_step`) and
checkpoints (`checkpoint`). Above harts/exec, below harts/verify and harts/train."""
