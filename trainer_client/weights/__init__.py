"""The trainer's weight path: ``weight_updates`` (the client's update calls: a fleet-wide
transaction, in-band or over the collective), ``update_plan`` (one update decided before a byte
moves), ``weight_transaction`` (all commit or none) over ``weight_calls`` (its per-server
calls), ``weight_delivery`` (how the bytes reach the servers), ``weight_sending`` (streams,
buckets, the collective's rank 0), ``push_lanes`` (each server's push socket) and
``delta_patches`` (what changed, as patches)."""
