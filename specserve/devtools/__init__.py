"""Helpers the tests and benchmarks share: free loopback ports, a throwaway redis-server."""
