"""The one place a drafting method is chosen: `--speculative-config`'s method to a Proposer.

The model methods are imported only when chosen (they pull in torch); every method module
depends on `drafter_svc.proposer`'s shared types, and only this module depends on them.
"""

from __future__ import annotations

from collections.abc import Callable

from drafter_svc.proposer import ModelOptions, NgramMethod, Proposer
from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError


def proposer_factory(config: SpeculativeConfig,
                     options: ModelOptions | None = None) -> Callable[[], Proposer]:
    """Checks the method at start-up; returns a callable making a fresh Proposer per stream.

    Model methods load their weights and allocate the draft KV pool here, once per server;
    each stream's Proposer holds only its sequences' state and block tables.
    """
    if config.method == "ngram":
        method = NgramMethod.from_config(config, options)  # validates once, at start-up
        return lambda: NgramMethod(method.proposer, method.info)
    if config.method == "suffix":
        from drafter_svc.suffix_proposer import SuffixMethod, build_suffix_method

        # One global tree per server: every stream's method shares the template's cache.
        template = build_suffix_method(config, options)
        return lambda: SuffixMethod(template.params, template.cache, template.info)
    options = options or ModelOptions()
    if config.method == "draft_model":
        from drafter_svc.draft_model_proposer import build_draft_model_method

        return build_draft_model_method(config, options)
    if config.method == "eagle":
        from drafter_svc.eagle_proposer import build_eagle_method

        return build_eagle_method(config, options)
    if config.method == "eagle3":
        from drafter_svc.eagle3_proposer import build_eagle3_method

        return build_eagle3_method(config, options)
    raise ConfigError(f"speculative config: unknown method {config.method!r}", param="method")
