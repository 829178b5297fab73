"""The public gRPC API: the servicer, admission, API keys, text, request spans and stats."""
