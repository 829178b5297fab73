"""bench.common's number lists and ISA naming.

``parse_range`` reads prompt indices and row counts from the command line: numbers,
ranges and comma-separated mixes of both; ``range_list`` is its argparse form, where
an empty text is the empty list (a curve skipped) and anything else it refuses is a
usage error with the sentence. The ISA class and its words come from the CPU's flags.
"""

from __future__ import annotations

import argparse

import pytest

from bench.common import ISA_CLASSES, isa_class, isa_description, parse_range, range_list

SAPPHIRE_RAPIDS = (
    "fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni "
    "avx512_bf16 avx512_fp16 avx_vnni amx_bf16 amx_tile amx_int8"
)
ZEN4 = "fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16"
ZEN3 = "fpu sse2 avx avx2 fma f16c bmi2"
ALDER_LAKE = "fpu sse2 avx avx2 fma f16c avx_vnni"


@pytest.mark.parametrize(
    ("text", "numbers"),
    [
        ("5", [5]),
        ("0-0", [0]),
        ("1-9", [1, 2, 3, 4, 5, 6, 7, 8, 9]),
        ("1,2,3,5,9", [1, 2, 3, 5, 9]),
        ("1-3,5,9", [1, 2, 3, 5, 9]),
        ("9,1-2", [9, 1, 2]),  # in the order written
        ("1-3,2-4", [1, 2, 3, 4]),  # a number written twice, kept once
        (" 1 - 2 , 5 ", [1, 2, 5]),
    ],
)
def test_numbers_ranges_and_their_lists_parse(text: str, numbers: list[int]) -> None:
    assert parse_range(text) == numbers
    assert range_list(text) == numbers


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "is not a list of numbers and ranges"),
        ("x", "'x' is neither a number nor a range"),
        ("1-x", "'1-x' is neither a number nor a range"),
        ("1,,2", "'' is neither a number nor a range"),
        ("-1", "'-1' is neither a number nor a range"),
        ("1-", "'1-' is neither a number nor a range"),
        ("9-1", "the range 9-1 ends below its start"),
    ],
)
def test_anything_else_is_refused_with_a_sentence(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_range(text)
    if text:  # the argparse form: a usage error carrying the same sentence
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            range_list(text)


def test_an_empty_list_is_nothing_to_run() -> None:
    assert range_list("") == [] and range_list("  ") == []


def test_the_isa_class_is_named_from_the_flags() -> None:
    assert isa_class(SAPPHIRE_RAPIDS) == "avx512"
    assert isa_class(ZEN4.split()) == "avx512"
    assert isa_class(set(ZEN3.split())) == "avx2"
    assert isa_class(ALDER_LAKE) == "avx2"
    assert isa_class("fpu sse2 sse4_2") == "baseline"
    assert isa_class("") == "baseline"
    assert isa_class() in ISA_CLASSES  # this machine's


def test_the_isa_in_words_names_the_extensions_that_decide_the_kernels() -> None:
    assert isa_description(SAPPHIRE_RAPIDS) == "AVX-512 (F, BW, VNNI, BF16) + AMX (INT8, BF16)"
    assert isa_description(ZEN4) == "AVX-512 (F, BW, VNNI, BF16)"
    assert isa_description("avx2 avx512f") == "AVX-512 (F)"
    assert isa_description(ZEN3) == "AVX2 + FMA (no AVX-512)"
    assert isa_description(ALDER_LAKE) == "AVX2 + FMA + AVX-VNNI (no AVX-512)"
    assert isa_description("sse4_2") == "baseline (no AVX2)"
    assert isa_description()  # this machine's, whatever it is
