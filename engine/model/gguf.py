"""GGUF checkpoints: dequantized once into a safetensors checkpoint cached by the file's hash.

A partial conversion never leaves a readable folder (temporary name, then rename, under a lock).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from engine.errors import ModelCorruptError, ModelNotFoundError, ModelNotSupportedError

log = logging.getLogger(__name__)

# GGUF's `general.architecture` names of the families the blend runs (a Mistral GGUF is
# usually written as "llama", which converts to the same layers).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Cache entries are named by this many hex digits of the file's SHA-256; the checkpoint inside
# is named like the file, so the served model's name is the GGUF's.
_DIGEST_CHARS = 16
_HASH_BLOCK_BYTES = 8 * 1024 * 1024


def is_gguf(path: str | Path) -> bool:
    """A `.gguf` file, or a folder that holds `.gguf` files and no checkpoint config."""
    path = Path(path)
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def gguf_file(path: str | Path) -> Path:
    """The GGUF file `path` names: itself, or the one `.gguf` in a folder.

    Raises ModelNotFoundError when there is none, or several to choose from.
    """
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(found) != 1:
        what = "no .gguf file" if not found else f"{len(found)} .gguf files (name one)"
        raise ModelNotFoundError(f"model {str(path)!r}: {what}")
    return found[0]


def file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def gguf_architecture(path: Path) -> str:
    """The file's `general.architecture`, read from its header and tensor table.

    Raises ModelCorruptError when the file is not a readable GGUF (bad magic, truncated).
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.get_field("general.architecture")
        if field is None:
            raise ValueError("no general.architecture field")
        return str(field.contents())
    # Any failure to parse is a damaged file; the parser raises ValueError, struct/numpy
    # errors or IndexError depending on where the bytes stop making sense.
    except Exception as exc:
        raise ModelCorruptError(
            f"model {str(path)!r} is not a readable GGUF file ({exc.__class__.__name__}: {exc})"
        ) from exc


def convert_gguf(path: str | Path, cache_dir: str | Path) -> Path:
    """The safetensors checkpoint of the GGUF at `path` (a file or a folder holding one),
    converted on the first call and found in `cache_dir` by content hash afterwards.

    Weights are dequantized to float32 (exact; `load_model` casts to the serving dtype).
    Safe under concurrent processes. Raises ModelNotFoundError (no file),
    ModelNotSupportedError (another architecture) or ModelCorruptError (unreadable file).
    """
    source = gguf_file(path)
    cache_dir = Path(cache_dir)
    digest = file_digest(source)[:_DIGEST_CHARS]
    entry = cache_dir / digest
    target = entry / source.stem
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / f".{digest}.lock")):
        if (target / "config.json").is_file():
            return target
        architecture = gguf_architecture(source)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelNotSupportedError(
                f"GGUF architecture {architecture!r} of {str(source)!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        partial = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{digest}.partial-"))
        try:
            _dequantize(source, partial / source.stem)
            partial.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users
            os.replace(partial, entry)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return target


def _dequantize(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors checkpoint in %s (once)", source, out.parent)
    started = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # The file is untrusted input: a header that parses can still hold tensors or a vocabulary
    # that transformers or tokenizers reject, with exceptions of their own.
    except Exception as exc:
        raise ModelCorruptError(
            f"model {str(source)!r} could not be dequantized ({exc.__class__.__name__}: {exc})"
        ) from exc
    # The weights are plain tensors now; without the quantizer save_pretrained writes them,
    # and without the quantization config the checkpoint loads as an ordinary one.
    model.hf_quantizer = None  # type: ignore[assignment]  # typed by nn.Module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log.info("converted %s in %.1f s", source.name, time.perf_counter() - started)


def build_parser() -> argparse.ArgumentParser:
    """`python -m engine.model.gguf FILE CACHE_DIR`: convert (or find) and print the folder.

    How `ragblend up` converts before its services start, in a process of its own so that the
    dequantized weights do not stay in the supervisor's memory; exit 2 with the reason on a
    file it cannot use.
    """
    parser = argparse.ArgumentParser(
        prog="python -m engine.model.gguf", description=build_parser.__doc__
    )
    parser.add_argument("gguf", help="a .gguf file, or a folder holding one")
    parser.add_argument("cache_dir", help="where converted checkpoints are kept")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        print(convert_gguf(args.gguf, args.cache_dir))
    except (ModelNotFoundError, ModelNotSupportedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
