"""Sample text from a trained run: `python generate.py --run-dir R --prompt "Once upon a time"`.

Loads the run's config and its latest (or best) checkpoint, encodes the prompt(s) with the
GPT-2 tokenizer, and decodes with a KV cache until <|endoftext|> or --max-new-tokens. Config
fields are overridden as in train.py: `--execution.kernels=pallas` (how the model runs; the
model itself is the checkpoint's), `--data.tokens.bpe_dir=DIR` (the GPT-2 BPE files).
"""

from __future__ import annotations

from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()  # before jax is imported: XLA reads its flags then

import argparse
import sys

from jaxllm.config import ConfigError
from jaxllm.console import use_one_line_warnings
from jaxllm.data.tokenizer import EOT_ID, load_gpt2_tokenizer
from jaxllm.generate import Sampling, generate_text
from jaxllm.models import build_model
from jaxllm.runs import load_run


class PromptTokenizer:
    """GPT-2's tokenizer for prompts typed on a command line: `<|endoftext|>` in a prompt is the
    document separator the model was trained with (tiktoken refuses special tokens in text by
    default, with advice a CLI user cannot follow)."""

    def __init__(self, encoding):
        self.encoding, self.n_vocab = encoding, encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special={"<|endoftext|>"})

    def decode(self, tokens: list[int]) -> str:
        return self.encoding.decode(tokens)


def main(argv: list[str] | None = None) -> int:
    use_one_line_warnings()
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Config overrides: --execution.kernels=pallas --data.tokens.bpe_dir=DIR",
    )
    p.add_argument("--run-dir", required=True, help="a train.py run dir with checkpoints")
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="prompt text; repeat the flag for a batch of prompts",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--checkpoint", choices=["latest", "best"], default="latest")
    args, overrides = p.parse_known_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        cfg, params, step = load_run(args.run_dir, args.checkpoint, overrides=overrides)
        if cfg.data.kind != "tokens":  # its ids are not GPT-2 BPE ids
            translate = cfg.data.kind == "translation"
            raise ValueError(
                f"{args.run_dir} was trained on data.kind={cfg.data.kind}, not GPT-2-tokenized "
                "text (data.kind=tokens): generate.py cannot encode prompts for it"
                + (" (translation: python -m jaxllm.translate)" if translate else "")
            )
        # <|endoftext|> ends a sample whatever the vocabulary's padding (e.g. 50304)
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            eos_id=EOT_ID)  # fmt: skip
        budget = cfg.model.context_length
        tokenizer = PromptTokenizer(load_gpt2_tokenizer(cfg.data.tokens.bpe_dir))
        longest = max(len(tokenizer.encode(t)) for t in args.prompt)
        max_new = min(args.max_new_tokens, budget - longest)
        if max_new < 1:
            raise ValueError(
                f"the prompt ({longest} tokens) fills the context ({budget}): a prompt may take "
                f"at most {budget - 1} tokens"
            )
        if max_new < args.max_new_tokens:
            print(f"note: max-new-tokens cut to {max_new} (context {budget})", file=sys.stderr)
        model = build_model(cfg.model, cfg.execution)
        print(model.plan.describe(), file=sys.stderr)
        texts = generate_text(model, params, tokenizer, args.prompt, max_new, sampling, args.seed)
    except (FileNotFoundError, ValueError, ConfigError) as e:
        p.error(str(e))
    print(f"# {args.run_dir} step {step} ({args.checkpoint} checkpoint)", file=sys.stderr)
    for prompt, text in zip(args.prompt, texts, strict=True):
        print(prompt + text)
        print("-" * 40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
