import sys

from sparsebalance.cli import main

sys.exit(main())
