"""Generated protobuf and gRPC code for proto/specserve/v1 (scripts/gen-proto.sh); do not edit."""
