"""Type names for grpc's asyncio server objects, which its stubs leave generic."""

from __future__ import annotations

from typing import Any, TypeAlias

import grpc

#: The context every asyncio handler of the stack receives.
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
#: A method handler as the server's interceptors and generic handlers see it.
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

__all__ = ["Context", "Handler", "grpc"]
