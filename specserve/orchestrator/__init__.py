"""The orchestrator: public gRPC API, session store, scheduler and the distributed round loop."""
