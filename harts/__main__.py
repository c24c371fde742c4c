import sys

from harts.cli.main import main

# guarded: worker processes started by spawn (harts.distributed.runner.launch) import this module
if __name__ == "__main__":
    rc = main()
    dist = sys.modules.get("torch.distributed")  # never imported: no process group, no gloo threads
    if dist is not None and dist.is_torchelastic_launched():
        from harts.distributed.teardown import exit_without_finalization  # why: its docstring

        exit_without_finalization(rc)
    sys.exit(rc)
