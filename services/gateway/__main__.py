"""`python -m services.gateway [flags]`: run the public gateway (see services/gateway/config.py)."""

import sys

from services.gateway.server import main

if __name__ == "__main__":
    sys.exit(main())
