"""The gRPC services Serve's gRPC proxy takes calls for (its `grpc_options.grpc_servicer_functions`), answered by the
ingress's entry points (service/rpc/serve_proxy.py). Imports no Ray: the launcher reads it before Ray starts."""

SERVE_SERVICERS = [
    "contract.rpc.inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server",
    "contract.rpc.generation_pb2_grpc.add_GenerationServiceServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
