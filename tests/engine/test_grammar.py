"""Structured output: a grammar-constrained request gets exactly what the target-only
engine gives under the same grammar (greedy and seeded sampling, fp32), its text follows
the grammar, and unconstrained rows in the same batch are untouched."""

from __future__ import annotations

import re

import pytest
from slimspec import SpeculativeDecoder
from slimspec.decoding.grammar import json_schema_grammar, regex_grammar
from slimspec.decoding.types import GenerationRequest, SamplingParams
from slimspec.server.baseline import TargetOnlyEngine

from tests.server.conftest import char_tokenizer
from tests.support.tiny_models import tiny_pair

PATTERN = r"[a-m]{2,6}( [0-9]{2,3}){1,3}"
EOS = 1
N_NEW = 40


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama", noise=0.15, seed=21)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def request(tok, rid: str, text: str, sampling: SamplingParams, grammar: str | None):
    ids = tok.encode(text, add_special_tokens=False)
    return GenerationRequest(rid, ids, N_NEW, sampling, frozenset({EOS}), None, grammar)


def target_only(target, tok, reqs):
    eng = TargetOnlyEngine(target, tok)
    out = {}
    for r in reqs:
        res = []
        eng.add_request(r)
        while eng.has_work():
            for o in eng.step():
                res.extend(o.new_token_ids)
        out[r.request_id] = res
    return out


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=1.0, seed=11)],
    ids=["greedy", "seeded"],
)
def test_constrained_speculation_equals_constrained_target(pair, tok, sampling):
    target, draft = pair
    dec = SpeculativeDecoder.from_models(
        target, draft, tok, compression_ratio=0.5, num_draft_tokens=3
    )
    grammar = regex_grammar(PATTERN)
    reqs = [
        request(tok, "c1", "pick: ", sampling, grammar),
        request(tok, "free", "pick: ", sampling, None),
        request(tok, "c2", "numbers and letters? ", sampling, grammar),
    ]
    results = {r.request_id: r for r in dec.generate_batch(reqs)}
    want = target_only(target, tok, reqs)
    assert dec.stats.accepted > 0  # drafts were accepted under the constraint
    for rid in ("c1", "c2"):
        out = results[rid].output_ids
        assert out == want[rid]
        assert out[-1] == EOS and results[rid].finish_reason == "stop"
        assert re.fullmatch(PATTERN, tok.decode(out[:-1])), tok.decode(out)
    assert results["free"].output_ids == want["free"]  # the free row is unconstrained
    assert not re.fullmatch(PATTERN, tok.decode(results["free"].output_ids))


def test_a_grammar_that_does_not_compile_is_refused(pair, tok):
    target, draft = pair
    dec = SpeculativeDecoder.from_models(target, draft, tok, compression_ratio=0.5)
    bad = request(tok, "bad", "x", SamplingParams(), regex_grammar("[unclosed"))
    with pytest.raises(ValueError, match="grammar"):
        dec.add_request(bad)
    with pytest.raises(ValueError, match="grammar"):
        TargetOnlyEngine(target, tok).add_request(bad)


def test_json_schema_grammar_compiles():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert json_schema_grammar(schema)
