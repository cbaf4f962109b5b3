"""`bench compare`'s systems: which it can measure (`system_names`), and building those
selected: specdec engines per speculative config, transformers' generate (plain, prompt
lookup, assisted) and llama.cpp on the model's GGUF, each left out with a reason where it
cannot run here."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.bench.compare_systems import (
    SpecdecEngine,
    SpecdecSystem,
    System,
    TransformersSystem,
    Unavailable,
    assisted_kwargs,
    load_assistant,
    load_transformers_model,
    prompt_lookup_kwargs,
)
from specdec.bench.llama_cpp_system import LLAMA_CPP_MISSING, LlamaCppSystem, llama_cpp_installed
from specdec.config import SpeculativeConfig
from specdec.device import resolve_device, resolve_dtype
from specdec.errors import ConfigError
from specdec.models.gguf_model import native_gguf_file
from specdec.models.gguf_precision import gguf_at_precision, precision_for_dtype
from specdec.models.model_files import DEFAULT_MODEL, default_cache_dir, fetch_default_gguf, resolve_model
from verifier_svc.forward_choice import compile_by_default

DEFAULT_NGRAM = SpeculativeConfig.parse(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5})


def system_names(specs: Sequence[SpeculativeConfig]) -> dict[str, str]:
    """Every system this run could measure -> its kind, in table order."""
    labels: list[str] = []
    for spec in specs:
        label, number = spec.method, 2
        while label in labels:
            label, number = f"{spec.method}-{number}", number + 1
        labels.append(label)
    names = {"specdec": "specdec"}
    names.update({f"specdec-{label}": "specdec" for label in labels})
    names.update({"transformers": "transformers", "transformers-prompt-lookup": "transformers"})
    names.update({"transformers-assisted" + label.removeprefix("draft_model"): "transformers"
                  for label in labels if label.startswith("draft_model")})
    names.update({"llama.cpp": "llama.cpp", "llama.cpp-prompt-lookup": "llama.cpp"})
    return names


async def build_systems(args: argparse.Namespace, specs: list[SpeculativeConfig],
                        selected: list[str], model_dir: Path, tokenizer: Any,
                        max_model_len: int, engines: list[SpecdecEngine],
                        ) -> tuple[list[System], list[Unavailable]]:
    """The selected systems, in `selected`'s order; `engines` collects what must be stopped."""
    kinds = system_names(specs)
    built: dict[str, System] = {}
    unavailable: list[Unavailable] = []
    await _specdec_systems(args, specs, kinds, selected, model_dir, tokenizer, max_model_len,
                           engines, built, unavailable)
    _transformers_systems(args, specs, kinds, selected, model_dir, tokenizer, built, unavailable)
    _llama_cpp_systems(args, specs, kinds, selected, max_model_len, built, unavailable)
    return [built[name] for name in selected if name in built], unavailable


async def _specdec_systems(args: argparse.Namespace, specs: list[SpeculativeConfig],
                           kinds: dict[str, str], selected: list[str], model_dir: Path,
                           tokenizer: Any, max_model_len: int, engines: list[SpecdecEngine],
                           built: dict[str, System], unavailable: list[Unavailable]) -> None:
    spec_by_name = dict(zip([n for n in kinds if n.startswith("specdec-")], specs))
    compile_forward = compile_by_default(args.device, 1, args.enforce_eager)
    for name, spec in spec_by_name.items():
        if name in selected:
            try:
                engine = await SpecdecEngine.start(model_dir, args.model, args.dtype,
                                                   args.device, spec, max_model_len,
                                                   compile_forward, args.quantization)
            except ConfigError as exc:  # e.g. a draft built for another target
                unavailable.append(Unavailable(name, "specdec", exc.message))
                continue
            engines.append(engine)
            built[name] = SpecdecSystem(name, engine, True, tokenizer)
    if "specdec" in selected:  # plain: the first engine with k=0, or one without a drafter
        if not engines:
            engines.append(await SpecdecEngine.start(model_dir, args.model, args.dtype,
                                                     args.device, None, max_model_len,
                                                     compile_forward, args.quantization))
        built["specdec"] = SpecdecSystem("specdec", engines[0], False, tokenizer)


