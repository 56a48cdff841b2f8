"""``mixprec prepare``: tokenize text files into a token file (:mod:`mixprec.data.prepare`)."""
from __future__ import annotations

import argparse
import sys
from mixprec.data.prepare import prepare_files

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``mixprec prepare``."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="text files or folders of text files")
    parser.add_argument("-o", "--output", required=True, help="token file to write (e.g. data/train.tokens)")
    parser.add_argument("--tokenizer", default=None, metavar="JSON",
                        help="a local Hugging Face tokenizer.json (needs `pip install tokenizers`); "
                             "default: byte-level tokens, vocabulary 256")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="vocabulary size to record (default: the tokenizer's, or 256 for bytes)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")


def run(args: argparse.Namespace) -> int:
    """Run ``mixprec prepare``; prints one summary line."""
    result = prepare_files(args.inputs, args.output, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                           progress=not args.quiet, overwrite=args.overwrite)
    for path, share in result.binary:
        print(f"mixprec: warning: data looks binary: {share:.0%} non-text bytes in the first 64 KiB of "
              f"{path}; check the input", file=sys.stderr)
    print(f"wrote {result.path}: {result.num_tokens:,} tokens from {result.num_files} file(s), "
          f"vocab_size {result.vocab_size} ({result.tokenizer})")
    return 0
