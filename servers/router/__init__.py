"""The router: one address in front of many engine servers.

``server`` (process, options, health), ``proxy`` (the one forwarding path for every DataPlane
call), ``backends`` (membership, health watches and load; where a call goes is asked of
``skyrl_grpc.placement``, shared with the trainer client's direct routing), ``migration``
(streams that outlive their server), ``feed`` (RouterAdmin's routing feed for direct
clients), ``admin`` (RouterAdmin), ``metrics`` (Prometheus) and ``http_edge`` (the
OpenAI-compatible HTTP API over the same proxy). Never imports ``servers.engine``.
"""
