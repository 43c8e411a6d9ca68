"""`jaxllm convert`: write a model as an Orbax checkpoint (under checkpoints/)."""

from __future__ import annotations


def register(sub) -> None:
    conv = sub.add_parser("convert", help="convert a model to an Orbax checkpoint under checkpoints/")
    conv.add_argument("source", nargs="?", default=None, help="GGUF file, HF directory (default: the default model)")
    conv.add_argument("--out", required=True, help="output folder, e.g. checkpoints/NAME")
    conv.add_argument("--dtype", default="auto")
    conv.add_argument(
        "--tokenizer-only", action="store_true", help="write only the tokenizer's Hugging Face files (for eval tools)"
    )
    conv.set_defaults(func=run)


def run(args) -> None:
    from jaxllm.entrypoints.convert import convert, export_tokenizer

    out = export_tokenizer(args.source, args.out) if args.tokenizer_only else convert(args.source, args.out, args.dtype)
    print(f"wrote {out}")
