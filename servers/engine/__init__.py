"""The engine server: DataPlane and ControlPlane over one vLLM engine.

``server`` (process and lifecycle), ``options`` (flags), ``data_plane`` / ``control_plane``
(thin servicers), ``validate`` (every request check), ``convert`` (protobuf <-> vLLM),
``vllm_engine`` (the vLLM adapter), ``serving_state``, and ``weights/`` (the update transaction,
in-band assembly, the worker extension and the protocol between them). Never imports
``servers.router``.
"""
