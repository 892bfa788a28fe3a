import sys

from specinfer.cli.main import main

sys.exit(main())
