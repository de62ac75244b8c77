import sys

from sparrow.cli import main

sys.exit(main())