def _transformers_systems(args: argparse.Namespace, specs: list[SpeculativeConfig],
                          kinds: dict[str, str], selected: list[str], model_dir: Path,
                          tokenizer: Any, built: dict[str, System],
                          unavailable: list[Unavailable]) -> None:
    hf_names = [name for name in selected if kinds[name] == "transformers"]
    if not hf_names:
        return
    assisted_by_name = dict(zip([n for n in kinds if n.startswith("transformers-assisted")],
                                [spec for spec in specs if spec.method == "draft_model"]))
    lookup = _lookup_spec(specs)
    target = load_transformers_model(model_dir, args.dtype, args.device)
    for name in hf_names:
        if name == "transformers":
            built[name] = TransformersSystem(name, "transformers generate(), greedy",
                                             target, tokenizer, {})
        elif name == "transformers-prompt-lookup":
            built[name] = TransformersSystem(
                name, f"transformers prompt lookup k={lookup.num_speculative_tokens} max "
                      f"ngram {lookup.prompt_lookup_max}", target, tokenizer,
                prompt_lookup_kwargs(lookup))
        else:
            spec = assisted_by_name[name]
            try:
                assistant = load_assistant(resolve_model(str(spec.model)), target)
            except Exception as exc:
                unavailable.append(Unavailable(name, "transformers", f"{exc}"))
                continue
            built[name] = TransformersSystem(
                name, f"transformers assisted generation, draft {spec.model} "
                      f"k={spec.num_speculative_tokens}", target, tokenizer,
                assisted_kwargs(assistant, spec))


def _llama_cpp_systems(args: argparse.Namespace, specs: list[SpeculativeConfig],
                       kinds: dict[str, str], selected: list[str], max_model_len: int,
                       built: dict[str, System], unavailable: list[Unavailable]) -> None:
    llama_names = [name for name in selected if kinds[name] == "llama.cpp"]
    reason = None if llama_cpp_installed() else LLAMA_CPP_MISSING
    gguf = None if reason or not llama_names else gguf_file(args)
    if reason is None and gguf is None:
        reason = "no GGUF file for this model (pass --gguf PATH)"
    precision = llama_cpp_precision(args) if gguf is not None else "file"
    if gguf is not None and precision != "file":
        gguf = gguf_at_precision(gguf, precision, default_cache_dir() / "gguf")
    lookup = _lookup_spec(specs)
    for name in llama_names:
        if reason is not None:
            unavailable.append(Unavailable(name, "llama.cpp", reason))
            continue
        assert gguf is not None
        try:
            built[name] = LlamaCppSystem(name, gguf, args.threads, max_model_len,
                                         lookup if name.endswith("prompt-lookup") else None)
        except Exception as exc:
            unavailable.append(Unavailable(name, "llama.cpp", f"{type(exc).__name__}: {exc}"))


def _lookup_spec(specs: list[SpeculativeConfig]) -> SpeculativeConfig:
    """The prompt lookup the other engines run: the run's ngram config, else DEFAULT_NGRAM."""
    return next((spec for spec in specs if spec.method == "ngram"), DEFAULT_NGRAM)


def gguf_file(args: argparse.Namespace) -> Path | None:
    """The GGUF llama.cpp runs: --gguf, the default model's file, a .gguf --model, or the
    only .gguf inside a --model directory."""
    if args.gguf:
        return Path(args.gguf)
    if args.model.strip().lower() == DEFAULT_MODEL:
        return fetch_default_gguf(default_cache_dir())
    path = Path(args.model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def llama_cpp_precision(args: argparse.Namespace) -> str:
    """The GGUF precision llama.cpp runs at: --llama-cpp-precision, or for `same` the one
    that matches specdec's dtype and quantization (`file` where specdec serves the GGUF on
    its own blocks)."""
    if args.llama_cpp_precision != "same":
        return args.llama_cpp_precision
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if native_gguf_file(args.model, args.dtype, args.quantization, device, dtype, 1) is not None:
        return "file"
    return precision_for_dtype(str(dtype).removeprefix("torch."), args.quantization)
