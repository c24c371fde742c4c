import sys

from harts.cli.main import main

sys.exit(main())
