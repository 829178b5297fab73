"""KV snapshots: saving a session's target KV to Redis in chunks and restoring it on failover."""
