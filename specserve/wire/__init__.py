"""Protobuf <-> domain types, for every contract, in one place.

* :mod:`~specserve.wire.common_wire`: what every service shares (session ids, token
  ranges, sampling parameters, drafter kinds, the per-session token limit, load reports);
* :mod:`~specserve.wire.draft_wire`: ``draft.proto``, the servicer's and the caller's end;
* :mod:`~specserve.wire.target_wire`: ``target.proto``, both ends;
* :mod:`~specserve.wire.sparse_q`: a draft's sparse q, packed and checked;
* :mod:`~specserve.wire.public_wire`: ``generate.proto`` <-> the orchestrator's
  request types.

Nothing below a servicer sees a pb object. Only ``public_wire`` imports from the
orchestrator (its request types); the others import the engine and the generated
code alone, so a draft or target server never loads the orchestrator.
"""
