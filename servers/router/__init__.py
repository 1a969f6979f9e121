"""The router: one address in front of many engine servers.

``server`` (process, options, health), ``proxy`` (the one forwarding path), ``placement``
(where routing is decided, over ``hash_ring`` and ``balancer``), ``backends`` (membership and
health watches), ``migration`` (streams that outlive their server), ``admin`` (RouterAdmin)
and ``metrics``. Never imports ``servers.engine``.
"""
