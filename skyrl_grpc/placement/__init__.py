"""Placement: where a call goes, shared by the router and clients that route themselves.

``policy`` (the policies), ``sessions`` (where live sessions are, as servers report them),
``hash_ring`` and ``balancer`` (their building blocks). Pure: no network.
"""

from .policy import (
    POLICIES,
    BoundedLoadPolicy,
    Candidate,
    ConsistentHashPolicy,
    PlacementPolicy,
    make_policy,
)
from .session_directory import SessionDirectory

__all__ = [
    "POLICIES",
    "BoundedLoadPolicy",
    "Candidate",
    "ConsistentHashPolicy",
    "PlacementPolicy",
    "SessionDirectory",
    "make_policy",
]
