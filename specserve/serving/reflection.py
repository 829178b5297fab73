"""Server reflection under both names clients ask for: ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection ships only the v1alpha service, while current tools (grpcurl,
Postman, grpc-js's reflection clients) ask for ``grpc.reflection.v1`` first. The two
protos are the same messages under two package names (identical field numbers), so
one servicer answers both: v1 is registered as a generic handler that reads and
writes the v1alpha message classes, which are byte-for-byte the v1 wire format.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import grpc.aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1_METHOD = f"/{V1_SERVICE_NAME}/ServerReflectionInfo"


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection (v1 and v1alpha) over ``service_names`` plus the reflection services."""
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1}),)
    )
