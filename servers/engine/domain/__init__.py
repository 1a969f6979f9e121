"""The engine server's domain, plain Python (no protobuf, no vLLM): ``admission`` (how many
samples run and wait), ``live_sessions``, ``pausing``, ``descriptions`` (what the server and its
model are), ``chat_parsing`` (tool calls and reasoning by vLLM's parsers, as plain values),
``lora_adapters`` and ``weights`` (the serving weights and the update transaction)."""
