"""`jaxllm convert`: write a model as an Orbax checkpoint (under checkpoints/)."""

from __future__ import annotations


def register(sub) -> None:
    conv = sub.add_parser("convert", help="convert a model to an Orbax checkpoint under checkpoints/")
    conv.add_argument("source", nargs="?", default=None, help="GGUF file, HF directory (default: the default model)")
    conv.add_argument("--out", required=True, help="output folder, e.g. checkpoints/NAME")
    conv.add_argument("--dtype", default="auto")
    conv.set_defaults(func=run)


def run(args) -> None:
    from jaxllm.entrypoints.convert import convert

    out = convert(args.source, args.out, dtype=args.dtype)
    print(f"wrote {out}")
