import sys

from kvmem.cli import main

sys.exit(main())
