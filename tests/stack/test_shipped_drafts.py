"""The drafts specdec ships for its default model: small, carded, found by name, lossless.

The last test loads the real default model (fp32) and each shipped draft through the real
drafter service and verifier engine: greedy output with speculation equals plain output
token for token, for free text and under a JSON schema (whose output must also satisfy
it), and the trained draft gets tokens accepted.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from drafter_svc.proposer import ModelOptions
from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.drafts import SHIPPED_DRAFTS, drafts_root, shipped_draft_dir
from specdec.engine.sampling_params import SamplingParams
from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model
from specdec.train.prompts import heldout_prompts
from tests.support.engine_harness import generate
from verifier_svc.requests import collect_outputs
from verifier_svc.builder import VerifierConfig, build_engine

MAX_FILE_BYTES = 25 * 10**6
MAX_TOKENS = 24


@pytest.mark.parametrize("name", sorted(SHIPPED_DRAFTS))
def test_a_shipped_draft_is_small_carded_and_found_by_name(name: str) -> None:
    directory = drafts_root() / name
    for file_name in ("config.json", "model.safetensors", "README.md", "training.json"):
        assert (directory / file_name).is_file(), file_name
    for path in directory.iterdir():
        assert path.stat().st_size < MAX_FILE_BYTES, path
    card = (directory / "README.md").read_text()
    assert "## Training" in card and "## Acceptance" in card
    assert resolve_model(name) == directory == shipped_draft_dir(name.upper())
    spec = SpeculativeConfig.parse({"model": name, "num_speculative_tokens": 4})
    assert spec is not None and spec.method == SHIPPED_DRAFTS[name]  # the method follows from the name
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as reader:
        names = list(reader.keys())
        assert not any("embed_tokens" in key for key in names)  # the target's, not stored
        dtypes = {str(reader.get_tensor(key).dtype) for key in names}
    assert dtypes <= {"torch.bfloat16", "torch.int64", "torch.bool"}
    assert json.loads((directory / "training.json").read_text())["method"] == SHIPPED_DRAFTS[name]


# A constrained request run beside the free ones: (text, JSON schema).
CONSTRAINED = ("Extract the person as JSON: Marta Ilves, 42, lives in Tartu.",
               {"type": "object", "properties": {
                   "name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "city": {"enum": ["Tartu", "Riga", "Vilnius"]}},
                "required": ["name", "age", "city"], "additionalProperties": False})


async def _outputs(target: Path, prompts: list[list[int]], spec: SpeculativeConfig | None,
                   constrained: list[int]):
    """The free prompts' outputs, then the constrained prompt's (under CONSTRAINED's schema)."""
    drafter, targets = None, ()
    if spec is not None:
        options = ModelOptions(target_model=str(target), dtype="float32", device="cpu",
                               num_blocks=64, block_size=16)
        drafter, port = await start_drafter_server(spec, "127.0.0.1", 0, options=options)
        targets = (f"127.0.0.1:{port}",)
    engine, _ = build_engine(build_config(VerifierConfig,
        model=str(target), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4,
        num_kv_blocks=64, speculative_config=spec, drafter_targets=targets,
        draft_timeout_s=30.0, adaptive_speculation=False))  # k drafts every step
    await engine.start()
    try:
        if engine.drafter_pool is not None:
            assert await engine.drafter_pool.wait_for_healthy(1, timeout_s=30.0)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        grammar = await engine.compile_grammar("json_schema", json.dumps(CONSTRAINED[1]))

        async def constrained_output() -> list[int]:
            _, queue = engine.add_request("constrained", constrained,
                                          SamplingParams(temperature=0.0, max_tokens=48),
                                          grammar=grammar)
            tokens, _ = await collect_outputs(queue)
            return tokens

        outputs = await asyncio.gather(*(generate(engine, prompt, params) for prompt in prompts),
                                       constrained_output())
    finally:
        await engine.stop()
        if drafter is not None:
            await stop_drafter_server(drafter)
    return list(outputs), engine.spec


@pytest.mark.timeout(900)  # the default model, loaded (and fetched on first use) once per shipped draft
def test_shipped_drafts_keep_greedy_output_on_the_default_model() -> None:
    target = resolve_model(DEFAULT_MODEL)
    tokenizer = load_tokenizer(target)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
               for text in heldout_prompts()[:2]]
    constrained = tokenizer.apply_chat_template([{"role": "user", "content": CONSTRAINED[0]}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    plain, _ = asyncio.run(_outputs(target, prompts, None, constrained))
    answer = json.loads(tokenizer.decode(plain[-1]))
    assert set(answer) == {"name", "age", "city"} and answer["city"] in ("Tartu", "Riga", "Vilnius")
    assert isinstance(answer["age"], int) and len(answer["name"]) <= 24
    for name, method in sorted(SHIPPED_DRAFTS.items()):
        spec = SpeculativeConfig.parse({"method": method, "model": name, "num_speculative_tokens": 4})
        outputs, counters = asyncio.run(_outputs(target, prompts, spec, constrained))
        assert outputs == plain, name
        assert counters.num_draft_tokens > 0 and counters.num_accepted_tokens > 0, name
