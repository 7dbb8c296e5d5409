"""Corpus BLEU with sacrebleu's defaults (what CMU 11-868 llmsys hw2 reports).

The signature (e.g. "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0") travels with
the score: BLEU numbers are only comparable under the same tokenization and settings.
"""

from __future__ import annotations

from collections.abc import Sequence

from sacrebleu.metrics import BLEU


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, str]:
    """BLEU (0..100) of hypotheses[i] against the single reference references[i]."""
    if len(hypotheses) != len(references):
        raise ValueError(
            f"{len(hypotheses)} hypotheses but {len(references)} references: they must pair up"
        )
    if not hypotheses:
        raise ValueError("no hypotheses to score")
    for name, texts in (("hypotheses", hypotheses), ("references", references)):
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"{name}[{bad}] is {type(texts[bad]).__name__}, not str")
    bleu = BLEU()
    score = bleu.corpus_score(list(hypotheses), [list(references)])  # one reference stream
    return score.score, str(bleu.get_signature())  # signature needs a scored corpus first


def hypotheses_text(hyps: list[str]) -> str:
    """The hypotheses as a file's text, one per line: a newline inside one (a decoded newline
    token) becomes a space, so that line i stays hypothesis i (BLEU treats both as whitespace)."""
    return "".join(h.replace("\r", " ").replace("\n", " ") + "\n" for h in hyps)
