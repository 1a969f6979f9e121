"""What the engine server and its vLLM workers both speak about a weight update: ``specs`` (what
an update carries, as plain values), ``assembly`` (the checks on it: CRC, SHA-256, shapes),
``finite``, ``protocol`` (the calls between server and workers) and ``handoff`` (shared-memory
buffers between them). Plain Python: no protobuf."""
