"""skyrl-grpc's contract package: the generated stubs (``skyrl_grpc.v1``) and the small pieces
every side of the stack shares (metadata keys, status mapping, dtype names, the tiny model)."""

__version__ = "0.1.0"
