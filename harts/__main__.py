import sys

from harts.cli.main import main

# guarded: worker processes started by spawn (harts.dist.runner.launch) import this module
if __name__ == "__main__":
    sys.exit(main())
