"""The replicas and placement: replica pools, the scheduler that places sessions, stalls."""
