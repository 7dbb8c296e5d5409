"""The offline IWSLT14 De->En training data of benchmarks/RESULTS.md.

The course trains on the 160k IWSLT14 training pairs from the hub (`configs/iwslt14.yaml`);
offline we have only IWSLT14's valid and test sets (fairseq form: Moses-tokenized with
escaping, lowercased). This writes, under OUT:
  multi30k_train.{de,en}  Multi30k's training pairs in the same fairseq form
  iwslt_dev500.{de,en}    the first 500 IWSLT14 valid pairs (held out: validation)
  iwslt_train.{de,en}     the other 6,783 valid pairs (training)
  test.{de,en}            the IWSLT14 test set (6,750 pairs, fairseq form, the course's scoring)
Needs sacremoses (`pip install sacremoses`; not a jaxllm dependency: used for this data only).

  python benchmarks/iwslt_offline_data.py ../shared/data .gpu_data/iwslt_offline
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxllm.atomic_file import write_text_atomic

DEV = 500


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data_dir", type=Path, help="holds multi30k_de_en/ and iwslt14_de_en/")
    p.add_argument("out", type=Path)
    args = p.parse_args()
    try:
        from sacremoses import MosesTokenizer
    except ImportError:
        p.exit(2, "error: this script needs sacremoses (pip install sacremoses)\n")

    args.out.mkdir(parents=True, exist_ok=True)
    iwslt = args.data_dir / "iwslt14_de_en" / "fairseq_tok"
    for lang in ("de", "en"):
        tok = MosesTokenizer(lang=lang)
        m30k = (args.data_dir / "multi30k_de_en" / f"train.{lang}").read_text().splitlines()
        lines = [tok.tokenize(s.strip(), return_str=True, escape=True).lower() for s in m30k]
        write_text_atomic(args.out / f"multi30k_train.{lang}", "\n".join(lines) + "\n")
        valid = (iwslt / f"valid.{lang}").read_text().splitlines()
        write_text_atomic(args.out / f"iwslt_dev500.{lang}", "\n".join(valid[:DEV]) + "\n")
        write_text_atomic(args.out / f"iwslt_train.{lang}", "\n".join(valid[DEV:]) + "\n")
        write_text_atomic(args.out / f"test.{lang}", (iwslt / f"test.{lang}").read_text())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
