"""Session state in Redis: the store, its scripts and retries, records, keys, leases."""
