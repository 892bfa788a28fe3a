import sys

from specinfer.engine.runtime.cpu import configure_cpu_runtime

configure_cpu_runtime()  # before torch loads OpenMP

from services.verifier.server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
