"""The distributed round: the runner, replica calls, draft-ahead, bets, the ledger, spans."""
