"""``engine-run shards TEXT... --out DIR``: token shards from UTF-8 text files, for
engine.token_shards.TokenShards (a recipe's ``data.shards=DIR``; docs/data.md).

    $ engine-run shards book.txt notes.txt --out data/shards
    wrote data/shards: 1 shard, 1,234,567 tokens (uint16), tokenizer bytes (vocabulary 256)
"""

from __future__ import annotations

import argparse


def main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog="engine-run shards",
        description="Write token shards (numpy memory-mappable files and index.json) "
                    "from UTF-8 text files.")
    parser.add_argument("texts", nargs="+", metavar="TEXT", help="UTF-8 text files, in order")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="the shard folder to write (its earlier shards are replaced)")
    parser.add_argument("--tokenizer", default="bytes", metavar="bytes|FILE",
                        help="bytes (UTF-8 bytes, vocabulary 256; the default) or a Hugging "
                             "Face tokenizer.json (needs the tokenizers package)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                        help="tokens per shard file (default 100,000,000)")
    args = parser.parse_args(argv)
    from engine.token_shards import write_shards  # imports torch: lazily

    index = write_shards(args.texts, args.out, tokenizer=args.tokenizer,
                         shard_tokens=args.shard_tokens)
    shards, tokens = index["shards"], sum(s["tokens"] for s in index["shards"])
    print(f"wrote {args.out}: {len(shards)} shard{'s' * (len(shards) != 1)}, {tokens:,} "
          f"tokens ({index['dtype']}), tokenizer {index['tokenizer']} (vocabulary "
          f"{index['vocab_size']:,})")
    return 0
