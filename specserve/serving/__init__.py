"""Plumbing shared by the gRPC servers: factory, error mapping, conversion, model executor."""
