import os
import sys

from harts.cli.main import main

# guarded: worker processes started by spawn (harts.dist.runner.launch) import this module
if __name__ == "__main__":
    rc = main()
    dist = sys.modules.get("torch.distributed")  # never imported: no process group, no gloo threads
    if dist is not None and dist.is_torchelastic_launched():
        # A torchrun worker ends here without interpreter finalization. Its process group
        # is destroyed by then, but a gloo worker thread may still be releasing the last
        # collective's tensors; when that needs the GIL after finalization has begun,
        # Python ends the thread with pthread_exit, whose unwinding through a noexcept C++
        # frame aborts the process ("terminate called without an active exception", exit
        # -6) after the run itself succeeded. Everything the command wrote is closed;
        # only the standard streams need flushing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
