"""The router: one address in front of many engine servers.

``server`` (process, options, health), ``proxy`` (the one forwarding path), ``backends``
(membership, health watches and where routing is decided), ``hash_ring`` and ``balancer``
(the placement rules), ``migration`` (streams that outlive their server), ``admin``
(RouterAdmin) and ``metrics``. Never imports ``servers.engine``.
"""
