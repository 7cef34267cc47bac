"""``convfirstnet export``: the command behind :mod:`convfirstnet.export` (pt2 and ONNX deployment files)."""

from convfirstnet.export import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
