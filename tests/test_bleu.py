import pytest
import sacrebleu

from jaxllm.bleu import corpus_bleu

REFS = [
    "a man rides a bike on the street .",
    "two girls play in the snow .",
    "a dog runs across a green meadow .",
]


def test_copy_of_references_scores_100():
    score, signature = corpus_bleu(list(REFS), REFS)
    assert score == pytest.approx(100.0, abs=1e-9)  # exp(log(...)): 100.00000000000004
    assert signature.startswith("nrefs:1|")
    assert "tok:13a" in signature and f"version:{sacrebleu.__version__}" in signature


def test_matches_sacrebleu():
    hyps = ["a man rides a bicycle on the road .", "two girls play in snow .", "a dog runs ."]
    score, _ = corpus_bleu(hyps, REFS)
    assert score == sacrebleu.metrics.BLEU().corpus_score(hyps, [REFS]).score
    assert 0.0 < score < 100.0


def test_errors():
    with pytest.raises(ValueError, match="2 hypotheses but 3 references"):
        corpus_bleu(REFS[:2], REFS)
    with pytest.raises(ValueError, match="no hypotheses"):
        corpus_bleu([], [])
    with pytest.raises(TypeError, match=r"hypotheses\[1\] is list"):
        corpus_bleu(["a", ["b"], "c"], REFS)
