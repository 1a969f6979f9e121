"""The engine server as a process: ``engine_server`` (listening, health, the engine's start,
catch-up, drain and shutdown), ``engine_parts`` (the one builder: the vLLM adapter, the domain
around it, and each servicer's parts), ``serving_state`` (starting, serving, draining) and
``scratch`` (the process's temporary directory)."""
