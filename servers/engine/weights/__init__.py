"""Weight updates on an engine server: ``specs`` (what an update carries, as plain values),
``assembly`` (checking it against the model), ``transaction`` (the update's lifecycle, version
and rollback), ``serving`` (the weights a server serves: version, prefix-cache namespace),
``protocol`` (the calls to vLLM's workers) and, inside those workers, ``worker`` and
``transfer_engine``."""
