"""The target service: verifies drafts with the large model in one batched forward."""
