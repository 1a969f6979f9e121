"""The weights a server serves and how they change: ``serving`` (the serving version, the
prefix-cache namespace, reads for peers), ``transaction`` (one update's lifecycle: start,
stage, commit or cancel, rollback) and ``staging`` (its buffers on the way to vLLM's workers).
What an update carries and the checks on it: ``servers.engine.transfer``."""
