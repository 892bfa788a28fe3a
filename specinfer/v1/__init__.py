"""Generated gRPC stubs for the specinfer.v1 wire contract live here (see specinfer_build.py)."""
