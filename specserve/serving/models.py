"""Loading a server's model from its spec: a store name, a directory, a GGUF file or ``tiny:...``.

Runs on the model executor's thread (loading takes seconds to minutes while the
server already answers health with NOT_SERVING).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.model import CausalLM
from specserve.serving.faults import fail_after_forwards


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    vocab: int  # ids the tokenizer can produce (embedding matrices are often padded past it)


def load_model(spec: str, dtype: str, *, fail_after: int | None = None) -> LoadedModel:
    """Load ``spec`` in ``dtype``; ``fail_after`` arms a simulated device failure (tests)."""
    from specserve.local import load  # tiny specs, the model store and the loader in one place

    model, tokenizer = load(spec, dtype)
    vocab = model.config.vocab_size
    if tokenizer is not None:
        vocab = min(vocab, int(tokenizer.vocab_size))  # type: ignore[attr-defined]
    if fail_after is not None:
        fail_after_forwards(model, fail_after)
    return LoadedModel(model, vocab)
