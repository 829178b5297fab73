"""The distributed round: the runner, replica calls, failover, warm-ups, the ledger, spans."""
