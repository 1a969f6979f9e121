"""What runs as a process: the vLLM engine server, the routing proxy and their launchers."""
