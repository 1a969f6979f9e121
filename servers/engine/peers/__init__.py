"""The engine server as a client of its peers: ``catch_up`` reads the fleet's current weights
and LoRA adapters from a peer before a restarted or added server serves."""
