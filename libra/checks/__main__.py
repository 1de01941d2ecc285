import sys

from libra.checks.runner import main

sys.exit(main())
