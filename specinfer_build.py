"""Generates Python gRPC stubs from protos/ into the source tree (the one build step).

Run by setup.py on every install (editable or not), or by hand: `python specinfer_build.py`.
The proto package `specinfer.v1` maps onto the Python package `specinfer/v1/`.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def generate_stubs() -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted((ROOT / "protos").rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in protos:
        code = protoc.main([
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"-I{include}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(proto),
        ])
        if code != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    return protos


if __name__ == "__main__":
    for p in generate_stubs():
        print(f"generated stubs for {p.relative_to(ROOT)}")
