import sys

from services.verifier.server import main

sys.exit(main())
