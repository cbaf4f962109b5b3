"""--speculative-config parsing, table-driven against vLLM's rules."""

from __future__ import annotations

import pytest

from specdec.config import EngineConfig, SpeculativeConfig, parse_additional_config
from specdec.errors import ConfigError

VALID = [
    # (json, method, k, model, lookup_min, lookup_max)
    ('{"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 8}',
     "ngram", 1, None, 1, 8),
    ('{"method": "ngram", "num_speculative_tokens": 3}', "ngram", 3, None, 5, 5),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}', "ngram", 3, None, 3, 3),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 7}', "ngram", 3, None, 7, 7),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 4}',
     "ngram", 2, None, 4, 4),
    ('{"method": "eagle", "model": "/m/eagle", "num_speculative_tokens": 4}', "eagle", 4, "/m/eagle", None, None),
    ('{"method": "eagle3", "model": "/m/e3", "num_speculative_tokens": 2}', "eagle3", 2, "/m/e3", None, None),
    ('{"method": "draft_model", "model": "/m/small", "num_speculative_tokens": 5}',
     "draft_model", 5, "/m/small", None, None),
    # vLLM infers the method from the model when it is absent.
    ('{"model": "/m/EAGLE3-llama", "num_speculative_tokens": 2}', "eagle3", 2, "/m/EAGLE3-llama", None, None),
    ('{"model": "/m/eagle-vicuna", "num_speculative_tokens": 2}', "eagle", 2, "/m/eagle-vicuna", None, None),
    ('{"model": "/m/tiny-llama", "num_speculative_tokens": 2}', "draft_model", 2, "/m/tiny-llama", None, None),
    ('{"model": "[ngram]", "num_speculative_tokens": 2}', "ngram", 2, None, 5, 5),
    # A field vLLM knows but specdec does not use is accepted (with a warning).
    ('{"method": "ngram", "num_speculative_tokens": 2, "revision": "main"}', "ngram", 2, None, 5, 5),
    # vLLM's batch-size limit, which specdec honours (test_engine.py).
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}', "ngram", 2, None, 5, 5),
]


@pytest.mark.parametrize("text,method,k,model,lookup_min,lookup_max", VALID)
def test_valid_configs(text: str, method: str, k: int, model: str | None,
                       lookup_min: int | None, lookup_max: int | None) -> None:
    config = SpeculativeConfig.parse(text)
    assert config is not None
    assert (config.method, config.num_speculative_tokens, config.model,
            config.prompt_lookup_min, config.prompt_lookup_max) == (method, k, model, lookup_min, lookup_max)
    # The JSON handed to child processes parses back to the same config.
    assert SpeculativeConfig.parse(config.to_json()) == config


INVALID = [
    # (json, field named in the error)
    ('not json', "speculative_config"),
    ('[1, 2]', "speculative_config"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": -2}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": null}', "num_speculative_tokens"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method"),
    ('{"num_speculative_tokens": 2}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}', "prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "2"}', "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/m/x"}', "model"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
    ('{"method": "eagle3", "num_speculative_tokens": 2, "model": ""}', "model"),
    ('{"method": "eagle", "model": "/m/e", "num_speculative_tokens": 2, "prompt_lookup_min": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_lookahead": 3}', "num_lookahead"),
    # vLLM's bound (ge=2): a limit of 1 would leave speculation off for any batch.
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}', "disable_by_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "8"}', "disable_by_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": []}',
     "num_speculative_tokens_per_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4]]}',
     "num_speculative_tokens_per_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[4, 1, 1]]}',
     "num_speculative_tokens_per_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 3]]}',
     "num_speculative_tokens_per_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, '
     '"num_speculative_tokens_per_batch_size": [[1, 4, 2], [4, 8, 1]]}', "num_speculative_tokens_per_batch_size"),
]


@pytest.mark.parametrize("text,field", INVALID)
def test_invalid_configs_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.parse(text)
    assert info.value.param == field
    assert field in info.value.message or field.replace("_", "-") in info.value.message


def test_disable_by_batch_size_is_kept_and_passed_on(caplog: pytest.LogCaptureFixture) -> None:
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, '
                                     '"disable_by_batch_size": 12}')
    assert config is not None and config.disable_by_batch_size == 12
    assert "not used" not in caplog.text
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').disable_by_batch_size is None


def test_num_speculative_tokens_per_batch_size_caps_by_batch_size_and_is_passed_on() -> None:
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                     '"num_speculative_tokens_per_batch_size": [[5, 16, 1], [1, 4, 3]]}')
    assert config is not None and config.draft_caps is not None
    caps = config.draft_caps
    assert [caps.cap(n, 4) for n in (1, 4, 5, 16, 17)] == [3, 3, 1, 1, 4]  # uncovered: k
    assert SpeculativeConfig.parse(config.to_json()) == config


def test_invalid_method_lists_allowed_values() -> None:
    with pytest.raises(ConfigError, match="ngram, eagle, eagle3, draft_model"):
        SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 1}')


@pytest.mark.parametrize("text", [None, "", "  ", "null"])
def test_absent_config_means_no_speculation(text: str | None) -> None:
    assert SpeculativeConfig.parse(text) is None


def test_additional_config_names_unused_keys(caplog: pytest.LogCaptureFixture) -> None:
    assert parse_additional_config('{"ascend_scheduler_config": {"enabled": true}}') == {
        "ascend_scheduler_config": {"enabled": True}}
    assert "ascend_scheduler_config" in caplog.text
    with pytest.raises(ConfigError) as info:
        parse_additional_config("{oops")
    assert info.value.param == "additional_config"


@pytest.mark.parametrize("field", ["max_model_len", "max_num_seqs", "max_num_batched_tokens",
                                   "block_size", "num_kv_blocks"])
def test_engine_config_rejects_non_positive(field: str) -> None:
    values = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                  num_kv_blocks=16)
    values[field] = 0
    with pytest.raises(ConfigError):
        EngineConfig(**values)
