"""Loading a server's model from its spec: a store name, a directory, a GGUF file or ``tiny:...``.

Every path goes through the engine's loader (:func:`specserve.engine.loader.load_spec`)
with the model store's :func:`~specserve.model_store.locate`. Runs on the model
executor's thread (loading takes seconds to minutes while the server already answers
health with NOT_SERVING).
"""

from __future__ import annotations

from specserve import model_store
from specserve.engine.loader import LoadedModel, load_spec, load_spec_tokenizer
from specserve.engine.model import DEFAULT_PREFILL_CHUNK_TOKENS, CausalLM
from specserve.engine.model_spec import ModelSpec
from specserve.serving.faults import fail_after_forwards

__all__ = ["LoadedModel", "load_model", "load_weights", "tokenizer_vocab"]


def load_model(
    spec: str,
    dtype: str,
    *,
    device: str = "cpu",
    fail_after: int | None = None,
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
) -> LoadedModel:
    """Load ``spec`` in ``dtype`` onto ``device`` (a name engine.devices checked);
    ``fail_after`` arms a simulated device failure (tests); ``prefill_chunk_tokens``
    (0: off) is :attr:`CausalLM.prefill_chunk_tokens`."""
    loaded = load_spec(spec, dtype, locate=model_store.locate, device=device)
    loaded.model.prefill_chunk_tokens = prefill_chunk_tokens or None
    if fail_after is not None:
        fail_after_forwards(loaded.model, fail_after)
    return loaded


def load_weights(spec: str, dtype: str, fail_after: int | None = None) -> CausalLM:
    """The model of ``spec`` alone, no tokenizer: what every tensor-parallel rank builds.

    Weights stay on normal pages: a rank keeps only its shard, which moves onto huge
    pages after sharding (one mapping for the whole model would outlive the shards).
    Module level so that ``functools.partial(load_weights, spec, dtype)`` pickles
    (Ray sends it to the rank actors).
    """
    loaded = load_spec(spec, dtype, locate=model_store.locate, huge_pages=False, tokenizer=False)
    if fail_after is not None:
        fail_after_forwards(loaded.model, fail_after)
    return loaded.model


def tokenizer_vocab(spec: str) -> int | None:
    """Ids the tokenizer of ``spec`` can produce, capped at the model's vocabulary, read
    without loading weights; None where the model's vocabulary is the limit (tiny models)."""
    tokenizer = load_spec_tokenizer(spec, locate=model_store.locate)
    if tokenizer is None:
        return None
    from specserve.engine.loader import read_config

    source = ModelSpec.parse(spec).source
    return min(read_config(model_store.locate(source)).vocab_size, tokenizer.vocab_size)
