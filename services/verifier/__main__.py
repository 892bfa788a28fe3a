import sys

from services.verifier.server import main

if __name__ == "__main__":
    sys.exit(main())
