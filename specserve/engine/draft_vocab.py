"""A draft model's LM head over the tokens it is likely to propose (a reduced draft vocabulary).

A draft step streams every weight once, and a small draft's LM head is a large share
of them: Qwen2.5-0.5B's [151936, 896] Q8_0 head is 145 MB of ~400 MB read per step
(4.1 ms of a 16 ms step on 2 AVX2 cores). Scoring only the ``size`` most frequent
tokens (FR-Spec, Zhao et al. 2025; EAGLE-3's draft vocabulary) reads 32768 of those
rows. The draft then never proposes the other tokens: where the target's next token is
one of them, that draft is rejected, as any wrong guess. **Exactness does not depend
on it**: the target judges every draft with its full vocabulary, and the drafter's
distribution q is exactly the one it drew from (zero outside the kept tokens), so
sampled acceptance stays exact (:mod:`specserve.engine.rejection`).

Which tokens: every special token (end of turn, chat markers), then the most frequent
tokens of a code-and-docstring corpus every Python installation carries (a fixed,
evenly spaced sample of the standard library's sources), then the lowest ids (BPE
assigns them to the earliest, most frequent merges) until ``size``. Measured with the
Qwen2.5 tokenizer (32768 tokens): 98% of held-out standard-library code tokens and
92% of the tokens of Markdown documentation; docs/exactness.md says what it costs in
acceptance. A vocabulary of ``size`` or fewer tokens is not reduced.
"""

from __future__ import annotations

import collections
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.engine.model import CausalLM
from specserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_DRAFT_VOCAB = 32768  # tokens a draft model's head scores; 0 = all
CORPUS_FILES = 200  # standard-library sources counted (~1 s with a fast tokenizer)


def corpus_files(count: int = CORPUS_FILES) -> list[Path]:
    """``count`` of this Python's standard-library sources, evenly spaced over them
    sorted by path (the same files for the same Python); none where it ships none."""
    root = sysconfig.get_paths().get("stdlib")
    files = sorted(Path(root).rglob("*.py")) if root else []
    if len(files) <= count:
        return files
    step = len(files) / count
    return [files[int(i * step)] for i in range(count)]


def draft_vocabulary(tokenizer: Tokenizer, size: int, vocab: int) -> list[int] | None:
    """The ``size`` token ids (ascending, all ``< vocab``) a draft head keeps, or ``None``
    where nothing is cut (``size <= 0`` or ``vocab <= size``): special tokens, then the
    corpus's most frequent, then the lowest ids."""
    if size <= 0 or vocab <= size:
        return None
    counts: collections.Counter[int] = collections.Counter()
    for path in corpus_files():
        try:
            counts.update(tokenizer.encode(path.read_text(errors="ignore")))
        except OSError:
            continue
    kept = {i for i in tokenizer.special_tokens() if i < vocab}
    kept |= set(tokenizer.eos_token_ids) & set(range(vocab))
    for token, _ in counts.most_common():
        if len(kept) >= size:
            break
        if token < vocab:
            kept.add(token)
    low = 0
    while len(kept) < size:
        kept.add(low)
        low += 1
    return sorted(kept)[:size]  # (more only where the special tokens alone exceed size)


def reduce_draft_head(model: CausalLM, tokenizer: Tokenizer | None, size: int, vocab: int) -> int:
    """Keep ``size`` tokens in ``model``'s LM head (:func:`draft_vocabulary`,
    :meth:`CausalLM.restrict_head`); returns the tokens it scores (``vocab`` where
    nothing was cut: no tokenizer, a small vocabulary, or ``size`` 0)."""
    ids = None if tokenizer is None else draft_vocabulary(tokenizer, size, vocab)
    if ids is None:
        return vocab
    model.restrict_head(ids)
    log.info("draft head scores %d of %d tokens (--draft-vocab)", len(ids), vocab)
    return len(ids)


@dataclass(frozen=True)
class KeptIds:
    """A restricted head's ids as a greedy draft step reads them (the head's scores of
    just these, :meth:`CausalLM.forward <specserve.engine.model.CausalLM.forward>`'s
    ``kept_only``): ``ids`` below the drafter's vocabulary limit, ascending, so the first
    of tied maxima is the full row's argmax; ``columns``, their columns in the scores
    (None: all)."""

    ids: torch.Tensor
    columns: torch.Tensor | None


def kept_ids(head_ids: torch.Tensor | None, vocab_limit: int | None) -> KeptIds | None:
    """``head_ids`` (ascending; None: no restricted head, and None back) as a drafter
    limited to ids below ``vocab_limit`` reads them."""
    if head_ids is None:
        return None
    columns = None
    if vocab_limit is not None and int(head_ids[-1]) >= vocab_limit:
        columns = (head_ids < vocab_limit).nonzero().view(-1)
    return KeptIds(head_ids if columns is None else head_ids[columns], columns)
