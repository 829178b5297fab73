"""Loading a server's model from its spec: a store name, a directory, a GGUF file or ``tiny:...``.

Runs on the model executor's thread (loading takes seconds to minutes while the
server already answers health with NOT_SERVING).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.model import DEFAULT_PREFILL_CHUNK_TOKENS, CausalLM
from specserve.serving.faults import fail_after_forwards


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    vocab: int  # ids the tokenizer can produce (embedding matrices are often padded past it)


def load_model(
    spec: str,
    dtype: str,
    *,
    fail_after: int | None = None,
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
) -> LoadedModel:
    """Load ``spec`` in ``dtype``; ``fail_after`` arms a simulated device failure (tests);
    ``prefill_chunk_tokens`` (0: off) is :attr:`CausalLM.prefill_chunk_tokens`."""
    from specserve.local import load  # tiny specs, the model store and the loader in one place

    model, tokenizer = load(spec, dtype)
    model.prefill_chunk_tokens = prefill_chunk_tokens or None
    vocab = model.config.vocab_size
    if tokenizer is not None:
        vocab = min(vocab, int(tokenizer.vocab_size))  # type: ignore[attr-defined]
    if fail_after is not None:
        fail_after_forwards(model, fail_after)
    return LoadedModel(model, vocab)


def load_weights(spec: str, dtype: str, fail_after: int | None = None) -> CausalLM:
    """The model of ``spec`` alone, no tokenizer: what every tensor-parallel rank builds.

    Weights stay on normal pages: a rank keeps only its shard, which moves onto huge
    pages after sharding (one mapping for the whole model would outlive the shards).
    Module level so that ``functools.partial(load_weights, spec, dtype)`` pickles
    (Ray sends it to the rank actors).
    """
    from specserve.engine.loader import DTYPES, load_model, prepare
    from specserve.engine.tiny import tiny_from_spec
    from specserve.model_store import resolve

    if spec.startswith("tiny:"):
        model = prepare(tiny_from_spec(spec).to(DTYPES[dtype]), huge_pages=False)
    else:
        model, _ = load_model(resolve(spec), DTYPES[dtype], huge_pages=False)
    if fail_after is not None:
        fail_after_forwards(model, fail_after)
    return model


def tokenizer_vocab(spec: str) -> int | None:
    """Ids the tokenizer of ``spec`` can produce, capped at the model's vocabulary, read
    without loading weights; None where the model's vocabulary is the limit (tiny models)."""
    if spec.startswith("tiny:"):
        return None
    from specserve.engine.loader import load_tokenizer, read_config, resolve_source
    from specserve.model_store import resolve

    directory = resolve_source(str(resolve(spec)))
    return min(read_config(directory).vocab_size, int(load_tokenizer(directory).vocab_size))
