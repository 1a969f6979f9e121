"""The engine server: DataPlane and ControlPlane over one vLLM engine, in folders by layer and
by process (docs/architecture.md): ``process/`` (the server process and the one builder),
``service/`` (servicers and their converters: protobuf stops there), ``peers/`` (catch-up from
a peer), ``domain/`` (plain Python), ``vllm_adapter/`` (every call into vLLM), ``worker/``
(code that runs inside vLLM's worker processes) and ``transfer/`` (what server and workers both
speak about a weight update); ``options`` holds the settings. Never imports ``servers.router``.
"""
