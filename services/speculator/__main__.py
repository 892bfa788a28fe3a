import sys

from services.speculator.server import main

sys.exit(main())
