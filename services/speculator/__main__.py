import sys

from services.speculator.server import main

if __name__ == "__main__":
    sys.exit(main())
